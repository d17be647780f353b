"""vLLM integration points, duck-typed: vLLM is never imported here.

- :class:`FullAttentionGroupView` reads vLLM's input batch (the block
  table of the KV cache group the rows are keyed by) and turns a step's
  scheduled tokens into KV slot ids on the CPU, without touching the device.
- :func:`stage_prefix_cache_config` is the runner-side gate: it decides
  whether a stage (and a parallel rank) gets a prefix cache at all, picks
  the keyed group (``kv_layout_gate``) and refuses, loudly, the
  configurations where slot ids would silently point at the wrong rows
  (or a step's rows would not be one per scheduled position).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any, cast

import numpy as np
import torch

from omni_prefix_cache.engine_types import InputBatchLike
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig, ReqId
from omni_prefix_cache.kv_connector_gate import check_kv_connector
from omni_prefix_cache.kv_layout_gate import (
    check_prefix_cache_context_parallel,
    check_prefix_cache_hit_alignment,
    is_prefix_cache_mirror_rank,
    select_prefix_cache_kv_group,
)

logger = logging.getLogger(__name__)


def _empty_slots() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


_INT: frozenset[type] = frozenset({int})


class FullAttentionGroupView:
    """Slot ids of the full-attention KV cache group the rows are keyed by
    (``group_index``; ``PrefixCacheConfig.kv_cache_group_index``), computed
    on the CPU.

    ``slot = block_table[row, pos // block_size] * block_size + pos % block_size``
    for each scheduled position ``pos``, starting at the request's
    ``num_computed_tokens``. Positions past the table's last column are
    dropped (the caller checks that the slots cover the step).
    """

    def __init__(self, input_batch: InputBatchLike, block_size: int, group_index: int | None = None) -> None:
        """Bind to block table ``group_index`` of ``input_batch`` (vLLM's
        ``MultiGroupBlockTable`` holds one per KV cache group; None: the only
        one); raise on layouts whose slots this math gets wrong.

        Refused: no ``group_index`` for an input batch with several block
        tables (a hybrid model: which one keys the rows is the gate's choice),
        a ``group_index`` the input batch has no block table for, a table that
        maps no token slots (a Mamba-style state group), hybrid
        kernel blocks (one allocator block split into several kernel blocks
        per table column), decode/prefill context parallel (tokens striped
        across ranks), and a block table whose allocator block size differs
        from ``block_size``.
        """
        self.block_size = int(block_size)
        if self.block_size <= 0:
            raise OmniPrefixCacheUnmatchError(f"group view: block_size must be positive, got {block_size}")
        self._input_batch = input_batch
        tables = getattr(input_batch.block_table, "block_tables", None)
        count = 1 if tables is None else len(tables)
        if group_index is None and count != 1:
            raise OmniPrefixCacheUnmatchError(
                f"group view: the input batch has {count} block tables (one per KV cache group); pass "
                "group_index=PrefixCacheConfig.kv_cache_group_index, the full-attention group "
                "stage_prefix_cache_config picked, or build the view with get_prefix_cache_group_view"
            )
        self.group_index = 0 if group_index is None else int(group_index)
        if not 0 <= self.group_index < count:
            raise OmniPrefixCacheUnmatchError(
                f"group view: the rows are keyed by KV cache group {self.group_index}, "
                f"but the input batch has {count} block table(s)"
            )
        group = input_batch.block_table[self.group_index]
        mode = getattr(getattr(group, "slot_mapping_mode", None), "value", None)
        if mode == "none":
            raise OmniPrefixCacheUnmatchError(
                f"group view: block table {self.group_index} maps no token slots (slot_mapping_mode none: "
                "a Mamba-style state group); key the rows by a full-attention group"
            )
        check_prefix_cache_block_layout(group, self.block_size)
        self._group = group
        # Power-of-two block sizes (vLLM's usual) map positions with shifts and masks.
        bs = self.block_size
        self._shift: int | None = bs.bit_length() - 1 if bs & (bs - 1) == 0 else None

    def batch_req_ids(self) -> list[ReqId]:
        """Request ids of the input batch in row order (empty rows skipped)."""
        return [r for r in self._input_batch.req_ids if r is not None]

    def token_range(self, req_id: ReqId, num_scheduled: int) -> tuple[int, int]:
        """The positions ``[start, start + num_scheduled)`` that ``req_id``
        computes this step, ``start`` being its ``num_computed_tokens`` in the
        input batch. Engine thread, after the batch was updated for the step;
        raises naming a request not in the input batch."""
        row = self._input_batch.req_id_to_index.get(req_id)
        if row is None:
            raise OmniPrefixCacheUnmatchError(f"group view: request {req_id!r} is not in the input batch")
        start = int(self._input_batch.num_computed_tokens_cpu[row])
        return start, start + int(num_scheduled)

    def step_slots_cpu(self, req_ids: Sequence[ReqId], num_scheduled: Mapping[ReqId, int]) -> torch.Tensor:
        """Slot ids of this step's scheduled tokens, request after request.

        For each request in ``req_ids`` with ``num_scheduled[req] > 0``: the
        positions ``num_computed_tokens .. + num_scheduled`` mapped through
        its block-table row. Returns a 1-D int64 CPU tensor (one gather for
        the whole batch). Raises naming any request not in the input batch.
        """
        index_of = self._input_batch.req_id_to_index
        req_ids = list(req_ids)
        counts = list(map(num_scheduled.get, req_ids, repeat(0)))
        if not set(map(type, counts)) <= _INT:  # e.g. numpy counts: as ints, once
            counts = [int(n) for n in counts]
        if min(counts, default=1) <= 0:
            req_ids = [r for r, n in zip(req_ids, counts) if n > 0]
            counts = [n for n in counts if n > 0]
        if not counts:
            return _empty_slots()
        found: list[int | None] = list(map(index_of.get, req_ids))
        if None in found:
            missing = req_ids[found.index(None)]
            raise OmniPrefixCacheUnmatchError(f"group view: request {missing!r} is not in the input batch")
        rows = cast("list[int]", found)
        # Index math in numpy: vLLM keeps these tables as numpy arrays, and a
        # numpy op on a few hundred ints costs a fraction of a torch op.
        row_np = np.array(rows, dtype=np.int64)
        # vLLM's int32 counts: position math stays int32 (``_gather`` widens the slots).
        starts = self._computed_tokens()[row_np]
        if len(rows) == 1:
            start = int(starts[0])
            return self._gather(rows[0], np.arange(start, start + counts[0], dtype=np.int64))
        if counts.count(1) == len(counts):  # decode: one token per request, at its computed count
            return self._gather(row_np, starts)
        # Per token: its request's row and its position (request start + index in the request).
        counts_np = np.array(counts, dtype=np.int64)
        first_token = np.cumsum(counts_np) - counts_np
        positions = np.arange(int(counts_np.sum()), dtype=np.int64) + np.repeat(starts - first_token, counts_np)
        return self._gather(np.repeat(row_np, counts_np), positions)

    def slots_for(self, req_id: ReqId, token_start: int, token_end: int) -> torch.Tensor:
        """Slot ids of ``req_id``'s positions ``[token_start, token_end)`` (1-D int64)."""
        if token_end <= token_start:
            return _empty_slots()
        row = self._input_batch.req_id_to_index.get(req_id)
        if row is None:
            raise OmniPrefixCacheUnmatchError(f"group view: request {req_id!r} is not in the input batch")
        return self._gather(int(row), np.arange(int(token_start), int(token_end), dtype=np.int64))

    def _computed_tokens(self) -> np.ndarray:
        # vLLM keeps a numpy array here (a tensor is viewed, not copied).
        counts = self._input_batch.num_computed_tokens_cpu
        return counts.numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts)

    def _table(self) -> np.ndarray:
        # vLLM's table is a CPU tensor; its numpy view shares the memory.
        table = self._group.block_table.cpu
        return table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)

    def _gather(self, rows: np.ndarray | int, positions: np.ndarray) -> torch.Tensor:
        """``table[row, pos // bs] * bs + pos % bs`` per token (``rows``: one
        row, or one per token), as a 1-D int64 tensor. Positions past the
        table's last column are dropped."""
        table = self._table()
        shift = self._shift
        columns = positions >> shift if shift is not None else positions // self.block_size
        try:
            # Positions are never negative, so the index's own bounds check
            # is the "past the last column" test (no separate max).
            blocks = table[rows, columns]
        except IndexError:
            inside = columns < int(table.shape[1])
            positions, columns = positions[inside], columns[inside]
            if not isinstance(rows, int):
                rows = rows[inside]
            if positions.size == 0:
                return _empty_slots()
            blocks = table[rows, columns]
        offsets = positions & (self.block_size - 1) if shift is not None else positions % self.block_size
        # block id * block size in int64 (the table may be int32), plus the offset.
        slots = np.multiply(blocks, self.block_size, dtype=np.int64)
        slots += offsets
        return torch.from_numpy(slots)


def check_prefix_cache_block_layout(block_table: Any, block_size: int) -> None:
    """Raise unless ``block_table`` (the keyed group's table in vLLM's input
    batch) has the layout ``FullAttentionGroupView``'s slot math assumes:
    one allocator block per column (no hybrid kernel blocks), no token
    striping across ranks (decode or prefill context parallel), and an
    allocator block size equal to ``block_size``."""
    # vLLM 0.33's table holds allocator block ids (kernel blocks are mapped later, in the
    # attention metadata builder) and has none of the three legacy attributes read below:
    # there, block_size is the allocator block size. Older vLLM stored kernel blocks in the
    # table (use_hybrid_blocks / blocks_per_kv_block) with kv_cache_block_size the allocator's.
    blocks_per_kv_block = int(getattr(block_table, "blocks_per_kv_block", 1) or 1)
    if bool(getattr(block_table, "use_hybrid_blocks", False)) or blocks_per_kv_block != 1:
        raise OmniPrefixCacheUnmatchError(
            "group view: hybrid kernel blocks are not supported (kernel_block_size differs from the KV "
            f"block size, blocks_per_kv_block={blocks_per_kv_block}); slot ids would address the wrong rows"
        )
    dcp = int(getattr(block_table, "dcp_world_size", 1) or 1)
    if dcp > 1:
        raise OmniPrefixCacheUnmatchError(
            f"group view: decode context parallel (dcp_world_size={dcp}) stripes tokens across ranks; "
            "not supported by the omni prefix cache"
        )
    pcp = int(getattr(block_table, "pcp_world_size", 1) or 1)
    if pcp > 1:
        raise OmniPrefixCacheUnmatchError(
            f"group view: prefill context parallel (pcp_world_size={pcp}) stripes tokens across ranks; "
            "not supported by the omni prefix cache"
        )
    table_block_size = getattr(block_table, "kv_cache_block_size", None)
    if table_block_size is None:
        table_block_size = getattr(block_table, "block_size", None)
    if table_block_size is not None and int(table_block_size) != int(block_size):
        raise OmniPrefixCacheUnmatchError(
            f"group view: block table block size {int(table_block_size)} does not match "
            f"the prefix cache block size {int(block_size)}"
        )


def check_prefix_cache_kv_groups(groups: Sequence[Any] | None) -> Any:
    """Return the KV cache group the rows are keyed by; raise unless the
    groups are a single full-attention group or full-attention groups beside
    sliding-window, chunked-local or Mamba groups (one group without a
    ``kv_cache_spec`` counts as full attention; None counts as no group).
    The choice and its refusals: ``kv_layout_gate.select_prefix_cache_kv_group``."""
    return select_prefix_cache_kv_group(groups).group


def check_prefix_cache_kv_transfer(kv_transfer_config: Any) -> None:
    """Refuse any KV connector that can load KV into this stage, whatever its
    role (``kv_connector_gate``): a hit it loads lands in new blocks the
    mirror never wrote. Connectors known to only store pass; None (no
    connector) passes."""
    check_kv_connector(kv_transfer_config)


# Speculative methods whose drafts the target model verifies in its own forward, one row per scheduled
# position in order: the target's rows at the accepted positions are what the forward returned, and the
# runner's ModelRunnerOutput.sampled_token_ids says how many were accepted (the drafter's own passes and KV
# never reach save_outputs). vLLM 0.33 normalises its MTP model types (deepseek_mtp, ...) to "mtp".
SPECULATIVE_METHODS = frozenset(
    {"ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "custom_class"}
)
# Methods (and settings) where the rows the target's forward returns are not one per scheduled position, or
# not what the step began with: refused, with the reason.
REFUSED_SPECULATIVE_METHODS = {
    "ngram_gpu": (
        "the GPU n-gram proposer trims each step's drafts inside the model runner's _update_states "
        "(update_scheduler_for_invalid_drafts), after the cache began the step, so the forward returns fewer "
        "rows than the step's scheduled counts say"
    ),
    "extract_hidden_states": (
        "it is no speculation: it stores the target's hidden states in a second, cache-only KV cache group "
        "and echoes the sampled token as its draft; the stage no longer has one full-attention group"
    ),
}


def check_prefix_cache_token_accounting(cache_config: Any, speculative_config: Any) -> None:
    """Raise where ``num_computed_tokens`` stops being the block-aligned
    first scheduled position, or a step's rows stop being one per scheduled
    position: prefix matching finer than a KV block (``prefix_match_unit``
    not a multiple of ``block_size``), and the speculative modes in
    ``REFUSED_SPECULATIVE_METHODS``, adaptive verification (the verifier's
    query lengths are trimmed on the device) and any method not in
    ``SPECULATIVE_METHODS`` (not known to keep the target's rows).

    Speculative decoding with a method of ``SPECULATIVE_METHODS`` passes:
    the cached rows are the target model's. The runner then passes, per
    step, the accepted rows to ``materialize`` (``accepted_rows``:
    ``len(ModelRunnerOutput.sampled_token_ids[i])`` per request, taken right
    after the rejection sampler; ``adapter.accepted_rows_of``), or to the
    engine helper's output builder; a drafted step without them raises."""
    if speculative_config is not None:
        _check_speculative(speculative_config)
    block_size = int(cache_config.block_size)
    unit = getattr(cache_config, "prefix_match_unit", None)
    if unit is not None and (int(unit) <= 0 or int(unit) % block_size != 0):
        raise OmniPrefixCacheUnmatchError(
            f"omni prefix cache needs block-aligned prefix matching: prefix_match_unit={unit} is not a "
            f"multiple of block_size={block_size}"
        )


def _check_speculative(speculative_config: Any) -> None:
    """Refuse a speculative mode whose target rows the cache cannot tell
    apart (see ``check_prefix_cache_token_accounting``)."""
    method = getattr(speculative_config, "method", None)
    name = str(method)
    if name.endswith("_mtp"):
        name = "mtp"  # an MTP model type vLLM's config did not normalise yet
    why = REFUSED_SPECULATIVE_METHODS.get(name)
    if why is None and bool(getattr(speculative_config, "enable_adaptive_verification", False)):
        why = (
            "adaptive verification trims the verifier's query lengths on the device, so the target's forward "
            "returns fewer rows than the step scheduled"
        )
    if why is None and name not in SPECULATIVE_METHODS:
        why = (
            "this method is not known to verify its drafts in the target's forward one row per scheduled "
            f"position (known: {sorted(SPECULATIVE_METHODS)})"
        )
    if why is not None:
        raise OmniPrefixCacheUnmatchError(
            f"omni prefix cache does not support speculative decoding with method={method!r}: {why}; "
            "use another method, or disable one of them for this stage"
        )
    logger.info(
        "omni prefix cache with speculative decoding (method=%r): the runner passes each step's accepted rows "
        "(len(ModelRunnerOutput.sampled_token_ids[i]) per request) to materialize or the output builder",
        method,
    )


def stage_prefix_cache_config(
    *,
    kv_cache_config: Any,
    cache_config: Any,
    kv_transfer_config: Any,
    scheduler_config: Any,
    model_config: Any,
    is_pooling_model: bool,
    speculative_config: Any = None,
    parallel_config: Any = None,
    rank: int | None = None,
) -> PrefixCacheConfig | None:
    """The stage's prefix cache config, or None when it gets no cache.

    None when prefix caching is off, the stage is a pooling model, or
    (``parallel_config``, vLLM's ``ParallelConfig``) this worker's ``rank``
    (default ``parallel_config.rank``) is not the one whose output the
    engine returns (``kv_layout_gate.is_prefix_cache_mirror_rank``: the
    first tensor rank of the last pipeline stage). Raises, on every rank, for
    a KV connector that can load KV, whatever its role
    (``check_prefix_cache_kv_transfer``), a speculative mode whose target
    rows are not one per scheduled position and prefix matching finer than
    a KV block (``check_prefix_cache_token_accounting``), decode or prefill
    context parallel (``kv_layout_gate.check_prefix_cache_context_parallel``),
    KV cache groups without a full-attention group or with a kind not
    verified beside one (``check_prefix_cache_kv_groups``), and prefix hits
    that may end inside a block of the keyed group. Checked in that order,
    so the refusals fire before the group check. The config carries the
    keyed group's index and block size (its spec's, else
    ``cache_config.block_size``). With speculative decoding (ngram, suffix,
    draft model, EAGLE, EAGLE-3, MTP, DFlash, DSpark, a custom proposer) the
    runner must pass each step's accepted rows to ``materialize``
    (docs/integration.md).
    """
    if not bool(getattr(cache_config, "enable_prefix_caching", False)) or is_pooling_model:
        return None
    check_prefix_cache_kv_transfer(kv_transfer_config)
    check_prefix_cache_token_accounting(cache_config, speculative_config)
    check_prefix_cache_context_parallel(parallel_config)
    keyed = select_prefix_cache_kv_group(getattr(kv_cache_config, "kv_cache_groups", ()))
    block_size = int(cache_config.block_size) if keyed.block_size is None else keyed.block_size
    check_prefix_cache_hit_alignment(kv_cache_config, block_size)
    if not is_prefix_cache_mirror_rank(parallel_config, rank):
        return None
    return PrefixCacheConfig.from_vllm_config(
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=block_size,
        scheduler_config=scheduler_config,
        model_config=model_config,
        kv_cache_group_index=keyed.index,
    )


def get_prefix_cache_group_view(
    input_batch: InputBatchLike, block_size: int, kv_cache_groups: Sequence[Any] | None = None
) -> FullAttentionGroupView | None:
    """The group view of ``input_batch``, or None when the batch has no
    block table (nothing to map slots from).

    ``kv_cache_groups`` (``kv_cache_config.kv_cache_groups``) are checked
    first, as at KV cache init (``check_prefix_cache_kv_groups``), and pick
    the block table the view reads (the keyed group's, the index
    ``stage_prefix_cache_config`` puts in the config); None or no group
    raises. Then the view refuses block-table layouts its slot math gets
    wrong.
    """
    keyed = select_prefix_cache_kv_group(kv_cache_groups)
    table = getattr(input_batch, "block_table", None)
    # vLLM's MultiGroupBlockTable lists its tables in ``block_tables``; a plain list is its own.
    tables = getattr(table, "block_tables", table)
    if table is None or (isinstance(tables, Sequence) and len(tables) == 0):
        return None
    return FullAttentionGroupView(input_batch, block_size, keyed.index)
