"""The ``slot_occupancy`` spec's state tags as lookup tables over slot states.

A tag in spec/slot_occupancy.yaml names a group of states (``owned``: a write
owns the row; ``read_pool`` / ``read_baseline`` / ``read_owner``: where a
planned read takes a row from; ``read_refused``: a row no read may take). Each table here is indexed by a slot-state
tensor, so "which rows are owned" or "where is each row read from" is one
``index_select`` over a whole slot tensor, never a loop over slots.

Pure tables, built once at import; no lock.
"""

from __future__ import annotations

import torch

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs import load_spec
from omni_prefix_cache.specs.types.slot_occupancy import SlotState

_SPEC = load_spec("slot_occupancy")


def state_mask(tag: str) -> torch.Tensor:
    """A bool lookup table over slot states: True for the states the spec
    tags ``tag`` (index it with a state tensor: ``rows_tagged(state, mask)``).
    Raises OmniPrefixCacheUnmatchError naming the spec when no state has the tag."""
    tagged = {SlotState[name] for name in _SPEC.tagged(tag)}
    if not tagged:
        raise OmniPrefixCacheUnmatchError(f"{_SPEC.origin}: no state is tagged {tag!r}")
    return torch.tensor([state in tagged for state in SlotState], dtype=torch.bool)


def rows_tagged(state: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table``'s entry for each row's state: with a ``state_mask``, which
    rows are in a tagged state; with ``READ_SOURCE``, where each is read from."""
    return table.index_select(0, state.to(torch.int64))


# Rows a write owns (IN_TRANSIT): the owner table names their writer.
OWNED = state_mask("owned")
# Where a planned read takes a row from, by its slot state's tag (read_pool: the pool).
READ_BASELINE = state_mask("read_baseline")
READ_OWNER = state_mask("read_owner")
# read_refused: no read may take the row (a rejected speculative draft).
READ_REFUSED = state_mask("read_refused")
# All at once, as bits per slot state (0: the row is read from the pool), so
# a read whose rows are all committed is told apart with one lookup.
READ_FROM_BASELINE, READ_FROM_OWNER, READ_NOWHERE = 1, 2, 4
READ_SOURCE = (
    READ_BASELINE.to(torch.int8) * READ_FROM_BASELINE
    + READ_OWNER.to(torch.int8) * READ_FROM_OWNER
    + READ_REFUSED.to(torch.int8) * READ_NOWHERE
)


def refuse_rejected(source: torch.Tensor, slots: torch.Tensor, what: str) -> None:
    """Raise OmniPrefixCacheUnmatchError naming ``what`` and the slots when
    a row of a planned read (``source``: its ``READ_SOURCE`` bits) is
    tagged read_refused: a rejected speculative draft no save wrote again."""
    refused = (source & READ_NOWHERE) != 0
    if bool(refused.any()):
        raise OmniPrefixCacheUnmatchError(
            f"{what} at slots {slots[refused].tolist()[:16]} are rejected "
            "speculative drafts (REJECTED) that no save wrote again; the omni cache diverged from the KV cache"
        )
