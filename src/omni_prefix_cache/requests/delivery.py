"""Per-consumer delivery: views, acknowledgements and the output commit.

``DeliveryDesk`` runs the compiled operations ``delivery_view``,
``ack_delivery`` and ``commit_output`` of spec/protocol.yaml over the
delivery machine (spec/delivery.yaml) of each tenure an output was saved
under (``StageCacheOutputs._progress``). Cache reads and writes are never
delivery: only an acknowledgement moves a watermark, and only forward.

Threading: any consumer thread; every entry takes the manager's state lock
(``commit_output`` holds it across the caller's handoff, which must only
publish prepared payloads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestProgress,
    ReqId,
    StageCacheOutputs,
    output_consumer,
    output_progress,
)
from omni_prefix_cache.requests.lifecycle import RequestBinding, RequestTable
from omni_prefix_cache.requests.tenure import DeliveryState, RequestState, Tenure, TenureMove, adopted, no_gap
from omni_prefix_cache.specs.composition import compile_operation, load_protocol

__all__ = ["DeliveryDesk", "OmniPrefixCacheDeliveryGapError"]


class OmniPrefixCacheDeliveryGapError(OmniPrefixCacheUnmatchError):
    """A view or acknowledgement would skip positions a consumer never
    received. Nothing moved; the message names the request, the consumer,
    its watermark and the available range."""


@dataclass(eq=False, slots=True)
class _ViewItem(TenureMove):
    """One (tenure, consumer) of a view: ``result`` is the clipped range."""

    req_id: ReqId = ""
    result: tuple[int, int] = (0, 0)


@dataclass(eq=False)
class _Commit:
    """commit_output's context."""

    outputs: StageCacheOutputs
    handoff: Callable[[frozenset[ReqId]], None]
    delivery: StageCacheOutputs | None
    live: frozenset[ReqId] = frozenset()
    acks: list[_ViewItem] = field(default_factory=list)


def _gap_error(item: _ViewItem) -> OmniPrefixCacheDeliveryGapError:
    assert item.tenure is not None
    return OmniPrefixCacheDeliveryGapError(
        f"delivery gap for request {item.req_id!r} consumer {item.consumer!r}: delivered up to "
        f"{item.tenure.watermark(item.consumer)}, available [{item.start}, {item.end}) "
        f"(owner {item.tenure.owner})"
    )


def _gap(item: _ViewItem) -> bool:
    """Guard ``gap``. A retired tenure's output has none to raise: commit
    filters it, so a view across its gap selects nothing instead."""
    assert item.tenure is not None
    if item.tenure.delivery_state(item.consumer) is DeliveryState.RETIRED:
        return False
    return not no_gap(item.tenure, item.consumer, item.start, item.end)


def _raise_gap(item: _ViewItem) -> None:
    raise _gap_error(item)


def _clip(item: _ViewItem) -> None:
    assert item.tenure is not None
    retired = item.tenure.delivery_state(item.consumer) is DeliveryState.RETIRED
    if retired and not no_gap(item.tenure, item.consumer, item.start, item.end):
        item.result = (item.end, item.end)  # a retired tenure's gap: nothing is selected
        return
    seen = item.tenure.watermark(item.consumer)
    item.result = (min(item.end, max(item.start, seen)), item.end)


class DeliveryDesk:
    """The delivery operations of one manager."""

    def __init__(self, table: RequestTable, state_lock: threading.Lock) -> None:
        self._table = table
        self._lock = state_lock
        ops = load_protocol().ops
        binding = RequestBinding()
        guards = {"gap": _gap}
        self._view = compile_operation(
            ops["delivery_view"], binding, {"raise_gap": _raise_gap, "clip_outputs": _clip}, guards
        )
        self._ack = compile_operation(ops["ack_delivery"], binding, {"raise_gap": _raise_gap}, guards)
        self._commit = compile_operation(
            ops["commit_output"],
            binding,
            {
                "filter_retired": self._filter_retired,
                "check_handoff": self._check_handoff,
                "handoff": _handoff,
                "ack_live": self._ack_live,
            },
            {},
        )

    def view(self, outputs: StageCacheOutputs, req_ids: Sequence[ReqId], consumer: str) -> StageCacheOutputs:
        """The positions of ``req_ids`` that ``consumer`` has not received,
        as a new output tied to the same tenures; nothing is acknowledged.
        Raises the delivery-gap error (nothing moved) or the invalid-argument
        error for a request the output does not carry."""
        if not isinstance(consumer, str) or not consumer:
            raise OmniPrefixCacheInvalidArgumentError(
                f"delivery_view: consumer must be a non-empty str, got {consumer!r}"
            )
        items = [self._item(outputs, rid, consumer, "delivery_view") for rid in req_ids]
        with self._lock:
            self._table.consumers.add(consumer)
            for item in items:
                self._view.run(item)
        ranges = {item.req_id: item.result for item in items}
        return _clipped(outputs, list(req_ids), ranges, consumer)

    def ack(self, view: StageCacheOutputs) -> None:
        """Move each request's watermark of the view's consumer to the
        view's end. The whole view is checked first: a gap raises and moves
        nothing."""
        consumer = _consumer_of(view, "ack_delivery")
        items = [self._item(view, rid, consumer, "ack_delivery") for rid in view.token_ranges]
        with self._lock:
            self._ack_all(items)

    def commit(
        self,
        outputs: StageCacheOutputs,
        handoff: Callable[[frozenset[ReqId]], None],
        delivery: StageCacheOutputs | None,
    ) -> frozenset[ReqId]:
        """Hand off the live requests' prepared payloads and acknowledge
        their delivery view, atomically. Returns the live requests (their
        tenure is not retired and is still the id's current or finished one)."""
        if delivery is not None:
            _consumer_of(delivery, "commit_output")
            for rid, tenure in output_progress(delivery).items():
                if output_progress(outputs).get(rid) is not tenure:
                    raise OmniPrefixCacheInvalidArgumentError(
                        f"commit_output: the delivery view of request {rid!r} does not belong to this output"
                    )
        ctx = _Commit(outputs, handoff, delivery)
        with self._lock:
            self._commit.run(ctx)
        return ctx.live

    # ------------------------------------------------------------- handlers

    def _item(self, outputs: StageCacheOutputs, rid: ReqId, consumer: str, call: str) -> _ViewItem:
        progress = output_progress(outputs).get(rid)
        span = outputs.token_ranges.get(rid)
        if span is None:
            raise OmniPrefixCacheInvalidArgumentError(
                f"{call}: request {rid!r} is not in this output (its token_ranges carry "
                f"{sorted(outputs.token_ranges)[:8]})"
            )
        if progress is None:
            raise OmniPrefixCacheInvalidArgumentError(
                f"{call}: request {rid!r} has no request progress in this output (its _progress carries "
                f"{sorted(output_progress(outputs))[:8]})"
            )
        if not isinstance(progress, PrefixCacheRequestProgress):
            raise OmniPrefixCacheInvalidTypeError(
                f"{call}: the progress of request {rid!r} must be a PrefixCacheRequestProgress, "
                f"got {type(progress).__name__}"
            )
        # A hand-built output's bare progress delivers as upstream's does (``adopted``).
        return _ViewItem(adopted(rid, progress), self._table, None, consumer, int(span[0]), int(span[1]), rid)

    def _ack_all(self, items: list[_ViewItem]) -> None:
        for item in items:
            if _gap(item):
                raise _gap_error(item)
        for item in items:
            self._ack.run(item)

    def _filter_retired(self, ctx: _Commit) -> None:
        current = self._table.current
        ctx.live = frozenset(
            rid
            for rid, progress in output_progress(ctx.outputs).items()
            if isinstance(progress, PrefixCacheRequestProgress)
            and not _retired(progress)
            and current.get(rid, progress) is progress
        )

    def _check_handoff(self, ctx: _Commit) -> None:
        if ctx.delivery is None:
            return
        consumer = _consumer_of(ctx.delivery, "commit_output")
        ctx.acks = [
            self._item(ctx.delivery, rid, consumer, "commit_output")
            for rid in ctx.delivery.token_ranges
            if rid in ctx.live
        ]
        for item in ctx.acks:
            if _gap(item):
                raise _gap_error(item)

    def _ack_live(self, ctx: _Commit) -> None:
        for item in ctx.acks:
            self._ack.run(item)


def _retired(progress: PrefixCacheRequestProgress) -> bool:
    """A tenure's lifecycle state says; a bare progress (built by hand) has
    only its ``retired`` flag."""
    return progress.state is RequestState.RETIRED if isinstance(progress, Tenure) else progress.retired


def _handoff(ctx: _Commit) -> None:
    ctx.handoff(ctx.live)


def _consumer_of(view: StageCacheOutputs, call: str) -> str:
    consumer = output_consumer(view)
    if consumer is None:
        raise OmniPrefixCacheInvalidArgumentError(
            f"{call} needs a delivery view (from delivery_view), not a raw output"
        )
    return consumer


def _clipped(
    outputs: StageCacheOutputs, req_ids: list[ReqId], ranges: dict[ReqId, tuple[int, int]], consumer: str
) -> StageCacheOutputs:
    """``outputs`` cut to ``ranges``: hidden rows and token-major mm from
    each range's start; other mm whole."""
    origin = outputs.token_ranges
    hidden = None
    if outputs.hidden_states is not None:
        hidden = {
            r: outputs.hidden_states[r][ranges[r][0] - origin[r][0] :] for r in req_ids if r in outputs.hidden_states
        }
    mm: dict[str, dict[ReqId, Any]] = {}
    for key, per_req in outputs.mm_outputs.items():
        token_major = key in outputs.token_mm_keys
        starts = origin if key in outputs.cached_mm_keys else outputs.scheduled_token_ranges
        values: dict[ReqId, Any] = {}
        for rid in req_ids:
            if rid not in per_req:
                continue
            value = per_req[rid]
            if token_major:
                value = value[max(0, ranges[rid][0] - starts[rid][0]) :]
            values[rid] = value
        mm[key] = values
    return replace(
        outputs,
        hidden_states=hidden,
        mm_outputs=mm,
        token_ranges=ranges,
        scheduled_token_ranges={
            r: outputs.scheduled_token_ranges[r] for r in req_ids if r in outputs.scheduled_token_ranges
        },
        _progress={r: output_progress(outputs)[r] for r in req_ids},
        _consumer=consumer,
    )
