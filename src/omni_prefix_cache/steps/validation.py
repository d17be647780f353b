"""Argument checks of the manager facade.

The facade checks its arguments before it changes anything, so a rejected
call leaves the manager exactly as it was (the caller may fix and retry).
Every function here is pure (no lock, no state) and raises the
invalid-type or invalid-argument error naming what was wrong.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    ReqId,
    StepId,
)

_MAX_LISTED = 16
# Exact types the fast paths accept (bool is not int here; subclasses take the slow path).
_STR: frozenset[type] = frozenset({str})
_INT: frozenset[type] = frozenset({int})


def listed(values: Sequence[Any] | torch.Tensor | np.ndarray) -> str:
    """At most 16 values for an error message, then how many more."""
    items = values.tolist() if isinstance(values, torch.Tensor | np.ndarray) else list(values)
    more = len(items) - _MAX_LISTED
    return f"{items[:_MAX_LISTED]}" + (f" (+{more} more)" if more > 0 else "")


def as_int(what: str, value: Any) -> int:
    """``value`` as an int; bools and floats are refused, not truncated."""
    if isinstance(value, bool):
        raise OmniPrefixCacheInvalidTypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise OmniPrefixCacheInvalidTypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def as_count(what: str, value: Any) -> int:
    """``value`` as a non-negative int (see ``as_int``)."""
    out = as_int(what, value)
    if out < 0:
        raise OmniPrefixCacheInvalidArgumentError(f"{what} must be >= 0, got {out}")
    return out


def as_step_id(what: str, value: Any) -> StepId:
    """A step id as save_outputs returned it (an int; never a bool or float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what}: step id must be the int save_outputs returned, got {type(value).__name__} {value!r}"
        )
    return value


def as_req_id(what: str, value: Any) -> ReqId:
    if not isinstance(value, str):
        raise OmniPrefixCacheInvalidTypeError(f"{what}: request id must be a str, got {type(value).__name__} {value!r}")
    return value


def as_req_ids(what: str, value: Any) -> list[ReqId]:
    """A collection of request ids (None: none). A bare str is refused: it
    would be read one character per request."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what} must be a collection of request ids, got {type(value).__name__} {value!r}"
        )
    ids = list(value)
    if set(map(type, ids)) <= _STR:  # the usual case, checked without a call per id
        return ids
    return [as_req_id(what, r) for r in ids]


def new_requests(raw: Any) -> list[tuple[ReqId, int, Any, Any]]:
    """``(req_id, num_computed_tokens, block_ids, record)`` of each
    scheduled new request, type-checked (the hit itself is checked by the
    hit planner)."""
    if raw is None:
        return []
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
        raise OmniPrefixCacheInvalidTypeError(
            f"scheduled_new_reqs must be a list of new-request records, got {type(raw).__name__}"
        )
    out: list[tuple[ReqId, int, Any, Any]] = []
    for req in raw:
        if not hasattr(req, "req_id"):
            raise OmniPrefixCacheInvalidTypeError(
                f"scheduled_new_reqs holds a {type(req).__name__} without a req_id: {req!r}"
            )
        rid = as_req_id("scheduled_new_reqs", req.req_id)
        computed = getattr(req, "num_computed_tokens", 0)
        computed = as_count(f"num_computed_tokens of request {rid!r}", 0 if computed is None else computed)
        out.append((rid, computed, getattr(req, "block_ids", None), req))
    return out


def as_num_scheduled(raw: Any) -> dict[ReqId, int]:
    """``num_scheduled_tokens`` of a scheduler output as request id -> count."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise OmniPrefixCacheInvalidTypeError(
            f"num_scheduled_tokens must be a mapping of request id to count, got {type(raw).__name__}"
        )
    if set(map(type, raw)) <= _STR and set(map(type, raw.values())) <= _INT and min(raw.values(), default=0) >= 0:
        return dict(raw)  # the usual case (str ids, int counts), checked without a call per entry
    return {as_req_id("num_scheduled_tokens", r): as_count(f"num_scheduled_tokens[{r!r}]", k) for r, k in raw.items()}


def check_device(what: str, value: torch.Tensor) -> None:
    """Rows must live where the cache can copy them from: the CPU, or CUDA
    when CUDA is available."""
    if value.is_cpu or (value.is_cuda and torch.cuda.is_available()):  # flags: no device object built
        return
    raise OmniPrefixCacheInvalidArgumentError(
        f"{what} is on device {value.device}; the cache copies from the CPU"
        + (" or CUDA" if torch.cuda.is_available() else " (CUDA is not available)")
    )


def check_devices(what: str, value: Any) -> None:
    """``check_device`` for every tensor in a (nested) mm entry."""
    if isinstance(value, torch.Tensor):
        check_device(what, value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_devices(f"{what}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_devices(f"{what}[{i}]", v)


def check_step_tensors(sid: StepId, hidden: Any, mm: Any) -> None:
    """Type and device checks of a save's outputs (shapes are checked
    where they are routed, in ``step_layout``)."""
    if hidden is not None:
        if not isinstance(hidden, torch.Tensor):
            raise OmniPrefixCacheInvalidTypeError(
                f"save_outputs (step {sid}): hidden states must be a tensor or None, got {type(hidden).__name__}"
            )
        check_device(f"save_outputs (step {sid}): hidden states", hidden)
    if mm is None:
        return
    if not isinstance(mm, Mapping):
        raise OmniPrefixCacheInvalidTypeError(
            f"save_outputs (step {sid}): multimodal outputs must be a mapping, got {type(mm).__name__}"
        )
    for key, value in mm.items():
        if not isinstance(key, str):
            raise OmniPrefixCacheInvalidTypeError(
                f"save_outputs (step {sid}): multimodal output names must be str, got {type(key).__name__} {key!r}"
            )
        check_devices(f"save_outputs (step {sid}): mm output {key!r}", value)


def as_accepted_rows(what: str, value: Any) -> dict[ReqId, int] | None:
    """The accepted-rows input of materialize or discard_step (None: none
    given): a mapping of request id to ``len(sampled_token_ids[i])``, a
    non-negative int each (numpy ints too; a bool or float is refused). A
    copy: the caller's mapping is never kept."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what}: accepted_rows must be a mapping of request id to len(sampled_token_ids[i]), "
            f"got {type(value).__name__} {value!r}"[:240]
        )
    if set(map(type, value)) <= _STR and set(map(type, value.values())) <= _INT and min(value.values(), default=0) >= 0:
        return dict(value)  # the usual case (str ids, int counts), checked without a call per entry
    return {as_req_id(what, r): as_count(f"{what}: accepted_rows[{r!r}]", k) for r, k in value.items()}


def drafts_need_layout(sid: StepId, drafts: Mapping[ReqId, int], write_layout: Any) -> None:
    """A save of a step with speculative drafts needs a write layout: its
    positions come from the layout, never from a tenure's watermark (which
    counts a draft only once a materialize accepted it)."""
    if drafts and write_layout is None:
        raise OmniPrefixCacheInvalidArgumentError(
            f"save_outputs (step {sid}): the step has speculative drafts (requests {sorted(drafts)[:8]}); "
            "it needs a write_layout (PrefixCacheSchedulerAdapter.build_write_layout)"
        )
