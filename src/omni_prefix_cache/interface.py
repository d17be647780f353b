"""Shared types, configuration, errors and the per-model cache policy.

Names and behaviour match upstream vLLM-Omni's ``prefix_cache.interface`` so
engines can switch imports without other edits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeAlias

import torch

from omni_prefix_cache.adapter import PrefixCacheRequestOwner
from omni_prefix_cache.errors import (
    OmniPrefixCacheAcceptedRowsError,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheJoinTimeoutError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
)

# The errors live in errors.py (no torch, so the adapter can raise them);
# this is their upstream import path.
__all__ = [
    "output_consumer",
    "output_progress",
    "HIDDEN_KEY",
    "ModelCachePolicy",
    "OmniPrefixCacheAcceptedRowsError",
    "OmniPrefixCacheInvalidArgumentError",
    "OmniPrefixCacheInvalidTypeError",
    "OmniPrefixCacheJoinTimeoutError",
    "OmniPrefixCacheShutdownError",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OmniPrefixCacheWriteFailedError",
    "PrefixCacheConfig",
    "PrefixCacheRequestProgress",
    "ReqId",
    "StageCacheOutputs",
    "StepId",
    "TensorName",
    "Tid",
    "WriteSchedule",
    "is_hidden_key",
    "without_hidden",
]

# Identities: plain str/int at runtime, but never interchangeable.
TensorName: TypeAlias = str  # which cached tensor (hidden or an mm name)
ReqId: TypeAlias = str  # vLLM request id
Tid: TypeAlias = int  # WriteTask handle
StepId: TypeAlias = int  # save_outputs id, consumed exactly once

# Pool key reserved for hidden states; mm keys are flat dotted names.
HIDDEN_KEY: TensorName = "__hidden_states__"


def is_hidden_key(key: TensorName) -> bool:
    return key == HIDDEN_KEY


def without_hidden(keys: Iterable[TensorName]) -> set[TensorName]:
    """The mm names among ``keys`` (everything but the hidden key)."""
    return {k for k in keys if k != HIDDEN_KEY}


class WriteSchedule(Enum):
    """When a WriteTask's rows travel to the CPU pool."""

    # Immediately cached keys: the device->host copy is launched at save into
    # a staging page; the committer waits it and writes the pool. The next
    # save waits for these writes (a reused slot must be pool-complete).
    JOIN_NEXT_STEP = "join_next_step"
    # Deferred mm keys: rows stay in a device clone until finish/abort, or
    # until the GPU-byte budget forces the oldest pending task to copy.
    JOIN_ON_FINISH = "join_on_finish"


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Sizing and flow-control knobs."""

    num_blocks: int
    block_size: int
    # Device-clone byte budget for JOIN_ON_FINISH writes, charged the same on
    # every engine; over it, the oldest pending task is forced to copy. The
    # immediate clone is bounded by the staging pages instead (docs/cuda.md).
    gpu_staging_bytes: int = 512 * 1024 * 1024
    # Staging pages, each holding one whole step (not one request).
    staging_depth: int = 4
    staging_capacity_tokens: int = 1024
    # How long save waits for a free page and join waits for the committer.
    staging_claim_timeout_s: float = 30.0
    # Device->host piece size for JOIN_ON_FINISH copies.
    copy_chunk_bytes: int = 16 * 1024 * 1024
    # Runtime metrics (docs/stats.md, "Metrics"): spec move counts, time in
    # state, data-path figures. Process-wide: a manager built with it on
    # turns them on for the process. Off by default: on costs about 0.5 us
    # per spec move on the thread that moves (docs/stats.md has the numbers).
    metrics: bool = False
    # Trace file (docs/trace.md): every spec move and facade call, as JSON
    # lines, for ``omni-prefix-cache validate``. None: the environment
    # variable OMNI_PREFIX_CACHE_TRACE names one, or no trace.
    trace_path: str | None = None
    # The host tier's byte bound on this side (docs/integration.md, "Behind a
    # KV connector"). None: only the scheduler side's bound applies.
    host_tier_bytes: int | None = None
    # The KV cache group whose slots key the rows: its index in vLLM's
    # kv_cache_config.kv_cache_groups (a full-attention group; the gate,
    # group_view.stage_prefix_cache_config, picks it). 0 for a single group.
    kv_cache_group_index: int = 0
    # The committer thread's linger (docs/integration.md, "Guarantees"): with
    # no kick (an engine gone idle after its last step), writes a save queued
    # start once they waited a whole linger, within 2 x this of their save; an
    # idle committer looks at its queues once per linger.
    committer_linger_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "staging_depth", "staging_capacity_tokens", "copy_chunk_bytes"):
            if int(getattr(self, name)) <= 0:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"PrefixCacheConfig.{name} must be positive, got {getattr(self, name)}"
                )
        index = self.kv_cache_group_index
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"PrefixCacheConfig.kv_cache_group_index must be a KV cache group index >= 0, "
                f"got {self.kv_cache_group_index!r}"
            )
        if self.gpu_staging_bytes < 0 or self.staging_claim_timeout_s < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                "PrefixCacheConfig: gpu_staging_bytes and staging_claim_timeout_s must be >= 0"
            )
        linger = self.committer_linger_s
        if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 < linger < float("inf"):
            raise OmniPrefixCacheInvalidArgumentError(
                f"PrefixCacheConfig.committer_linger_s must be a positive number of seconds, got {linger!r}"
            )
        tier = self.host_tier_bytes
        if tier is not None and (isinstance(tier, bool) or not isinstance(tier, int) or tier <= 0):
            raise OmniPrefixCacheInvalidArgumentError(
                f"PrefixCacheConfig.host_tier_bytes must be None or a positive int, got {tier!r}"
            )

    @classmethod
    def from_vllm_config(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        scheduler_config: Any = None,
        model_config: Any = None,
        kv_cache_group_index: int = 0,
    ) -> PrefixCacheConfig:
        """Size staging pages from the running scheduler; ``kv_cache_group_index``
        is the keyed group's (``stage_prefix_cache_config`` picks it).

        A page holds one step, so its capacity is ``max_num_batched_tokens``
        (falling back to ``max_model_len``, then 1024). ``staging_depth`` keeps
        its default: it bounds unconsumed step ids, not sequences. A step
        larger than the capacity raises at save; nothing is clamped.
        """
        batched = getattr(scheduler_config, "max_num_batched_tokens", None)
        model_len = getattr(scheduler_config, "max_model_len", None)
        if not model_len and model_config is not None:
            model_len = getattr(model_config, "max_model_len", None)
        try:
            capacity = int(batched or model_len or 1024)
        except (TypeError, ValueError):
            capacity = 1024
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            staging_capacity_tokens=max(1, capacity),
            kv_cache_group_index=kv_cache_group_index,
        )


@dataclass
class PrefixCacheRequestProgress:
    """One request owner's positions (watermarks), each a token count.

    ``computed_upto``: positions the model has computed; ``saved_upto``:
    positions whose writes are registered (not necessarily in the CPU pool
    yet); ``delivered_upto[consumer]``: positions that consumer has received.
    ``lookup`` is the cache lookup as ``(hit tokens, block ids per group)``;
    None while it is pending, ``(0, ...)`` for a lookup that found nothing.
    ``retired``: the owner was replaced or ended, its outputs are dropped.
    """

    computed_upto: int = 0
    saved_upto: int = 0
    delivered_upto: dict[str, int] = field(default_factory=dict)
    owner: PrefixCacheRequestOwner | None = None
    lookup: tuple[int, tuple[tuple[int, ...], ...]] | None = None
    retired: bool = False


@dataclass
class StageCacheOutputs:
    """Per-request merged outputs of one materialized step, and where they sit.

    ``token_ranges[req]``: the token positions ``[start, end)`` the rows of
    ``req`` cover; ``scheduled_token_ranges[req]``: the positions this step
    computed. ``cached_mm_keys``: the mm keys served from the cache;
    ``token_mm_keys``: those that are token-major (one row per position).
    ``_progress`` and ``_consumer`` record which request progress and
    consumer a delivery view was taken from, for its acknowledgement.
    """

    hidden_states: dict[ReqId, torch.Tensor] | None  # None when the policy skips hidden
    mm_outputs: dict[TensorName, dict[ReqId, Any]]
    token_ranges: dict[ReqId, tuple[int, int]] = field(default_factory=dict)
    scheduled_token_ranges: dict[ReqId, tuple[int, int]] = field(default_factory=dict)
    cached_mm_keys: frozenset[TensorName] = frozenset()
    token_mm_keys: frozenset[TensorName] = frozenset()
    _progress: dict[ReqId, PrefixCacheRequestProgress] = field(default_factory=dict, repr=False)
    _consumer: str | None = field(default=None, repr=False)


def output_progress(outputs: StageCacheOutputs) -> dict[ReqId, PrefixCacheRequestProgress]:
    """The request progress (tenure) each request of ``outputs`` was saved under."""
    return outputs._progress


def output_consumer(outputs: StageCacheOutputs) -> str | None:
    """The consumer a delivery view was taken for (None for a raw output)."""
    return outputs._consumer


@dataclass(frozen=True)
class ModelCachePolicy:
    """What one model caches: hidden states or not, and its deferred mm keys."""

    needs_full_hidden_states: bool = True
    # Token-major mm keys kept on the device clone until finish/abort.
    deferred_keys: frozenset[TensorName] = frozenset()
    # The model writes its mm outputs in sample(), after the step was saved,
    # so the step's snapshot lacks them: the runner drops the snapshot and
    # builds the payload from the live outputs. Those carry no full-prompt
    # hidden states, hence the refusal below.
    mm_outputs_written_in_sample: bool = False

    def __post_init__(self) -> None:
        if self.mm_outputs_written_in_sample and self.needs_full_hidden_states:
            raise OmniPrefixCacheInvalidArgumentError(
                "ModelCachePolicy: mm_outputs_written_in_sample=True needs needs_full_hidden_states=False "
                "(requires_full_prefix_cached_hidden_states = False on the model): the payload is built "
                "from the live outputs, which carry no full-prompt hidden states"
            )

    @property
    def hidden_key(self) -> TensorName | None:
        """HIDDEN_KEY when this model caches hidden states, else None."""
        return HIDDEN_KEY if self.needs_full_hidden_states else None

    def get_hit_keys(self, keys: Iterable[TensorName]) -> list[TensorName]:
        """Keys to serve for a hit: hidden first (if cached), then mm sorted."""
        mm = sorted(without_hidden(keys))
        return [HIDDEN_KEY, *mm] if self.needs_full_hidden_states else mm

    def skip_immediate_mm(self, key: TensorName) -> bool:
        """True for keys the immediate (JOIN_NEXT_STEP) mm path must not take."""
        return is_hidden_key(key) or key in self.deferred_keys

    @classmethod
    def from_model(cls, model: Any) -> ModelCachePolicy:
        """Read the legacy per-model attributes; raises as the constructor."""
        deferred = frozenset(getattr(model, "deferred_prefix_cache_mm_keys", ()) or ())
        needs = bool(getattr(model, "requires_full_prefix_cached_hidden_states", True))
        in_sample = bool(getattr(model, "mm_outputs_written_in_sample", False))
        return cls(needs_full_hidden_states=needs, deferred_keys=deferred, mm_outputs_written_in_sample=in_sample)
