"""A save's write layout (``PrefixCacheWriteLayout``, built by the
adapter): its request spans and slots, checked, and its token ranges.

Engine thread, no lock (save_outputs routes the step before registering it).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_prefix_cache.device.index_tensors import out_of_range
from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    ReqId,
    StepId,
)
from omni_prefix_cache.steps.validation import listed


def layout_spans(
    sid: StepId, layout: Any, n: int, num_slots: int
) -> tuple[list[ReqId], dict[ReqId, tuple[int, int]], torch.Tensor]:
    """``request_spans`` from a ``PrefixCacheWriteLayout``: its writes must
    pack the step's ``n`` rows in order, each with as many token positions
    as rows, and its CPU slots must cover them. Raises the invalid-argument
    (or invalid-type) error naming the step and the write."""
    writes = getattr(layout, "writes", None)
    slots = getattr(layout, "slots_cpu", None)
    if writes is None:
        raise OmniPrefixCacheInvalidTypeError(
            f"save_outputs (step {sid}): write_layout must be a PrefixCacheWriteLayout, got {type(layout).__name__}"
        )
    order: list[ReqId] = []
    spans: dict[ReqId, tuple[int, int]] = {}
    cursor = 0
    for w in writes:
        rows = w.row_end - w.row_start
        if w.row_start != cursor or rows < 0 or w.token_end - w.token_start != rows or w.token_start < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): write of request {w.req_id!r} (rows [{w.row_start}, {w.row_end}), "
                f"tokens [{w.token_start}, {w.token_end})) does not continue the layout at row {cursor}"
            )
        cursor = w.row_end
        if rows == 0:
            continue
        if w.req_id in spans:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): request {w.req_id!r} twice in the layout"
            )
        order.append(w.req_id)
        spans[w.req_id] = (w.row_start, rows)
    if cursor != n or int(getattr(layout, "total_rows", cursor)) != n:
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the write layout covers {cursor} rows but the step has {n} tokens"
        )
    if n == 0:
        return order, spans, torch.empty((0,), dtype=torch.int64)
    if not isinstance(slots, torch.Tensor) or slots.ndim != 1 or int(slots.numel()) != n:
        got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the write layout's slots_cpu {got} does not cover the step's {n} tokens"
        )
    slots = slots.to("cpu", torch.int64)
    if out_of_range(slots.numpy(), num_slots):
        bad = slots[(slots < 0) | (slots >= num_slots)]
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): slots {listed(bad)} outside [0, {num_slots})"
        )
    return order, spans, slots


def layout_token_ranges(layout: Any) -> dict[ReqId, tuple[int, int]]:
    """Each written request's token positions ``[token_start, token_end)``."""
    return {w.req_id: (w.token_start, w.token_end) for w in layout.writes if w.row_end > w.row_start}
