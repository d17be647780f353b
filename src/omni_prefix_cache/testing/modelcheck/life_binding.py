"""The lifecycle model's ``Binding`` of the protocol.

``LifeBinding`` compiles the lifecycle's machines (request_lifecycle,
delivery, step_context) with handlers over the lifecycle world (``LCtx``),
and gives ``compile_protocol`` their ``move`` callables and the protocol's
effect and guard handlers. The write path's roles are abstracted (a move of
one is a no-op here: the write-path model fires it), and so are its guards
(they decide nothing: ``scope.LIFE_SCOPE`` says which steps this model
reads, ``scope.check_coverage`` that the two models read every step).
Operations another operation runs (``request_event``, ``retire_owner``,
``retire_delivery``, ``ack_delivery``) run through their compiled form,
as the runtime's RequestTable and DeliveryDesk run them.

Two readings of the spec's words: the *lowest watermark* a resume recovers
from is over every consumer of the model, one that received nothing at 0
(the runtime's ``Tenure.lowest_watermark`` counts every consumer the
manager has seen); ``commit_output``'s live requests start as the output's
own, and the effect ``filter_retired`` narrows them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omni_prefix_cache.specs.compiled import CompiledMachine, compile_machine
from omni_prefix_cache.specs.composition import CompiledOperation, Fire, ProtocolSpec, ProtocolViolation
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.specs.runner import CALLER_HOLDS
from omni_prefix_cache.testing.modelcheck.life_world import (
    FINISHED,
    ISSUED,
    REPLACED,
    RESUMED,
    SPENT,
    STARTED,
    LCtx,
    Out,
    Ten,
    View,
    older,
    rep,
    replace_at,
)
from omni_prefix_cache.testing.modelcheck.scope import LIFE_SCOPE
from omni_prefix_cache.testing.modelcheck.world import Violation, nothing


class GapRaised(Exception):
    """``raise_gap`` ran: the operation raises; what it moved before stays moved."""


class RefusedRaised(Exception):
    """``raise_refused`` ran: the operation raises the invalid-argument error."""


def _always(c: Any) -> bool:
    return True


def _never(c: Any) -> bool:
    return False


class LifeBinding:
    """The protocol's binding over the lifecycle world.

    ``m``: the compiled machines by role; ``ops``: the compiled protocol,
    set by ``LifecycleModel`` once compiled (the handlers of effects that
    run another operation read it). Raises SpecError for a spec without a
    role the model needs.
    """

    def __init__(self, consumers: int, spec: ProtocolSpec) -> None:
        self.consumers = consumers
        self.spec = spec
        for role in LIFE_SCOPE.roles:
            if role not in spec.components:
                raise SpecError(f"{spec.origin}: the lifecycle model needs component role {role!r}")
        handlers: dict[str, Callable[[Any], Any]] = {
            "resumed_event": lambda c: c.event is not None and c.event.kind == RESUMED,
            "install_lookup": self._install_lookup,
            "detach_writes": self._detach_writes,
            "no_gap": lambda c: self._no_gap(c, c.cur),
            "within_saved": lambda c: self._within_saved(c, c.cur),
            "issued_view": self._issued_view,
            "spent_view": self._spent_view,
            "spend_view": self._spend_view,
            "advance_watermark": self._advance_watermark,
            "count_accepted": self._count_accepted,
            "release_step_holder": nothing,
        }
        self.m: dict[str, CompiledMachine] = {}
        for role in sorted(LIFE_SCOPE.roles):
            ms = spec.components[role]
            self.m[role] = compile_machine(
                ms,
                guards={g: handlers[g] for g in ms.guard_names if g in handlers},
                effects={e: handlers[e] for e in ms.effect_names if e in handlers},
            )
        R, D = self.m["request"].State, self.m["delivery"].State
        self.RETIRED, self.FIN = int(R["RETIRED"]), int(R["FINISHED"])
        self.active = frozenset((int(R["ADMITTED"]), int(R["RUNNING"])))
        self.d_open = int(self.m["delivery"].initial)
        self.D = D
        self.ops: Mapping[str, CompiledOperation] = {}
        self._required = {
            (s.role, s.trigger) for op in spec.operations for s in op.walk() if isinstance(s, Fire) and not s.optional
        }

    # ------------------------------------------------------------ tenures
    def new_tenure(self, owner: tuple[int, int]) -> Ten:
        n = self.consumers
        return Ten(owner, int(self.m["request"].initial), 0, 0, -1, (0,) * n, (self.d_open,) * n, (0,) * n, 0)

    @staticmethod
    def _set(c: LCtx, t: int, **kw: Any) -> None:
        c.tenures[t] = rep(c.tenures[t], **kw)

    def _install_lookup(self, c: LCtx) -> None:
        assert c.event is not None
        end, t = c.event.hit_end, c.tenure
        # Ghost: a hit's rows are the cache's, verified when they were computed.
        self._set(c, t, lookup=end, computed=end, verified=max(c.tenures[t].verified, end))
        start = min(c.tenures[t].marks)  # the slowest consumer (every consumer of the model)
        if end > start:
            c.pending = (*(lk for lk in c.pending if lk[0] != t), (t, start, end))

    def _detach_writes(self, c: LCtx) -> None:
        # Writes are saved positions here: detaching lands them. The tenure leaves the current table.
        t = c.tenure
        if c.current == t:
            c.current = -1
            c.pending = tuple(lk for lk in c.pending if lk[0] != t)
        if c.tenures[t].state == self.FIN:
            c.finished = t
        elif c.finished == t:
            c.finished = -1

    @staticmethod
    def _no_gap(c: LCtx, item: list[int]) -> bool:
        t, k, start, end = item
        seen = c.tenures[t].marks[k]
        return end <= seen or start <= seen or start >= end

    @staticmethod
    def _within_saved(c: LCtx, item: list[int]) -> bool:
        """The range ends at or before what the tenure saved or was served."""
        ten = c.tenures[item[0]]
        return item[3] <= max(ten.saved, ten.served)

    @staticmethod
    def _issued_view(c: LCtx) -> bool:
        """The consumer presents its view as issued (not edited, not spent)."""
        view = c.views[c.consumer] if c.consumer >= 0 else None
        return view is None or view.state == ISSUED

    @staticmethod
    def _spent_view(c: LCtx) -> bool:
        """The consumer presents, as issued, a view an acknowledgement already spent."""
        view = c.views[c.consumer] if c.consumer >= 0 else None
        return view is not None and view.state == SPENT

    @staticmethod
    def _spend_view(c: LCtx) -> None:
        c.spent = True

    def _advance_watermark(self, c: LCtx) -> None:
        t, k, start, end = c.cur
        ten = c.tenures[t]
        if end > ten.marks[k] and start <= ten.marks[k]:
            self._set(c, t, marks=replace_at(ten.marks, k, end))

    # -------------------------------------------------------------- roles
    def _instances(self, c: LCtx, role: str) -> list[Any]:
        if role == "request":
            return [c.tenure] if c.tenure >= 0 else []
        if role == "step":
            return [c.sid] if c.sid >= 0 else []
        if c.items is not None:
            return c.items
        # A delivery move in a step's operation acts on the step's watermarks (no spec does this).
        st = c.steps[c.sid] if c.sid >= 0 else None
        if st is None or st.tenure < 0:
            return []
        return [[st.tenure, k, st.start, st.end] for k in range(self.consumers)]

    def _get(self, c: LCtx, role: str, inst: Any) -> int:
        if role == "request":
            return int(c.tenures[inst].state)
        if role == "step":
            return int(c.steps[inst].state)
        return int(c.tenures[inst[0]].dstates[inst[1]])

    def _put(self, c: LCtx, role: str, inst: Any, dest: int) -> None:
        if role == "request":
            self._set(c, inst, state=dest)
        elif role == "step":
            c.steps[inst] = rep(c.steps[inst], state=dest)
        else:
            ten = c.tenures[inst[0]]
            self._set(c, inst[0], dstates=replace_at(ten.dstates, inst[1], dest))

    def move(self, role: str, trigger: str) -> tuple[Callable[[Any], bool], Callable[[Any], None]]:
        """(enabled, fire) over the role's instances in the context. No
        instance: not enabled. Several (a delivery move of a step): a
        required move needs all of them enabled, an optional one any."""
        if role not in self.m:
            return _always, nothing  # the write path's: the write-path model fires it
        row = self.m[role].by_state(trigger)
        need_all = (role, trigger) in self._required

        def one(c: LCtx, inst: Any) -> Any:
            if role == "delivery":
                c.cur = inst
            mv = row[self._get(c, role, inst)] if trigger in self.m[role].triggers else None
            if mv is None or not all(g(c) for g in mv.guards):
                return None
            return mv

        def enabled(c: LCtx) -> bool:
            insts = self._instances(c, role)
            if not insts:
                return False
            ok = [one(c, i) is not None for i in insts]
            return all(ok) if need_all else any(ok)

        def fire(c: LCtx) -> None:
            for inst in list(self._instances(c, role)):
                mv = one(c, inst)
                if mv is None:
                    continue
                self._put(c, role, inst, int(mv.dest))
                for eff in mv.effects:
                    eff(c)
                c.fired.add((role, trigger))

        return enabled, fire

    def coupling(self, role: str, name: str) -> Callable[[Any], None]:
        if role in self.m:
            raise SpecError(f"{self.spec.origin}: the lifecycle model runs no coupling {role}.{name}")
        return nothing  # the write path's (slot tenancy): the write-path model runs it

    # ------------------------------------------------ protocol effects/guards
    def effects(self) -> dict[str, Callable[[Any], None]]:
        out: dict[str, Callable[[Any], None]] = {name: nothing for name in self.spec.effect_names}
        return out | {
            "apply_events": self._apply_events,
            "ignore_event": nothing,
            "retire_current": self._retire_current,
            "open_tenure": self._open_tenure,
            "retire_deliveries": self._retire_deliveries,
            "record_saved": self._record_saved,
            "plan_hits": self._plan_hits,
            "merge_outputs": self._merge_outputs,
            "cut_rejected": self._cut,
            "raise_gap": self._raise_gap,
            "raise_refused": self._raise_refused,
            "clip_outputs": self._clip,
            "filter_retired": self._filter_retired,
            "check_handoff": self._check_handoff,
            "handoff": self._handoff,
            "ack_live": self._ack_live,
        }

    def guards(self) -> dict[str, Callable[[Any], bool]]:
        # The write path's guards decide nothing here (scope: their branches are its steps).
        out: dict[str, Callable[[Any], bool]] = {name: _never for name in self.spec.guard_names}
        out |= {name: (_always if value else _never) for name, value in LIFE_SCOPE.assumed.items()}
        return out | {
            "ignored_event": self._ignored_event,
            "terminal_event": lambda c: c.event is not None and c.event.kind == FINISHED,
            "newer_owner": lambda c: c.tenure >= 0 and older(c.tenures[c.tenure].owner, c.event.owner),
            "opens_tenure": self._opens_tenure,
            "lookup_complete": lambda c: c.event is not None and c.event.lookup_complete,
            "gap": lambda c: c.tenures[c.items[0][0]].state != self.RETIRED and not self._no_gap(c, c.items[0]),
            "outside_saved": lambda c: not self._within_saved(c, c.items[0]),
            "not_issued": lambda c: not self._issued_view(c),
            "spent_view": self._spent_view,
        }

    def _run(self, op: str, c: LCtx) -> None:
        compiled = self.ops.get(op)
        if compiled is None:
            raise Violation("model.outside", f"operation {op} is not in the protocol")
        CALLER_HOLDS.run_all(compiled, c)

    def _apply_events(self, c: LCtx) -> None:
        if c.event is None:
            return
        c.tenure = c.current if c.current >= 0 else c.finished  # RequestTable.tenure_of
        self._run("request_event", c)

    def _ignored_event(self, c: LCtx) -> bool:
        e, t = c.event, c.tenure
        assert e is not None
        if t >= 0 and older(e.owner, c.tenures[t].owner):
            return True
        if e.kind == FINISHED:
            return t < 0
        if self._opens_tenure(c):
            return False
        return t < 0 or c.tenures[t].state not in self.active

    def _opens_tenure(self, c: LCtx) -> bool:
        e, t = c.event, c.tenure
        if e is None or e.kind not in (STARTED, REPLACED):
            return False
        return t < 0 or c.tenures[t].state not in self.active or e.owner != c.tenures[t].owner

    def _retire_current(self, c: LCtx) -> None:
        held = c.tenure
        for t in dict.fromkeys((c.current, c.finished)):
            if t >= 0 and c.tenures[t].state != self.RETIRED:
                c.tenure = t
                self._run("retire_owner", c)
        c.tenure = held

    def _retire_deliveries(self, c: LCtx) -> None:
        held = c.items
        for k in range(self.consumers):
            c.items = [[c.tenure, k, 0, 0]]
            self._run("retire_delivery", c)
        c.items = held

    def _open_tenure(self, c: LCtx) -> None:
        assert c.event is not None
        c.tenures.append(self.new_tenure(c.event.owner))
        c.current = c.tenure = len(c.tenures) - 1

    def _plan_hits(self, c: LCtx) -> None:
        if c.pending:
            c.steps[c.sid] = rep(c.steps[c.sid], hit=c.pending[-1])
            c.pending = ()

    def _record_saved(self, c: LCtx) -> None:
        st = c.steps[c.sid]
        t = c.current  # RequestTable.for_save: the current tenure (none here: nothing is recorded)
        if t < 0:
            return
        start, end = st.sched
        if start < end:
            ten = c.tenures[t]
            verified = end - st.drafts  # a draft counts once a materialize accepts it (request.accept)
            truth = max(ten.verified, end - st.drafts + st.accepted)  # ghost: what the forward verified
            self._set(c, t, computed=verified, saved=max(ten.saved, verified), verified=truth)
        elif st.hit and st.hit[0] == t:
            start = end = st.hit[2]  # a hit the step did not schedule: an empty range at its end
        else:
            return
        c.steps[c.sid] = rep(st, tenure=t, start=start, end=end)

    def _merge_outputs(self, c: LCtx) -> None:
        st = c.steps[c.sid]
        if st.tenure < 0:
            return
        start = st.start
        if st.hit and st.hit[0] == st.tenure:
            start = min(start, st.hit[1])
            ten = c.tenures[st.tenure]
            self._set(c, st.tenure, served=max(ten.served, st.hit[2]))
        c.outputs.append(Out(st.tenure, start, st.end))

    def _count_accepted(self, c: LCtx) -> None:
        """request_lifecycle's count_accepted: the step's accepted drafts count as computed and saved."""
        end, t = c.steps[c.sid].accepted_end, c.tenure
        ten = c.tenures[t]
        self._set(c, t, computed=max(ten.computed, end), saved=max(ten.saved, end))

    def _cut(self, c: LCtx) -> None:
        """cut_rejected: the output merge_outputs just made ends at its step's accepted end."""
        st = c.steps[c.sid]
        if st.tenure >= 0 and st.drafts and c.outputs:
            out = c.outputs[-1]
            c.outputs[-1] = out._replace(end=min(out.end, st.accepted_end))

    def _raise_gap(self, c: LCtx) -> None:
        raise GapRaised()

    def _raise_refused(self, c: LCtx) -> None:
        raise RefusedRaised()

    def _clip(self, c: LCtx) -> None:
        assert c.items is not None
        t, k, start, end = c.items[0]
        if c.tenures[t].state == self.RETIRED and not self._no_gap(c, c.items[0]):
            c.clipped = (end, end)  # a retired tenure's gap: nothing is selected
            return
        seen = c.tenures[t].marks[k]
        c.clipped = (min(end, max(start, seen)), end)

    def _filter_retired(self, c: LCtx) -> None:
        c.live = [t for t in c.live if c.tenures[t].state != self.RETIRED and c.current in (-1, t)]

    def _view_of(self, c: LCtx) -> View:
        view = c.views[c.consumer]
        assert view is not None
        return view

    def _check_handoff(self, c: LCtx) -> None:
        view = self._view_of(c)
        t = c.outputs[view.output][0]
        c.acks = [[t, c.consumer, view.start, view.end]] if t in c.live else []
        for item in c.acks:
            if not self._no_gap(c, item):
                raise GapRaised()

    def _handoff(self, c: LCtx) -> None:
        view = self._view_of(c)
        for t in c.live:
            c.handed.append(t)
            c.received.append((t, c.consumer, view.start, view.rows_end))  # the rows it holds

    def _ack_live(self, c: LCtx) -> None:
        held = c.items
        for item in c.acks:
            c.items = [item]
            self._run("ack_delivery", c)
        c.items = held
        c.spent = True  # the view was handed off: spent, also when nothing of it was live


def required_move_violation(exc: ProtocolViolation) -> Violation:
    return Violation("protocol.required_move", str(exc))
