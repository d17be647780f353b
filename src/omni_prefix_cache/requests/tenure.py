"""A request tenure and its two machines: request_lifecycle and delivery.

A *tenure* is one request id under one owner (``PrefixCacheRequestOwner``:
scheduler admission and content generation). ``Tenure`` is the public
``PrefixCacheRequestProgress`` of that tenure (the watermarks
``computed_upto``, ``saved_upto`` and ``delivered_upto[consumer]``) plus its
``request_lifecycle`` state (spec/request_lifecycle.yaml) and one
``delivery`` state per consumer (spec/delivery.yaml). Outputs keep the
tenure they were saved under (``StageCacheOutputs._progress``), so an
acknowledgement advances that tenure even after the id was reused.

The machines' handlers take a ``TenureMove`` (the tenure plus what the move
needs: the event, the consumer and its range, the table to detach writes
through). Everything here runs under the manager's state lock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheRequestOwner
from omni_prefix_cache.interface import PrefixCacheRequestProgress, ReqId
from omni_prefix_cache.specs import CompiledMove, SpecState, compile_machine, load_spec
from omni_prefix_cache.specs.types.delivery import DeliveryState
from omni_prefix_cache.specs.types.request_lifecycle import RequestState


class LifecycleHost(Protocol):
    """What the lifecycle machine's effects call (``RequestTable``)."""

    def install_lookup(self, tenure: Tenure, event: PrefixCacheRequestEvent) -> None: ...
    def detach_writes(self, tenure: Tenure) -> None: ...


__all__ = [
    "DELIVERY_MACHINE",
    "REQUEST_MACHINE",
    "DeliveryState",
    "IssuedView",
    "RequestState",
    "Tenure",
    "TenureMove",
    "adopted",
]


@dataclass(eq=False)
class Tenure(PrefixCacheRequestProgress):
    """One request id under one owner: its progress, its lifecycle state
    and its delivery state per consumer. Identity, not value, matters:
    outputs and acknowledgements refer to the object."""

    req_id: ReqId = ""
    state: SpecState = RequestState.UNKNOWN
    deliveries: dict[str, SpecState] = field(default_factory=dict)
    # The furthest position any output of this tenure can hold: the end of
    # every range a save recorded (scheduled rows, or a hit it served; a
    # speculative draft's row only once a materialize accepted it). Only
    # grows; once set, a view may not pass it (guard ``within_saved``).
    rows_upto: int = 0

    # Identity semantics (the dataclass base compares by value).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def delivery_state(self, consumer: str) -> SpecState:
        """The consumer's delivery state (OPEN until the tenure retires;
        state lock)."""
        st = self.deliveries.get(consumer)
        if st is None:
            # Every watermark starts OPEN; one first seen on a retired tenure
            # is retired by the machine's own move (recorded like any other).
            st = self.deliveries[consumer] = DELIVERY_MACHINE.initial
            if self.retired:
                retire = DELIVERY_MACHINE.move(st, "retire")
                assert retire is not None
                apply_delivery_move(retire, TenureMove(self, consumer=consumer))
                st = self.deliveries[consumer]
        return st

    def watermark(self, consumer: str) -> int:
        return self.delivered_upto.get(consumer, 0)

    def lowest_watermark(self, consumers: Collection[str]) -> int:
        """Where a recovered hit starts: the least any consumer received,
        counting each of ``consumers`` (every consumer the manager has seen)
        that this tenure never delivered to at 0."""
        delivered = self.delivered_upto
        low = min(delivered.values(), default=0)
        if low and any(c not in delivered for c in consumers):
            return 0
        return low

    def __repr__(self) -> str:
        return (
            f"Tenure({self.req_id!r}, owner={self.owner}, {RequestState(self.state).name}, "
            f"computed={self.computed_upto}, saved={self.saved_upto}, delivered={self.delivered_upto})"
        )


@dataclass(eq=False, slots=True)
class TenureMove:
    """The context one lifecycle or delivery move runs on."""

    tenure: Tenure | None
    table: LifecycleHost | None = None
    event: PrefixCacheRequestEvent | None = None
    consumer: str = ""
    start: int = 0  # the delivery's available range
    end: int = 0
    # An acknowledgement's: whether its view is one the manager issued, as
    # issued and not yet acknowledged (guard ``issued_view``), or one an
    # acknowledgement already spent (guard ``spent_view``), both decided once
    # per view before the first move, and that view's record (``spend_view``).
    issued: bool = True
    record: IssuedView | None = None
    spent: bool = False
    # An accept move's: whether the step wrote cached keys (its accepted rows then count as saved).
    saves: bool = True


@dataclass(eq=False, slots=True)
class IssuedView:
    """What the manager issued as one delivery view: its consumer, its
    ranges and tenures (copies: the view object is the caller's), and
    whether an acknowledgement spent it."""

    consumer: str
    ranges: dict[ReqId, tuple[int, int]]
    tenures: dict[ReqId, Any]
    spent: bool = False


def adopted(rid: ReqId, progress: PrefixCacheRequestProgress) -> Tenure:
    """``progress`` as the tenure a delivery move runs on. A tenure is
    itself; a bare ``PrefixCacheRequestProgress`` (a ``StageCacheOutputs``
    built by hand, not by materialize) has no lifecycle of its own: it is
    RETIRED when it says ``retired``, else RUNNING, and its consumers'
    delivery states follow. It shares the progress's ``delivered_upto``, so
    an acknowledgement moves the caller's own watermarks."""
    if isinstance(progress, Tenure):
        return progress
    return Tenure(
        computed_upto=progress.computed_upto,
        saved_upto=progress.saved_upto,
        delivered_upto=progress.delivered_upto,
        owner=progress.owner,
        lookup=progress.lookup,
        retired=progress.retired,
        req_id=rid,
        state=RequestState.RETIRED if progress.retired else RequestState.RUNNING,
    )


# ---------------------------------------------------------------- request_lifecycle


def _resumed_event(m: TenureMove) -> bool:
    return m.event is not None and m.event.kind is PrefixCacheEventKind.RESUMED


def _install_lookup(m: TenureMove) -> None:
    assert m.table is not None and m.event is not None and m.tenure is not None
    m.table.install_lookup(m.tenure, m.event)


def _detach_writes(m: TenureMove) -> None:
    assert m.table is not None and m.tenure is not None
    m.table.detach_writes(m.tenure)


def count_accepted(tenure: Tenure, end: int, saves: bool) -> None:
    """The rows up to ``end`` (a step's accepted end) count as computed and,
    when the step wrote cached keys, as saved: each watermark reaches
    ``end``, never back (a later save may have recorded past it already)."""
    if end > tenure.computed_upto:
        tenure.computed_upto = end
    if saves and end > tenure.saved_upto:
        tenure.saved_upto = end
    if end > tenure.rows_upto:
        tenure.rows_upto = end


def _count_accepted(m: TenureMove) -> None:
    assert m.tenure is not None
    count_accepted(m.tenure, m.end, m.saves)


REQUEST_MACHINE = compile_machine(
    load_spec("request_lifecycle"),
    guards={"resumed_event": _resumed_event},
    effects={"install_lookup": _install_lookup, "detach_writes": _detach_writes, "count_accepted": _count_accepted},
    state_enum=RequestState,
)


# ---------------------------------------------------------------- delivery


def no_gap(tenure: Tenure, consumer: str, start: int, end: int) -> bool:
    """Whether ``[start, end)`` does not start past the consumer's
    watermark, unless it holds nothing new (``end`` at or below it, or an
    empty range)."""
    seen = tenure.delivered_upto.get(consumer, 0)
    return end <= seen or start <= seen or start >= end


def _no_gap(m: TenureMove) -> bool:
    assert m.tenure is not None
    return no_gap(m.tenure, m.consumer, m.start, m.end)


def within_saved(tenure: Tenure, end: int) -> bool:
    """Whether a range ending at ``end`` stays within what the tenure's
    saves recorded (``Tenure.rows_upto``). A tenure no save has recorded
    rows for is not judged: its outputs were built by the caller (a bare
    progress, or upstream's hand-built outputs over the manager's tenures),
    and there is no saved end to hold them to."""
    return end <= tenure.rows_upto or tenure.rows_upto == 0


def _within_saved(m: TenureMove) -> bool:
    assert m.tenure is not None
    return within_saved(m.tenure, m.end)


def _issued_view(m: TenureMove) -> bool:
    return m.issued


def _spent_view(m: TenureMove) -> bool:
    """Guard ``spent_view``: the view was issued as it stands and an acknowledgement already spent it."""
    return m.spent


def _spend_view(m: TenureMove) -> None:
    if m.record is not None:
        m.record.spent = True


def _advance_watermark(m: TenureMove) -> None:
    assert m.tenure is not None
    delivered = m.tenure.delivered_upto
    seen = delivered.get(m.consumer, 0)
    # Only a range that continues the watermark moves it (an empty one past it does not).
    if m.end > seen and m.start <= seen:
        delivered[m.consumer] = m.end


DELIVERY_MACHINE = compile_machine(
    load_spec("delivery"),
    guards={"no_gap": _no_gap, "within_saved": _within_saved, "issued_view": _issued_view, "spent_view": _spent_view},
    effects={"advance_watermark": _advance_watermark, "spend_view": _spend_view},
    state_enum=DeliveryState,
)


def enabled(move: CompiledMove | None, m: TenureMove) -> bool:
    """Whether ``move`` exists and every guard of it holds for ``m``."""
    return move is not None and all(g(m) for g in move.guards)


def apply_request_move(move: CompiledMove, m: TenureMove) -> None:
    """Move the tenure's lifecycle state, then run the move's effects."""
    assert m.tenure is not None
    m.tenure.state = move.dest
    if move.dest is RequestState.RETIRED:
        m.tenure.retired = True
    recorder = REQUEST_MACHINE.recorder
    if recorder is not None:
        recorder.moved(move, m.tenure)
    for effect in move.effects:
        effect(m)


def apply_delivery_move(move: CompiledMove, m: TenureMove) -> None:
    """Move the consumer's delivery state, then run the move's effects."""
    assert m.tenure is not None
    m.tenure.deliveries[m.consumer] = move.dest
    recorder = DELIVERY_MACHINE.recorder
    if recorder is not None:
        if recorder.per_instance or move.source != move.dest:
            # One instance per (tenure, consumer); the detail is the move's range
            # (the trace validator judges delivery from the acknowledged ones).
            recorder.moved(move, (m.tenure, m.consumer), (m.start, m.end))
        else:
            # A view or an acknowledgement, once per request of a delivery:
            # metrics only count a self-loop, so no instance key is built.
            recorder.counted(move, 1)
    for effect in move.effects:
        effect(m)


MoveFn = Callable[[TenureMove], None]


# ---------------------------------------------------------------- request_event's guards

TERMINAL_KINDS = frozenset({PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED})
OPENING_KINDS = frozenset({PrefixCacheEventKind.STARTED, PrefixCacheEventKind.REPLACED})
ACTIVE_STATES = frozenset({RequestState.ADMITTED, RequestState.RUNNING})


def older(a: PrefixCacheRequestOwner | None, b: PrefixCacheRequestOwner | None) -> bool:
    """``a`` is an older owner than ``b`` (owner-less events are never older)."""
    return a is not None and b is not None and a < b


def terminal_event(m: TenureMove) -> bool:
    return m.event is not None and m.event.kind in TERMINAL_KINDS


def newer_owner(m: TenureMove) -> bool:
    event, cur = m.event, m.tenure
    return event is not None and cur is not None and older(cur.owner, event.owner)


def opens_tenure(m: TenureMove) -> bool:
    event, cur = m.event, m.tenure
    if event is None or event.kind not in OPENING_KINDS:
        return False
    return cur is None or cur.state not in ACTIVE_STATES or event.owner is None or event.owner != cur.owner


def lookup_complete(m: TenureMove) -> bool:
    return m.event is not None and bool(m.event.lookup_complete)
