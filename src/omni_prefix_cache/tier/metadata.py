"""What the tier's scheduler side hands the worker each step (no torch, no vLLM).

The scheduler side (``tier.connector.OmniTierConnector``) decides what the host
tier holds; the worker only follows. Each step's ``TierStepMetadata`` says, in
this order:

1. ``release``: hashes the tier no longer holds (LRU or the connector evicted
   their KV). The worker drops them.
2. ``bind``: hashes the tier holds from now on, each with the GPU block whose
   slots hold its rows now (a finished request's cached full blocks). The rows
   stay in the slot pool until vLLM reuses the block; the reuse fills the tier.
3. ``loads``: per request scheduled this step, the block-aligned range the KV
   connector loaded into new blocks, with one hash per block. The worker
   restores those blocks' rows from the tier into the new blocks' slots
   before the request's hit is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

BlockHash = bytes  # vLLM's hash of one KV block of the keyed group (kv_layout_gate), as bytes


@dataclass(frozen=True)
class TierBind:
    """The tier holds ``block_hash`` from now on; its rows are in ``block_id``'s slots."""

    block_hash: BlockHash
    block_id: int


@dataclass(frozen=True)
class TierLoad:
    """The connector loaded positions ``[token_start, token_start + len(hashes) * block_size)``
    of ``req_id`` into new blocks; ``hashes[i]`` keys the block at position
    ``token_start + i * block_size``."""

    req_id: str
    token_start: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class TierStepMetadata:
    """One scheduler step's tier updates, applied by the worker in field order."""

    release: tuple[BlockHash, ...] = ()
    bind: tuple[TierBind, ...] = ()
    loads: Mapping[str, TierLoad] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.release or self.bind or self.loads)


def tier_metadata_of(kv_connector_metadata: object) -> TierStepMetadata | None:
    """The tier part of a step's ``kv_connector_metadata`` (the wrapper's
    metadata carries it as ``omni_tier``), or None when another connector, or
    none, built it."""
    tier = getattr(kv_connector_metadata, "omni_tier", None)
    return tier if isinstance(tier, TierStepMetadata) else None
