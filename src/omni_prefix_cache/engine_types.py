"""What the library reads from vLLM, as ``typing.Protocol`` classes.

vLLM is never imported here: these describe, by name, the attributes of
vLLM's scheduler output and input batch that the manager, the group view
and the ``simulate --engine vllm`` driver read, and (``GroupViewLike``) what
the manager reads from its group view. ``tests_vllm`` checks every
member against vLLM's real classes, so an upgrade that renames a field fails
a test instead of silently reading a default. Checked against vLLM 0.33.0.
Members are read-only properties: the library only reads them, so frozen
dataclasses and narrower types (a ``dict`` for a ``Mapping``) satisfy them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from omni_prefix_cache.interface import ReqId


@runtime_checkable
class NewRequestDataLike(Protocol):
    """``vllm.v1.core.sched.output.NewRequestData``: a request entering the batch.

    Brand new, a streaming continuation, or (Model Runner V2) a request
    resumed after preemption. Only one that is not live is a hit candidate.
    """

    @property
    def req_id(self) -> ReqId: ...
    @property
    def num_computed_tokens(self) -> int: ...  # prefix-cache hit tokens (block aligned) for a brand-new request
    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...  # one list per KV cache group; the keyed one is read


@runtime_checkable
class CachedRequestDataLike(Protocol):
    """``vllm.v1.core.sched.output.CachedRequestData``: requests already known to the runner.

    The manager does not read it (none of these is a hit: a resumed request
    is still live). The vLLM driver reads it to keep the input batch current.
    """

    req_ids: Sequence[ReqId]
    resumed_req_ids: set[ReqId]  # their new_block_ids replace the row (0.33 default runner)
    new_block_ids: Sequence[Sequence[Sequence[int]] | None]
    num_computed_tokens: Sequence[int]


@runtime_checkable
class SchedulerOutputLike(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput``: what ``new_step_starts`` reads."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestDataLike]: ...
    @property
    def finished_req_ids(self) -> set[ReqId]: ...  # finished or aborted since the previous step
    @property
    def num_scheduled_tokens(self) -> Mapping[ReqId, int]: ...


@runtime_checkable
class RunnerSchedulerOutputLike(SchedulerOutputLike, Protocol):
    """The scheduler output as the model runner's ``_update_states`` reads it."""

    scheduled_cached_reqs: CachedRequestDataLike


@runtime_checkable
class SpecDecodeSchedulerOutputLike(Protocol):
    """Speculative decoding's field of ``SchedulerOutput``: the adapter reads
    each request's scheduled draft tokens (``PrefixCacheStep.draft_tokens``)."""

    @property
    def scheduled_spec_decode_tokens(self) -> Mapping[ReqId, Sequence[int]]: ...


@runtime_checkable
class ModelRunnerOutputLike(Protocol):
    """``vllm.v1.outputs.ModelRunnerOutput``: what ``adapter.accepted_rows_of``
    reads (per batch row, the request and the tokens its step sampled)."""

    @property
    def req_ids(self) -> Sequence[ReqId]: ...
    @property
    def sampled_token_ids(self) -> Sequence[Sequence[int]]: ...


class CpuTensorHolder(Protocol):
    """vLLM's ``CpuGpuBuffer``: its ``cpu`` tensor is the block table the view gathers from."""

    @property
    def cpu(self) -> torch.Tensor | np.ndarray: ...  # int32, rows x max blocks per request


@runtime_checkable
class BlockTableLike(Protocol):
    """``vllm.v1.worker.block_table.BlockTable``: one KV cache group's table.

    In vLLM 0.33 the table holds KV-manager (allocator) block ids and
    ``block_size`` is that allocator block size; kernel blocks are mapped
    later, in the attention metadata builder, so slot math over this table
    is never in kernel units. (Older vLLM stored kernel blocks here and
    flagged it with ``use_hybrid_blocks`` / ``blocks_per_kv_block``, with the
    allocator size in ``kv_cache_block_size``; the group view still refuses
    those if present.)
    """

    @property
    def block_table(self) -> CpuTensorHolder: ...
    @property
    def block_size(self) -> int: ...
    @property
    def dcp_world_size(self) -> int: ...
    @property
    def pcp_world_size(self) -> int: ...


@runtime_checkable
class MultiGroupBlockTableLike(Protocol):
    """``vllm.v1.worker.block_table.MultiGroupBlockTable``: one table per KV cache group."""

    @property
    def block_tables(self) -> Sequence[BlockTableLike]: ...

    def __getitem__(self, idx: int) -> BlockTableLike: ...


@runtime_checkable
class InputBatchLike(Protocol):
    """``vllm.v1.worker.gpu_input_batch.InputBatch``: the persistent batch, in row order."""

    @property
    def req_id_to_index(self) -> Mapping[ReqId, int]: ...
    @property
    def num_computed_tokens_cpu(self) -> np.ndarray | torch.Tensor: ...  # int32, one entry per row
    @property
    def block_table(self) -> MultiGroupBlockTableLike: ...

    @property
    def req_ids(self) -> Sequence[ReqId | None]: ...


# Attributes older vLLM had on BlockTable that 0.33 has not; tests_vllm pins their absence
# so a vLLM that brings kernel-unit tables back fails a test rather than passing the view's checks.
LEGACY_BLOCK_TABLE_ATTRS: tuple[str, ...] = ("blocks_per_kv_block", "use_hybrid_blocks", "kv_cache_block_size")


@runtime_checkable
class GroupViewLike(Protocol):
    """The group view the manager is built with: request order and KV slot
    ids of one step, read on the engine thread only (new_step_starts and
    save_outputs). ``group_view.FullAttentionGroupView`` is the one over
    vLLM's input batch; a driver without vLLM brings its own.

    ``block_size`` must equal ``PrefixCacheConfig.block_size`` (the manager
    refuses a mismatch); a view that declares a ``group_index`` (the KV cache
    group it reads) must read ``PrefixCacheConfig.kv_cache_group_index``.
    ``step_slots_cpu`` returns one int64 CPU slot id per scheduled token,
    request after request in ``req_ids`` order.
    """

    @property
    def block_size(self) -> int: ...

    def batch_req_ids(self) -> Sequence[ReqId]: ...

    def step_slots_cpu(self, req_ids: Sequence[ReqId], num_scheduled: Mapping[ReqId, int]) -> torch.Tensor: ...


@runtime_checkable
class TokenRangeView(Protocol):
    """A group view that also says which token positions a request computes
    this step: ``token_range(req_id, n)`` is ``(start, start + n)``, ``start``
    being the request's computed tokens before the step. The adapter's
    ``build_write_layout`` needs it; seed-era views lack it, so it is a
    capability apart from ``GroupViewLike``."""

    def token_range(self, req_id: ReqId, num_scheduled: int) -> tuple[int, int]: ...
