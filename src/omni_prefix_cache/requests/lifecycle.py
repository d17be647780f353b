"""The request table: lifecycle events applied to tenures, by the spec.

``RequestTable`` runs one step's events (operation new_step's first
state segment: ``validate_events`` then ``apply_events``). Each event runs
the compiled operation ``request_event`` of spec/protocol.yaml, whose moves
are the request_lifecycle machine's; retiring a tenure runs
``retire_owner`` and, per consumer, ``retire_delivery``. What the events
leave for the rest of new_step is taken with ``take_lookups`` (the hits to
plan) and ``take_detached`` (the writes to escalate, outside the lock).

Threading: engine thread, under the manager's state lock (every method).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any
from weakref import WeakValueDictionary

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheRequestOwner
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, ReqId, Tid
from omni_prefix_cache.requests.drafts import DraftAccounting
from omni_prefix_cache.requests.tenure import (
    ACTIVE_STATES,
    DELIVERY_MACHINE,
    OPENING_KINDS,
    REQUEST_MACHINE,
    TERMINAL_KINDS,
    RequestState,
    Tenure,
    TenureMove,
    apply_delivery_move,
    apply_request_move,
    enabled,
    lookup_complete,
    newer_owner,
    older,
    opens_tenure,
    terminal_event,
)
from omni_prefix_cache.specs.composition import CompiledOperation, compile_operation, load_protocol
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.runner import CALLER_HOLDS
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_record import Hit

__all__ = ["MAX_CONSUMERS", "RequestBinding", "RequestTable"]

_EXTEND = REQUEST_MACHINE.move(RequestState.RUNNING, "extend")
TokenRanges = Mapping[ReqId, tuple[int, int]]  # request -> its rows' token range, as a write layout gives them
if _EXTEND is None:
    raise SpecError("request_lifecycle.yaml: RUNNING has no extend move (the usual decode event's)")

# The most consumers the table remembers (one per request would otherwise grow it without bound).
MAX_CONSUMERS = 64

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]


class RequestBinding:
    """``Binding`` for the roles ``request`` (request_lifecycle, on
    ``TenureMove.tenure``) and ``delivery`` (delivery, on the tenure's
    ``TenureMove.consumer`` watermark)."""

    def move(self, role: str, trigger: TriggerName) -> tuple[Pred, Run]:
        if role == "request":
            machine, apply_move = REQUEST_MACHINE, apply_request_move

            def state_of(m: TenureMove) -> int:
                assert m.tenure is not None
                return int(m.tenure.state)

        elif role == "delivery":
            machine, apply_move = DELIVERY_MACHINE, apply_delivery_move

            def state_of(m: TenureMove) -> int:
                assert m.tenure is not None
                return int(m.tenure.delivery_state(m.consumer))

        else:
            raise SpecError(f"protocol.yaml: the request table fires no {role}.{trigger}")
        if trigger not in machine.triggers:
            raise SpecError(f"protocol.yaml: {role} ({machine.spec.name}) has no trigger {trigger!r}")
        row = machine.by_state(trigger)

        def can(m: TenureMove) -> bool:
            return m.tenure is not None and enabled(row[state_of(m)], m)

        def fire(m: TenureMove) -> None:
            move = row[state_of(m)]
            assert move is not None
            apply_move(move, m)

        return can, fire

    def coupling(self, role: str, name: str) -> Run:
        raise SpecError(f"protocol.yaml: the request table runs no coupling {role}.{name}")


class RequestTable:
    """Every request id's current tenure (ADMITTED or RUNNING) and its most
    recent finished one (kept while outputs still refer to it).

    ``detach(req_id)`` is the write ledger's: it closes the id's open
    writes and returns those to escalate. ``check_hit(req_id, hit_end,
    block_ids)`` validates a lookup's hit (raises the invalid-argument error).
    """

    def __init__(
        self,
        detach: Callable[[ReqId], list[Tid]],
        check_hit: Callable[[ReqId, int, Any], object],
        live: set[ReqId],
    ) -> None:
        self._detach = detach
        self._check_hit = check_hit
        self._live = live  # the facade's live ids: those with an announced current tenure
        self.current: dict[ReqId, Tenure] = {}
        # A finished tenure lives while a step snapshot or an output holds it.
        self.finished: WeakValueDictionary[ReqId, Tenure] = WeakValueDictionary()
        self.last_sequence = -1
        self._lookups: list[Hit] = []
        self._detached: list[Tid] = []
        # The consumers that took a delivery view, least recently seen first
        # (a dict as an ordered set): a recovered hit counts one that never
        # received a tenure's rows at 0. At most MAX_CONSUMERS: the least
        # recently seen is forgotten past it (counted in consumers_forgotten).
        self.consumers: dict[str, None] = {}
        self.consumers_forgotten = 0
        protocol = load_protocol()
        ops = protocol.ops
        binding = RequestBinding()
        self._retire_delivery = compile_operation(ops["retire_delivery"], binding, {}, {})
        # The requests executor's share of materialize's and discard's consume (request.accept?).
        self.drafts = DraftAccounting(protocol, binding, self)
        self._retire_owner = compile_operation(
            ops["retire_owner"], binding, {"retire_deliveries": self._retire_deliveries}, {}
        )
        self._request_event: CompiledOperation = compile_operation(
            ops["request_event"],
            binding,
            {
                "ignore_event": self._ignore_event,
                "retire_current": self._retire_current,
                "open_tenure": self._open_tenure,
            },
            {
                "ignored_event": self._ignored_event,
                "terminal_event": terminal_event,
                "newer_owner": newer_owner,
                "opens_tenure": opens_tenure,
                "lookup_complete": lookup_complete,
            },
        )

    # ------------------------------------------------------------ new_step

    def replayed(self, sequence: int | None) -> bool:
        """Guard ``replayed_step``: the step's sequence is at or below the last applied one."""
        return sequence is not None and sequence <= self.last_sequence

    def apply_validated(self, events: Sequence[PrefixCacheRequestEvent], sequence: int | None) -> None:
        """Effect ``apply_events``: run ``request_event`` for each event, in
        order (the step was validated; state lock)."""
        if sequence is not None:
            self.last_sequence = sequence
        current = self.current
        run = partial(CALLER_HOLDS.run_all, self._request_event)
        recorder = REQUEST_MACHINE.recorder
        # The usual decode event moves nothing (``extend``'s self-loop, or
        # ``ignore_event`` for an owner-less one), so it is not run: only a
        # trace sees each instance's moves; metrics count the self-loops,
        # all of the step's in one add (a self-loop starts or ends no stay).
        per_event = recorder is not None and recorder.per_instance
        counting = recorder is not None and not per_event
        extends = 0
        for event in events:
            if not per_event:
                cur = current.get(event.req_id)
                if _plain_extend(event, cur):
                    if counting:
                        extends += _fires_extend(event, cur)
                    continue
            run(TenureMove(self.tenure_of(event.req_id), self, event))
        if extends and recorder is not None:
            recorder.counted(_EXTEND, extends)

    def validate(self, events: Sequence[PrefixCacheRequestEvent]) -> None:
        """Raise the invalid-argument error, before anything moves, for an
        owner change without STARTED or REPLACED, a new content generation
        without REPLACED, a REPLACED without an owner, a conflicting initial
        lookup, or a lookup whose hit the hit planner refuses. Owners are
        followed through the step's own opening events."""
        owners: dict[ReqId, PrefixCacheRequestOwner | None] = {}
        admitted: set[ReqId] = set()  # opened this step without a lookup yet
        for event in events:
            kind, rid, owner = event.kind, event.req_id, event.owner
            if rid not in owners and _plain_extend(event, self.current.get(rid)):
                continue  # the usual decode event: nothing to check
            if kind is PrefixCacheEventKind.REPLACED and owner is None:
                raise OmniPrefixCacheInvalidArgumentError(f"REPLACED event for request {rid!r} carries no owner")
            if rid in owners:
                known: PrefixCacheRequestOwner | None = owners[rid]
                active = True
            else:
                tenure = self.current.get(rid)
                known = tenure.owner if tenure is not None else None
                active = tenure is not None
            if kind in TERMINAL_KINDS or older(owner, known):
                continue
            if active and known is not None and owner is not None and owner > known:
                if kind not in OPENING_KINDS:
                    raise OmniPrefixCacheInvalidArgumentError(
                        f"request {rid!r} changed owner {known} -> {owner} with a {kind.name} event "
                        "(only STARTED or REPLACED open a new owner)"
                    )
                if kind is PrefixCacheEventKind.STARTED and owner.admission_id == known.admission_id:
                    raise OmniPrefixCacheInvalidArgumentError(
                        f"request {rid!r} changed content generation {known.generation} -> {owner.generation} "
                        "without a REPLACED event"
                    )
            opens = kind in OPENING_KINDS and (not active or owner is None or owner != known)
            if kind in OPENING_KINDS and not opens and rid not in owners:
                tenure = self.current.get(rid)
                lookup = (event.hit_end, event.block_ids)
                if (
                    tenure is not None
                    and event.lookup_complete
                    and tenure.lookup is not None
                    and tenure.lookup != lookup
                ):
                    raise OmniPrefixCacheInvalidArgumentError(
                        f"request {rid!r} (owner {owner}): conflicting initial lookup {lookup[0]} tokens, "
                        f"first lookup was {tenure.lookup[0]} tokens"
                    )
            pending = self._pending_lookup(rid, owners) or rid in admitted
            if opens:
                owners[rid] = owner
                admitted.discard(rid)
                if not event.lookup_complete:
                    admitted.add(rid)  # opened by a control: its lookup comes with a later event
            elif pending and event.lookup_complete:
                admitted.discard(rid)
            installs = opens or kind is PrefixCacheEventKind.RESUMED or pending
            if installs and event.lookup_complete and event.hit_end > self._recovery_start(rid, opens):
                self._check_hit(rid, int(event.hit_end), event.block_ids)

    def _recovery_start(self, rid: ReqId, opens: bool) -> int:
        """Where a lookup installed for ``rid`` now would start (0 for a new tenure)."""
        tenure = None if opens else self.current.get(rid)
        return 0 if tenure is None else tenure.lowest_watermark(self.consumers)

    def _pending_lookup(self, rid: ReqId, opened: dict[ReqId, PrefixCacheRequestOwner | None]) -> bool:
        tenure = self.current.get(rid)
        return rid not in opened and tenure is not None and tenure.state is RequestState.ADMITTED

    def see_consumer(self, consumer: str) -> None:
        """``consumer`` took a delivery view (state lock): it becomes the
        most recently seen; past ``MAX_CONSUMERS`` the least recently seen
        one is forgotten (a hit recovered after that no longer waits for it)."""
        consumers = self.consumers
        if consumers.pop(consumer, 0) is None:
            consumers[consumer] = None  # seen again: moved to the end
            return
        consumers[consumer] = None
        if len(consumers) > MAX_CONSUMERS:
            del consumers[next(iter(consumers))]
            self.consumers_forgotten += 1

    def tenure_of(self, rid: ReqId) -> Tenure | None:
        """The id's current tenure, else its most recent finished one."""
        tenure = self.current.get(rid)
        return tenure if tenure is not None else self.finished.get(rid)

    def take_lookups(self) -> list[Hit]:
        """The hits the applied events installed (each a recovery range,
        its block ids not validated yet)."""
        out, self._lookups = self._lookups, []
        return out

    def take_detached(self) -> list[Tid]:
        """The writes the applied finish and retire moves detached."""
        out, self._detached = self._detached, []
        return out

    # -------------------------------------------------- save and materialize

    def for_save(self, rid: ReqId) -> Tenure:
        """The tenure a save of ``rid`` writes under: the current one, else
        a fresh owner-less RUNNING tenure (a request saved without a
        STARTED event, as the seed-era engines do for rows they never
        announced)."""
        tenure = self.current.get(rid)
        if tenure is None:
            tenure = self.current[rid] = Tenure(req_id=rid, state=RequestState.RUNNING)
        return tenure

    def reached(self, rid: ReqId) -> int:
        """The position ``rid``'s current tenure computed up to (0: none). Engine thread."""
        return getattr(self.current.get(rid), "computed_upto", 0)

    def record_saved(
        self,
        ctx: StepContext,
        token_ranges: TokenRanges | None,
        cached: bool,
        starts: Mapping[ReqId, int] | None = None,
    ) -> None:
        """Protocol effect ``record_saved`` (save's state segment): each
        scheduled request's rows advance its tenure's ``computed_upto`` (and,
        when the step wrote cached keys, ``saved_upto``) to their verified
        end: the token end less its speculative drafts (``record.drafts``,
        counted only once accepted: ``accept_rows``). The step keeps the
        tenures and token ranges (drafts included) it saved. Without a
        write layout the range starts where the scheduler output said
        (``starts``, seed-era), else at the tenure's ``computed_upto``. A
        hit request the step did not schedule reports an empty range at its
        hit end."""
        record = ctx.record
        tenures, ranges = record.tenures, record.token_ranges
        drafts = record.drafts
        current = self.current.get
        # (request, rows) in row order, the scheduled entries (zip stops at
        # the counts); ``for_save`` only for an id without a current tenure.
        for rid, rows in zip(record.req_ids, record.scheduled_counts()):
            tenure = current(rid) or self.for_save(rid)
            if token_ranges is None:
                start = tenure.computed_upto if starts is None else starts.get(rid, tenure.computed_upto)
                end = start + rows
            else:
                start, end = token_ranges[rid]
            ranges.append((start, end))
            tenures.append(tenure)
            if drafts:
                end -= drafts.get(rid, 0)  # the rows before the drafts: what the step verified
            tenure.computed_upto = end
            if cached and end > tenure.saved_upto:
                tenure.saved_upto = end
            if end > tenure.rows_upto:
                tenure.rows_upto = end
        for hit in record.hits[record.scheduled :]:  # the hits of requests without rows
            assert hit is not None
            tenure = self.for_save(hit.req_id)
            end = hit.hit_end
            if end > tenure.rows_upto:
                tenure.rows_upto = end
            ranges.append((end, end))
            tenures.append(tenure)

    # ---------------------------------------------- the machines' effects

    def install_lookup(self, tenure: Tenure, event: PrefixCacheRequestEvent) -> None:
        """Effect ``install_lookup``: the event's hit recovers every position
        the slowest consumer has not received, ``[lowest watermark, hit_end)``
        (a known consumer this tenure never delivered to counts at 0)."""
        end = int(event.hit_end)
        tenure.lookup = (end, event.block_ids)
        tenure.computed_upto = end
        start = tenure.lowest_watermark(self.consumers)
        if end > start:
            self._lookups = [lk for lk in self._lookups if lk.req_id != tenure.req_id]
            self._lookups.append(Hit(tenure.req_id, start, end, event.block_ids, tenure))

    def detach_writes(self, tenure: Tenure) -> None:
        """Effect ``detach_writes``: the tenure leaves the current table
        (a finished one stays reachable while referenced); if it was the
        id's current tenure its open writes are detached for escalation."""
        rid = tenure.req_id
        if self.current.get(rid) is tenure:
            del self.current[rid]
            self._live.discard(rid)
            self._detached.extend(self._detach(rid))
            self._lookups = [lk for lk in self._lookups if lk.tenure is not tenure]
        if tenure.state is RequestState.FINISHED:
            self.finished[rid] = tenure
        elif self.finished.get(rid) is tenure:
            del self.finished[rid]

    # --------------------------------------------- request_event's handlers

    def _ignored_event(self, m: TenureMove) -> bool:
        event, cur = m.event, m.tenure
        assert event is not None
        if cur is not None and older(event.owner, cur.owner):
            return True
        if event.kind in TERMINAL_KINDS:
            return cur is None
        if opens_tenure(m):
            return False
        if cur is None or cur.state not in ACTIVE_STATES:
            return True
        # An owner-less event cannot move an owned tenure.
        return event.owner is None and cur.owner is not None

    def _ignore_event(self, m: TenureMove) -> None:
        """Effect ``ignore_event``: the event moves nothing."""

    def _retire_current(self, m: TenureMove) -> None:
        rid = m.event.req_id if m.event is not None else ""
        for tenure in (self.current.get(rid), self.finished.get(rid)):
            if tenure is not None and tenure.state is not RequestState.RETIRED:
                CALLER_HOLDS.run_all(self._retire_owner, TenureMove(tenure, self, m.event))

    def _retire_deliveries(self, m: TenureMove) -> None:
        assert m.tenure is not None
        for consumer in dict.fromkeys([*m.tenure.delivered_upto, *m.tenure.deliveries]):
            CALLER_HOLDS.run_all(self._retire_delivery, TenureMove(m.tenure, self, m.event, consumer))

    def _open_tenure(self, m: TenureMove) -> None:
        event = m.event
        assert event is not None
        tenure = Tenure(owner=event.owner, req_id=event.req_id)
        self.current[event.req_id] = tenure
        self._live.add(event.req_id)
        m.tenure = tenure


def _plain_extend(event: PrefixCacheRequestEvent, cur: Tenure | None) -> bool:
    """An EXTENDED event of the id's RUNNING tenure, of its owner or
    owner-less: it moves nothing and needs no check."""
    return (
        event.kind is PrefixCacheEventKind.EXTENDED
        and cur is not None
        and cur.state is RequestState.RUNNING
        and (event.owner is None or event.owner == cur.owner)
    )


def _fires_extend(event: PrefixCacheRequestEvent, cur: Tenure | None) -> bool:
    """What operation request_event does with a ``_plain_extend`` event:
    ``extend`` when the event is not ignored (an owner-less event of an owned
    tenure is) and its lookup is complete (else ``admit?``, which a RUNNING
    tenure has no move for). tests/test_telemetry.py checks this against
    the operation run event by event."""
    return cur is not None and (event.owner is not None or cur.owner is None) and bool(event.lookup_complete)
