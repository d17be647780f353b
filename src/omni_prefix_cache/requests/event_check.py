"""Boundary checks of the event API's inputs (``new_step_starts``).

A ``PrefixCacheStep`` and its events are frozen dataclasses, but nothing
stops a caller from putting any value in any field. Everything here runs
before the step's first state segment, so a refused step changes nothing;
each check raises the invalid-type error (a value of the wrong type) or the
invalid-argument error (a value out of range), naming the request, the field
and the value.

Cost: one exact-type test per field of each event (Python ints and strs
already in hand); the slow path that names the culprit runs only when one
fails.

Threading: pure (no lock, no state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
)
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheInvalidTypeError
from omni_prefix_cache.steps import validation as check

__all__ = ["as_events", "check_events", "step_counts", "step_events"]

_WHERE = "new_step_starts"
_EVENT = PrefixCacheRequestEvent
_KIND = PrefixCacheEventKind
_OWNER = PrefixCacheRequestOwner


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def as_events(given: Any) -> tuple[PrefixCacheRequestEvent, ...]:
    """``given`` (any iterable: list, tuple, generator) read once, as a
    tuple whose every item is a ``PrefixCacheRequestEvent``."""
    try:
        events = tuple(given)
    except TypeError:
        raise OmniPrefixCacheInvalidTypeError(
            f"{_WHERE}: events must be an iterable of PrefixCacheRequestEvent, got {_describe(given)}"
        ) from None
    for i, e in enumerate(events):
        if type(e) is not _EVENT and not isinstance(e, _EVENT):
            raise OmniPrefixCacheInvalidTypeError(
                f"{_WHERE}: event {i} is {_describe(e)}, not a PrefixCacheRequestEvent"
            )
    return events


def step_events(step: PrefixCacheStep) -> tuple[PrefixCacheRequestEvent, ...]:
    """A step's ``events`` field, checked as ``as_events`` (a step built
    with None or a str there is refused)."""
    events = step.events
    if type(events) is tuple and all(type(e) is _EVENT for e in events):
        return events  # the adapter's steps
    if events is None or isinstance(events, (str, bytes, Mapping)):
        raise OmniPrefixCacheInvalidTypeError(
            f"{_WHERE}: PrefixCacheStep.events must be a tuple of PrefixCacheRequestEvent, got {_describe(events)}"
        )
    return as_events(events)


def step_counts(step: PrefixCacheStep, field: str = "scheduled_tokens") -> dict[str, int]:
    """A step's ``scheduled_tokens`` (or its ``draft_tokens``) as request id
    -> count: pairs of a str id and a non-negative int count, each id once
    (a repeated id would make the step's rows disagree with its counts)."""
    pairs = getattr(step, field)
    what = f"{_WHERE}: PrefixCacheStep.{field}"
    if pairs is None or isinstance(pairs, (str, bytes, Mapping)) or not isinstance(pairs, Iterable):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what} must be a tuple of (req_id, tokens) pairs, got {_describe(pairs)}"
        )
    out: dict[str, int] = {}
    for pair in pairs:
        if type(pair) is not tuple or len(pair) != 2:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise OmniPrefixCacheInvalidTypeError(f"{what} holds {_describe(pair)}, not a (req_id, tokens) pair")
        rid, count = pair
        if type(rid) is not str:
            check.as_req_id(what, rid)
        if type(count) is not int or count < 0:
            count = check.as_count(f"{what} of request {rid!r}", count)
        if rid in out:
            raise OmniPrefixCacheInvalidArgumentError(f"{what} names request {rid!r} twice")
        out[rid] = count
    return out


def check_events(events: tuple[PrefixCacheRequestEvent, ...]) -> None:
    """Every field of every event: a str ``req_id``, a ``PrefixCacheEventKind``
    member as ``kind`` (a plain string such as ``'resumed'`` is refused: it
    would compare equal to the member and be missed by every identity test),
    non-negative int bounds with ``hit_start <= hit_end``, int counts, an
    owner that is None or a ``PrefixCacheRequestOwner`` of ints, block ids
    as a tuple or list of groups, and a bool ``lookup_complete``."""
    for e in events:
        if (
            type(e.req_id) is str
            and type(e.kind) is _KIND
            and type(e.hit_start) is int
            and type(e.hit_end) is int
            and type(e.scheduled_tokens) is int
            and type(e.num_output_tokens) is int
            and 0 <= e.hit_start <= e.hit_end
            and e.scheduled_tokens >= 0
            and e.num_output_tokens >= 0
            and (e.owner is None or (type(e.owner) is _OWNER and _owner_ok(e.owner)))
            and type(e.block_ids) is tuple
            and type(e.lookup_complete) is bool
        ):
            continue  # the usual event: every field of its type
        _refuse(e)


def _owner_ok(owner: PrefixCacheRequestOwner) -> bool:
    return type(owner.admission_id) is int and type(owner.generation) is int


def _refuse(e: PrefixCacheRequestEvent) -> None:
    """The slow path: raise naming the first bad field of ``e`` (or return
    for an event that is only of an accepted subtype, e.g. a list of block groups)."""
    rid = check.as_req_id(f"{_WHERE}: event req_id", e.req_id)
    where = f"{_WHERE}: event of request {rid!r}"
    if not isinstance(e.kind, _KIND):
        raise OmniPrefixCacheInvalidTypeError(
            f"{where}: kind must be a PrefixCacheEventKind member, got {_describe(e.kind)}"
        )
    start = check.as_count(f"{where}: hit_start", e.hit_start)
    end = check.as_count(f"{where}: hit_end", e.hit_end)
    if start > end:
        raise OmniPrefixCacheInvalidArgumentError(f"{where}: hit_start {start} > hit_end {end}")
    check.as_count(f"{where}: scheduled_tokens", e.scheduled_tokens)
    check.as_count(f"{where}: num_output_tokens", e.num_output_tokens)
    owner = e.owner
    if owner is not None:
        if not isinstance(owner, _OWNER):
            raise OmniPrefixCacheInvalidTypeError(
                f"{where}: owner must be a PrefixCacheRequestOwner or None, got {_describe(owner)}"
            )
        check.as_int(f"{where}: owner admission_id", owner.admission_id)
        check.as_int(f"{where}: owner generation", owner.generation)
    if not isinstance(e.block_ids, (tuple, list)):
        raise OmniPrefixCacheInvalidTypeError(
            f"{where}: block_ids must be a tuple of block-id groups, got {_describe(e.block_ids)}"
        )
    if not isinstance(e.lookup_complete, bool):
        raise OmniPrefixCacheInvalidTypeError(
            f"{where}: lookup_complete must be a bool, got {_describe(e.lookup_complete)}"
        )
