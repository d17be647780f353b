"""Shared types, configuration, errors and the per-model cache policy.

Names and behaviour match upstream vLLM-Omni's ``prefix_cache.interface`` so
engines can switch imports without other edits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, TypeAlias

import torch

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

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "staging_depth", "staging_capacity_tokens", "copy_chunk_bytes"):
            if int(getattr(self, name)) <= 0:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"PrefixCacheConfig.{name} must be positive, got {getattr(self, name)}"
                )
        if self.gpu_staging_bytes < 0 or self.staging_claim_timeout_s < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                "PrefixCacheConfig: gpu_staging_bytes and staging_claim_timeout_s must be >= 0"
            )

    @classmethod
    def from_vllm_config(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        scheduler_config: Any = None,
        model_config: Any = None,
    ) -> PrefixCacheConfig:
        """Size staging pages from the running scheduler.

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
        return cls(num_blocks=num_blocks, block_size=block_size, staging_capacity_tokens=max(1, capacity))


class StageCacheOutputs(NamedTuple):
    """Per-request merged outputs of one materialized step."""

    hidden_states: dict[ReqId, torch.Tensor] | None  # None when the policy skips hidden
    mm_outputs: dict[TensorName, dict[ReqId, Any]]


class OmniPrefixCacheUnmatchError(RuntimeError):
    """A contract, configuration or KV-occupancy break. Never a miss.

    Raised for hits on absent slots, step ids consumed twice or never saved,
    steps larger than a staging page, failed writes, and every other broken
    rule; the message names the request, key, slots or step involved.
    """


class OmniPrefixCacheInvalidArgumentError(OmniPrefixCacheUnmatchError, ValueError):
    """A facade call was given a bad value (a negative count, a misaligned
    hit, a tensor with the wrong shape, dtype or device, ...).

    Raised before the call changes anything: the manager is exactly as it
    was, so the caller may fix the input and call again.
    """


class OmniPrefixCacheInvalidTypeError(OmniPrefixCacheInvalidArgumentError, TypeError):
    """A facade call was given a value of the wrong type (a float or bool
    where a count or step id belongs, a ``str`` where a list of request ids
    belongs, ...). Raised before the call changes anything."""


class OmniPrefixCacheWriteFailedError(OmniPrefixCacheUnmatchError):
    """A write of cached rows to the CPU pool failed. Sticky: rows behind
    block hashes vLLM already published never landed, so every later
    serving entry raises this error again.

    ``tid``, ``req_id``, ``keys`` and ``slots`` name the first failed write
    (None where unknown); ``req_ids`` every request whose rows it held (a
    step's write holds all of the step's requests, ``req_id`` the first);
    the underlying exception is ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        tid: Tid | None = None,
        req_id: ReqId | None = None,
        keys: tuple[TensorName, ...] = (),
        slots: tuple[int, ...] = (),
        req_ids: tuple[ReqId, ...] = (),
    ) -> None:
        super().__init__(message)
        self.tid = tid
        self.req_id = req_id
        self.req_ids = req_ids if req_ids or req_id is None else (req_id,)
        self.keys = keys
        self.slots = slots

    def again(self) -> OmniPrefixCacheWriteFailedError:
        """A fresh error with the same details and cause, to raise from a
        later entry (one exception object is never raised on two threads)."""
        err = OmniPrefixCacheWriteFailedError(
            str(self), tid=self.tid, req_id=self.req_id, keys=self.keys, slots=self.slots, req_ids=self.req_ids
        )
        err.__cause__ = self.__cause__
        return err


class OmniPrefixCacheShutdownError(OmniPrefixCacheUnmatchError):
    """The manager was shut down before or during the call."""


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """A save waited for a free staging page and timed out."""


class OmniPrefixCacheJoinTimeoutError(OmniPrefixCacheUnmatchError):
    """A join (the save barrier, a budget flush, a hit read of rows not yet
    in the pool) waited ``staging_claim_timeout_s`` for a write that neither
    finished nor failed. The message names the task, its state and the
    writes in flight; nothing was registered by the call that joined."""


@dataclass(frozen=True)
class ModelCachePolicy:
    """What one model caches: hidden states or not, and its deferred mm keys."""

    needs_full_hidden_states: bool = True
    # Token-major mm keys kept on the device clone until finish/abort.
    deferred_keys: frozenset[TensorName] = frozenset()

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
        """Read the legacy per-model attributes."""
        deferred = frozenset(getattr(model, "deferred_prefix_cache_mm_keys", ()) or ())
        needs = bool(getattr(model, "requires_full_prefix_cached_hidden_states", True))
        return cls(needs_full_hidden_states=needs, deferred_keys=deferred)
