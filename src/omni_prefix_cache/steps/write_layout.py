"""A save's write layout (``PrefixCacheWriteLayout``, built by the
adapter): its request spans and slots, checked, and its token ranges.

Engine thread, no lock (save_outputs routes the step before registering it).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from omni_prefix_cache.adapter import PrefixCacheWrite, PrefixCacheWriteLayout
from omni_prefix_cache.device.index_tensors import out_of_range
from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    ReqId,
    StepId,
)
from omni_prefix_cache.steps.validation import as_count, as_int, as_req_id, listed


def layout_spans(
    sid: StepId, layout: Any, n: int, num_slots: int, num_sched: Mapping[ReqId, int]
) -> tuple[list[ReqId], dict[ReqId, tuple[int, int]], torch.Tensor]:
    """``request_spans`` from a ``PrefixCacheWriteLayout``: its writes must
    pack the step's ``n`` rows in order, each with as many token positions
    as rows, name each request at most once, and carry int bounds (a float
    or bool is refused, never truncated); its CPU slots must be an integer
    tensor covering them. When the step carries scheduled counts
    (``num_sched`` not empty) every written request's rows must equal its
    count and every scheduled request must be written: a layout whose rows
    differ would land one request's rows in another's write. Without counts
    the layout is the source of the rows. Raises the invalid-argument (or
    invalid-type) error naming the step, the request and the field."""
    if not isinstance(layout, PrefixCacheWriteLayout):
        raise OmniPrefixCacheInvalidTypeError(
            f"save_outputs (step {sid}): write_layout must be a PrefixCacheWriteLayout, got {type(layout).__name__}"
        )
    writes, slots = layout.writes, layout.slots_cpu
    if not isinstance(writes, (tuple, list)):
        raise OmniPrefixCacheInvalidTypeError(
            f"save_outputs (step {sid}): write_layout.writes must be a tuple of PrefixCacheWrite, "
            f"got {type(writes).__name__}"
        )
    order: list[ReqId] = []
    spans: dict[ReqId, tuple[int, int]] = {}
    named: set[ReqId] = set()
    cursor = 0
    for w in writes:
        if type(w) is PrefixCacheWrite and _plain(w):
            rid, row_start, row_end, token_start, token_end = (
                w.req_id,
                w.row_start,
                w.row_end,
                w.token_start,
                w.token_end,
            )
        else:
            rid, row_start, row_end, token_start, token_end = _write_fields(sid, w)
        rows = row_end - row_start
        if row_start != cursor or rows < 0 or token_end - token_start != rows or token_start < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): write of request {rid!r} (rows [{row_start}, {row_end}), "
                f"tokens [{token_start}, {token_end})) does not continue the layout at row {cursor}"
            )
        if rid in named:
            raise OmniPrefixCacheInvalidArgumentError(f"save_outputs (step {sid}): request {rid!r} twice in the layout")
        named.add(rid)
        cursor = row_end
        if num_sched and num_sched.get(rid, 0) != rows:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): the layout writes {rows} rows of request {rid!r} but the step "
                f"scheduled {num_sched.get(rid, 0)} tokens for it"
            )
        if rows == 0:
            continue
        order.append(rid)
        spans[rid] = (row_start, rows)
    if num_sched and len(spans) != len(num_sched) - operator.countOf(num_sched.values(), 0):
        missing = sorted(r for r, k in num_sched.items() if k > 0 and r not in spans)
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the step scheduled requests {listed(missing)} the write layout does not write"
        )
    total = layout.total_rows
    if type(total) is not int:
        total = as_count(f"save_outputs (step {sid}): write_layout.total_rows", total)
    if cursor != n or total != n:
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the write layout covers {cursor} rows (total_rows {total}) but the step "
            f"has {n} tokens"
        )
    if n == 0:
        return order, spans, torch.empty((0,), dtype=torch.int64)
    if not isinstance(slots, torch.Tensor) or slots.ndim != 1 or int(slots.numel()) != n:
        got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the write layout's slots_cpu {got} does not cover the step's {n} tokens"
        )
    check_slot_dtype(f"save_outputs (step {sid}): the write layout's slots_cpu", slots)
    slots = slots.to("cpu", torch.int64)
    if out_of_range(slots.numpy(), num_slots):
        bad = slots[(slots < 0) | (slots >= num_slots)]
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): slots {listed(bad)} outside [0, {num_slots})"
        )
    return order, spans, slots


def check_slot_dtype(what: str, slots: torch.Tensor) -> None:
    """Slot ids are integers: a float (or bool, or complex) slot tensor is
    refused rather than truncated by the cast to int64 (a dtype test, no
    pass over the values)."""
    dtype = slots.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise OmniPrefixCacheInvalidTypeError(f"{what} must hold integer slot ids, got dtype {dtype}")


def _plain(w: PrefixCacheWrite) -> bool:
    """The usual write: a str id and exact int bounds."""
    return (
        type(w.req_id) is str
        and type(w.row_start) is int
        and type(w.row_end) is int
        and type(w.token_start) is int
        and type(w.token_end) is int
    )


def _write_fields(sid: StepId, w: Any) -> tuple[ReqId, int, int, int, int]:
    """``w``'s id and bounds, checked: raise naming the first field that is
    not a write's (a float or bool bound is refused; an integer type such as
    a numpy int is read as the int it is)."""
    if not isinstance(w, PrefixCacheWrite):
        raise OmniPrefixCacheInvalidTypeError(
            f"save_outputs (step {sid}): write_layout holds {type(w).__name__} {w!r}, not a PrefixCacheWrite"
        )
    rid = as_req_id(f"save_outputs (step {sid}): write req_id", w.req_id)
    where = f"save_outputs (step {sid}): write of request {rid!r}:"
    return (
        rid,
        as_int(f"{where} row_start", w.row_start),
        as_int(f"{where} row_end", w.row_end),
        as_int(f"{where} token_start", w.token_start),
        as_int(f"{where} token_end", w.token_end),
    )


def layout_token_ranges(layout: Any) -> dict[ReqId, tuple[int, int]]:
    """Each written request's token positions ``[token_start, token_end)``
    (the layout was checked by ``layout_spans``: its bounds are ints)."""
    return {
        w.req_id: (operator.index(w.token_start), operator.index(w.token_end))
        for w in layout.writes
        if w.row_end > w.row_start
    }
