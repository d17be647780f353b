"""Per-consumer delivery: views, acknowledgements and the output commit.

``DeliveryDesk`` runs the compiled operations ``delivery_view``,
``ack_delivery`` and ``commit_output`` of spec/protocol.yaml over the
delivery machine (spec/delivery.yaml) of each tenure an output was saved
under (``StageCacheOutputs._progress``). Cache reads and writes are never
delivery: only an acknowledgement moves a watermark, and only forward.

Only what the manager issued is acknowledged: ``delivery_view`` records
each view it returns (``IssuedView``: its consumer, ranges and tenures), and
``ack_delivery`` / ``commit_output`` refuse a view that is not one of them
as it stands (edited in place, a copy, a hand-built one). A view an
acknowledgement already spent moves nothing again: ``ack_delivery`` of it is
a no-op (move ``ack_again``: a consumer retrying its ack, as upstream's
acknowledgement only advances) and ``commit_output`` hands nothing of it off
(a second commit of one view is a no-op). A view never reaches past what the
tenure's saves recorded (``Tenure.rows_upto``), so an output edited to cover
more is refused too. Every refusal is the invalid-argument error (or, for an
argument that is no output at all, the invalid-type error) and moves nothing.

Threading: any consumer thread; every entry takes the manager's state lock
(``commit_output`` holds it across the caller's handoff, which must only
publish prepared payloads).
"""

from __future__ import annotations

import threading
import weakref
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
from omni_prefix_cache.requests.tenure import (
    DeliveryState,
    IssuedView,
    RequestState,
    Tenure,
    TenureMove,
    adopted,
    no_gap,
    within_saved,
)
from omni_prefix_cache.specs.composition import compile_operation, load_protocol
from omni_prefix_cache.specs.runner import CALLER_HOLDS

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
    record: IssuedView | None = None  # the delivery view's, when the manager issued it as it stands


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


def _outside_saved(item: _ViewItem) -> bool:
    """Guard ``outside_saved``: the output's range ends past what the tenure saved."""
    assert item.tenure is not None
    return not within_saved(item.tenure, item.end)


def _raise_refused(item: _ViewItem) -> None:
    assert item.tenure is not None
    if not item.issued:
        raise OmniPrefixCacheInvalidArgumentError(
            f"ack_delivery: the view of request {item.req_id!r} for consumer {item.consumer!r} "
            f"(range [{item.start}, {item.end})) is not a view this manager issued as it stands (edited in "
            "place, a copy or hand-built: views are acknowledged as delivery_view returned them)"
        )
    raise OmniPrefixCacheInvalidArgumentError(
        f"delivery_view: the output of request {item.req_id!r} covers [{item.start}, {item.end}) but its tenure "
        f"saved positions up to {item.tenure.rows_upto} (owner {item.tenure.owner}): an output is delivered as "
        "materialize returned it"
    )


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

    def __init__(
        self, table: RequestTable, state_lock: threading.Lock, check_open: Callable[[str], None] = lambda call: None
    ) -> None:
        self._table = table
        self._lock = state_lock
        self._check_open = check_open  # the manager's: raises the shutdown error (state lock held)
        # Every view issued and still referenced, by id (an entry leaves with its view).
        self._issued: dict[int, tuple[weakref.ref[StageCacheOutputs], IssuedView]] = {}
        ops = load_protocol().ops
        binding = RequestBinding()
        guards = {
            "gap": _gap,
            "outside_saved": _outside_saved,
            "not_issued": lambda item: not item.issued,
            "spent_view": lambda item: item.spent,
        }
        refuse = {"raise_gap": _raise_gap, "raise_refused": _raise_refused}
        self._view = compile_operation(ops["delivery_view"], binding, {**refuse, "clip_outputs": _clip}, guards)
        self._ack = compile_operation(ops["ack_delivery"], binding, refuse, guards)
        self._commit = compile_operation(
            ops["commit_output"],
            binding,
            {
                "raise_refused": _raise_unissued_commit,
                "filter_retired": self._filter_retired,
                "check_handoff": self._check_handoff,
                "handoff": _handoff,
                "ack_live": self._ack_live,
            },
            {"not_issued": lambda ctx: ctx.delivery is not None and ctx.record is None},
        )

    def view(self, outputs: StageCacheOutputs, req_ids: Sequence[ReqId], consumer: str) -> StageCacheOutputs:
        """The positions of ``req_ids`` that ``consumer`` has not received,
        as a new output tied to the same tenures; nothing is acknowledged.
        Raises the delivery-gap error (nothing moved), the invalid-argument
        error for a request the output does not carry or a range past what
        its tenure saved, the invalid-type error for an argument that is no
        output, and the shutdown error after shutdown."""
        _check_output(outputs, "delivery_view")
        if not isinstance(consumer, str) or not consumer:
            raise OmniPrefixCacheInvalidArgumentError(
                f"delivery_view: consumer must be a non-empty str, got {consumer!r}"
            )
        items = [self._item(outputs, rid, consumer, "delivery_view") for rid in req_ids]
        with self._lock:
            self._check_open("delivery_view")
            # Before the checks: a consumer refused a view (a gap) still asked
            # for the rows, so a recovered hit must wait for it.
            self._table.see_consumer(consumer)
            for item in items:
                CALLER_HOLDS.run_all(self._view, item)
        ranges = {item.req_id: item.result for item in items}
        view = _clipped(outputs, list(req_ids), ranges, consumer)
        self._issue(view, consumer)
        return view

    def ack(self, view: StageCacheOutputs) -> None:
        """Move each request's watermark of the view's consumer to the
        view's end. The whole view is checked first: a gap, or a view this
        manager did not issue as it stands, raises and moves nothing. A view
        already acknowledged or committed is acknowledged again as a no-op
        (guard ``spent_view``: a retried ack)."""
        _check_output(view, "ack_delivery")
        consumer = _consumer_of(view, "ack_delivery")
        items = [self._item(view, rid, consumer, "ack_delivery") for rid in view.token_ranges]
        with self._lock:
            self._check_open("ack_delivery")
            record = self.issued_record(view, consumer, spent=True)
            spent = record is not None and record.spent
            for item in items:
                item.issued, item.spent, item.record = record is not None and not spent, spent, record
            self._ack_all(items)  # each ack move spends the view (spend_view)

    def commit(
        self,
        outputs: StageCacheOutputs,
        handoff: Callable[[frozenset[ReqId]], None],
        delivery: StageCacheOutputs | None,
    ) -> frozenset[ReqId]:
        """Hand off the live requests' prepared payloads and acknowledge
        their delivery view, atomically. Returns the live requests (their
        tenure is not retired and is still the id's current or finished one).
        A delivery view this manager did not issue as it stands raises
        before the handoff. One already acknowledged or committed hands off
        nothing: ``handoff`` gets an empty set and the result is empty, so
        a second commit of one view is a no-op (upstream's tests commit an
        acknowledged view of a retired tenure and expect exactly that)."""
        _check_output(outputs, "commit_output")
        if delivery is not None:
            _check_output(delivery, "commit_output: delivery")
            _consumer_of(delivery, "commit_output")
            for rid, tenure in output_progress(delivery).items():
                if output_progress(outputs).get(rid) is not tenure:
                    raise OmniPrefixCacheInvalidArgumentError(
                        f"commit_output: the delivery view of request {rid!r} does not belong to this output"
                    )
        ctx = _Commit(outputs, handoff, delivery)
        with self._lock:
            self._check_open("commit_output")
            if delivery is not None:
                ctx.record = self.issued_record(delivery, _consumer_of(delivery, "commit_output"), spent=True)
            CALLER_HOLDS.run_all(self._commit, ctx)
        return ctx.live

    # ---------------------------------------------------------- issued views

    def _issue(self, view: StageCacheOutputs, consumer: str) -> None:
        """Record ``view`` as issued (its entry leaves when the view is collected)."""
        key = id(view)
        record = IssuedView(consumer, dict(view.token_ranges), dict(output_progress(view)))
        issued = self._issued

        def forget(ref: weakref.ref[StageCacheOutputs], key: int = key) -> None:
            entry = issued.get(key)
            if entry is not None and entry[0] is ref:
                del issued[key]

        issued[key] = (weakref.ref(view, forget), record)

    def issued_record(self, view: StageCacheOutputs, consumer: str, *, spent: bool = False) -> IssuedView | None:
        """The view's record if this manager issued it to ``consumer``, it
        stands as issued (ranges and tenures) and no acknowledgement spent
        it (with ``spent``: or one did, so the caller can tell a spent view
        from one never issued); else None (state lock)."""
        entry = self._issued.get(id(view))
        if entry is None or entry[0]() is not view:
            return None
        record = entry[1]
        if (record.spent and not spent) or record.consumer != consumer or view.token_ranges != record.ranges:
            return None
        progress = output_progress(view)
        if progress.keys() != record.tenures.keys() or any(progress[r] is not t for r, t in record.tenures.items()):
            return None
        return record

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
        if type(span) is not tuple or len(span) != 2 or type(span[0]) is not int or type(span[1]) is not int:
            raise OmniPrefixCacheInvalidTypeError(
                f"{call}: the token range of request {rid!r} must be a pair of ints, got {span!r}"
            )
        # A hand-built output's bare progress delivers as upstream's does (``adopted``).
        return _ViewItem(adopted(rid, progress), self._table, None, consumer, span[0], span[1], req_id=rid)

    def _ack_all(self, items: list[_ViewItem]) -> None:
        if not (items and items[0].spent):  # a spent view's acknowledgement moves nothing: nothing to refuse
            for item in items:
                if _gap(item):
                    raise _gap_error(item)
            for item in items:
                if not item.issued:
                    _raise_refused(item)
        for item in items:
            CALLER_HOLDS.run_all(self._ack, item)

    def _filter_retired(self, ctx: _Commit) -> None:
        if ctx.record is not None and ctx.record.spent:
            ctx.live = frozenset()  # a spent view was handed off already: nothing of it is live again
            return
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
            item.record = ctx.record  # issued: not_issued refused the commit otherwise
        for item in ctx.acks:
            if _gap(item):
                raise _gap_error(item)

    def _ack_live(self, ctx: _Commit) -> None:
        for item in ctx.acks:
            CALLER_HOLDS.run_all(self._ack, item)  # each spends the view (spend_view)
        if ctx.record is not None:
            ctx.record.spent = True  # also when no request of it was live: it was handed off


def _retired(progress: PrefixCacheRequestProgress) -> bool:
    """A tenure's lifecycle state says; a bare progress (built by hand) has
    only its ``retired`` flag."""
    return progress.state is RequestState.RETIRED if isinstance(progress, Tenure) else progress.retired


def _handoff(ctx: _Commit) -> None:
    ctx.handoff(ctx.live)


def _raise_unissued_commit(ctx: _Commit) -> None:
    consumer = output_consumer(ctx.delivery) if ctx.delivery is not None else None
    raise OmniPrefixCacheInvalidArgumentError(
        f"commit_output: the delivery view for consumer {consumer!r} of requests "
        f"{sorted(ctx.delivery.token_ranges if ctx.delivery is not None else ())[:8]} is not a view this manager "
        "issued as it stands (edited in place, a copy or hand-built; nothing was handed off)"
    )


def _check_output(value: Any, call: str) -> None:
    """``value`` must be a StageCacheOutputs (a materialize result or a view)."""
    if not isinstance(value, StageCacheOutputs):
        raise OmniPrefixCacheInvalidTypeError(
            f"{call} needs a StageCacheOutputs (from materialize or delivery_view), got {type(value).__name__} "
            f"{value!r}"[:200]
        )


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
