"""``LifecycleModel``: the protocol's lifecycle operations over one request id.

The actions are segments of the compiled operations (``compile_protocol``
against ``LifeBinding``): the engine runs ``new_step`` (one event, chosen
by the scheduler below; its state segments are ``request_event``'s moves
and the hit plan) and then ``save`` (``record_saved``: the scheduled
positions are saved), and ``discard``; a reader runs ``materialize`` (the
step's output, from its hit's start); each consumer runs ``delivery_view``
of an output it has not fully received, then ``ack_delivery`` or
``commit_output`` of that view, or drops it (a view never acknowledged);
at most ``hostile`` times, consumer 0 edits an output or its view to reach
one position further, or keeps a view it acknowledged to use it again
(``sid`` -2 in the label: the acknowledgement keeps its view).
A segment with only the write path's steps is invisible here and runs on
into the next one (``environment.invisible``).

The scheduler (the environment) admits the id (STARTED, or a control-only
STARTED then the lookup), extends it, preempts and RESUMEs it with a hit of
any length up to what its tenure saved (growing and shrinking hits),
REPLACEs it (a newer generation), FINISHes it and admits it again (the id
reused), and sends at most ``stale`` late events of an older owner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from omni_prefix_cache.specs.composition import CompiledOperation, ProtocolSpec, ProtocolViolation, compile_protocol
from omni_prefix_cache.testing.modelcheck.environment import invisible
from omni_prefix_cache.testing.modelcheck.life_binding import GapRaised, LifeBinding, RefusedRaised
from omni_prefix_cache.testing.modelcheck.life_invariants import LifeInvariants
from omni_prefix_cache.testing.modelcheck.life_world import (
    ANNOUNCED,
    DEAD_OUT,
    DONE,
    EDITED,
    EXTENDED,
    FINISHED,
    KIND_NAMES,
    L_NO_ARGS,
    NONE,
    PREEMPTED,
    REPLACED,
    RESUMED,
    RUNNING,
    SCHED_NAMES,
    SPENT,
    STARTED,
    Event,
    LCtx,
    LifeBounds,
    LLabel,
    LRunning,
    LStep,
    LWorld,
    Sched,
    View,
)
from omni_prefix_cache.testing.modelcheck.scope import LIFE_SCOPE
from omni_prefix_cache.testing.modelcheck.world import Violation

REQUIRED_OPERATIONS = tuple(sorted(LIFE_SCOPE.runs))
# The environment's own actions (no operation runs).
ENV_ACTIONS = ("preempt", "drop_view", "edit_view")
HOSTILE = 0  # the consumer that may misbehave
KEEPS_VIEW = -2  # the step argument of an acknowledgement that keeps its view (a hostile consumer)
EDITED_COPY = -3  # the step argument of a view of an output's copy edited to reach one further
# Run whole: between materialize's state segments only the write path's fetch runs, and
# nothing another thread does here reads the step's state (it is consumed in the first).
WHOLE = frozenset({"materialize"})


class LifecycleModel:
    """Initial world, actions, invariants and text of the lifecycle model.

    Raises SpecError for a protocol without an operation or role it needs.
    """

    name = "lifecycle"

    def __init__(self, bounds: LifeBounds, spec: ProtocolSpec):
        from omni_prefix_cache.specs.loader import SpecError

        self.bounds = bounds
        missing = [op for op in REQUIRED_OPERATIONS if op not in spec.ops]
        if missing:
            raise SpecError(f"{spec.origin}: the lifecycle model needs operations {missing}")
        self.binding = LifeBinding(bounds.consumers, spec)
        self.ops: dict[str, CompiledOperation] = compile_protocol(
            spec, self.binding, self.binding.effects(), self.binding.guards(), only=REQUIRED_OPERATIONS
        )
        self.binding.ops = self.ops
        no_ops = frozenset(spec.effect_names - LIFE_SCOPE.effects)
        self.invisible = {
            name: tuple(seg.wait is not None or invisible(seg, LIFE_SCOPE.roles, no_ops) for seg in op.spec.segments)
            for name, op in self.ops.items()
        }
        S = self.binding.m["step"].State
        self.UNSAVED, self.SAVED, self.CONSUMED = int(S["UNSAVED"]), int(S["SAVED"]), int(S["CONSUMED"])
        self.inv = LifeInvariants(self.binding)

    def describe(self) -> str:
        return self.bounds.describe()

    # ------------------------------------------------------------- world
    def initial(self) -> LWorld:
        b = self.bounds
        sched = Sched((0, 0), 0, NONE, b.preemptions, b.stale, b.hostile)
        return LWorld(sched, (), -1, -1, (), (), (None,) * b.consumers, (), (), ())

    def settled(self, w: LWorld) -> bool:
        """No operation in progress, every saved step consumed, no view outstanding."""
        return (
            not w.engine
            and not w.reader
            and all(st.state != self.SAVED for st in w.steps)
            and all(v is None for v in w.views)
        )

    def unsettled(self, w: LWorld) -> list[str]:
        why = [f"the engine is inside {w.engine[0]}"] if w.engine else []
        why += [f"the reader is inside {w.reader[0]}"] if w.reader else []
        why += [f"step {i} is saved" for i, st in enumerate(w.steps) if st.state == self.SAVED]
        why += [f"consumer {k} holds a view" for k, v in enumerate(w.views) if v is not None]
        return why

    def check_state(self, w: LWorld) -> None:
        self.inv.check_state(w)

    def check_move(self, before: LWorld, after: LWorld, label: LLabel) -> None:
        self.inv.check_move(before, after, label)

    def canonical(self, w: LWorld) -> LWorld:
        """Consumed steps no thread holds become alike; outputs no consumer
        can take anything new from (and no view refers to) are dropped."""
        held = {run[2][0] for run in (w.engine, w.reader) if run}
        steps = tuple(
            LStep(self.CONSUMED, None, (0, 0), -1, 0, 0, (), -1, 0, 0)
            if st.state == self.CONSUMED and i not in held
            else st
            for i, st in enumerate(w.steps)
        )
        viewed = {v.output for v in w.views if v is not None}
        outputs = tuple(
            DEAD_OUT if o.tenure >= 0 and i not in viewed and all(o.end <= m for m in w.tenures[o.tenure].marks) else o
            for i, o in enumerate(w.outputs)
        )
        if steps == w.steps and outputs == w.outputs:
            return w
        return w._replace(steps=steps, outputs=outputs)

    # ----------------------------------------------------------- actions
    def successors(self, w: LWorld) -> Iterator[tuple[LLabel, LWorld]]:
        b = self.bounds
        if w.engine:
            op, seg, args = w.engine
            yield from self._run(w, "engine", op, seg, args)
        else:
            if len(w.steps) < b.steps:
                for event, sched, scheduled, drafts in self._choices(w):
                    yield from self._new_step(w, event, sched, scheduled, drafts)
            for sid, st in enumerate(w.steps):
                if st.state == self.SAVED:
                    yield from self._run(w, "engine", "discard", 0, (sid, -1, -1))
            if w.sched.status == RUNNING and w.sched.preempts > 0:
                s = w.sched
                preempted = s._replace(status=PREEMPTED, preempts=s.preempts - 1)
                yield ("preempt", 0, 0, L_NO_ARGS, ""), w._replace(sched=preempted)
        if w.reader:
            op, seg, args = w.reader
            yield from self._run(w, "reader", op, seg, args)
        else:
            busy = w.engine[2][0] if w.engine else -1
            for sid, st in enumerate(w.steps):
                if st.state == self.SAVED and sid != busy:
                    yield from self._run(w, "reader", "materialize", 0, (sid, -1, -1))
        seen: set[object] = set()
        for k, view in enumerate(w.views):
            # Consumers in the same situation are interchangeable: only the first one acts.
            alike = (view, tuple((t.marks[k], t.dstates[k], t.got[k]) for t in w.tenures))
            if alike in seen:
                continue
            seen.add(alike)
            hostile = w.sched.hostile > 0 and k == HOSTILE  # one consumer misbehaves: the other is its witness
            if view is None:
                for o, out in enumerate(w.outputs):
                    if out.tenure >= 0 and out.end > w.tenures[out.tenure].marks[k]:
                        yield from self._run(w, "", "delivery_view", 0, (-1, k, o))
                    if out.tenure >= 0 and hostile:
                        yield from self._view_edited(w, k, o)
            else:
                for op in ("ack_delivery", "commit_output"):
                    yield from self._run(w, "", op, 0, (-1, k, view.output))
                    if hostile and view.state != SPENT:
                        yield from self._run(w, "", op, 0, (KEEPS_VIEW, k, view.output))
                views = list(w.views)
                views[k] = None
                yield ("drop_view", 0, 0, (-1, k, view.output), ""), w._replace(views=tuple(views))
                if hostile and view.state == 0:
                    views[k] = view._replace(end=view.end + 1, state=EDITED)
                    yield (
                        ("edit_view", 0, 0, (-1, k, view.output), ""),
                        w._replace(views=tuple(views), sched=self._spent(w)),
                    )

    def _view_edited(self, w: LWorld, k: int, o: int) -> Iterator[tuple[LLabel, LWorld]]:
        """Consumer ``k`` takes delivery_view of its own copy of output
        ``o``, edited to reach one position further. The copy lives only
        in that call: refused, it is gone (the consumer holds no view)."""
        out = w.outputs[o]
        edited = w._replace(outputs=(*w.outputs, out._replace(end=out.end + 1)), sched=self._spent(w))
        for (op, first, last, _, raised), after in self._run(edited, "", "delivery_view", 0, (-1, k, len(w.outputs))):
            if raised:
                after = after._replace(outputs=after.outputs[:-1])
            # Labelled as a view of output o (the invariants read the original; the copy has its start).
            yield (op, first, last, (EDITED_COPY, k, o), raised), after

    @staticmethod
    def _spent(w: LWorld) -> Sched:
        """The scheduler's record with one hostile call fewer left."""
        return w.sched._replace(hostile=w.sched.hostile - 1)

    def _choices(self, w: LWorld) -> list[tuple[Event, Sched, tuple[int, int], tuple[int, int]]]:
        """The scheduler's next step: (event, its view after, positions
        scheduled, (speculative drafts among them, drafts the forward accepts))."""
        b, s = self.bounds, w.sched
        (a, g), P = s.owner, b.positions
        plain = (0, 0)

        def run(x: Sched) -> tuple[Sched, tuple[int, int], tuple[int, int]]:
            if x.status == RUNNING and x.computed < P:
                return x._replace(computed=x.computed + 1), (x.computed, x.computed + 1), plain
            return x, (0, 0), plain

        out: list[tuple[Event, Sched, tuple[int, int], tuple[int, int]]] = []
        if s.status in (NONE, DONE) and a < b.admissions:
            o = (a + 1, 1)
            # A reused id may hit the prefix its previous tenure computed (never a rejected draft).
            for h in sorted({0, min(1, max((t.verified for t in w.tenures), default=0))}):
                out.append((Event(STARTED, o, h, True), *run(s._replace(owner=o, computed=h, status=RUNNING))))
            out.append((Event(STARTED, o, 0, False), s._replace(owner=o, computed=0, status=ANNOUNCED), (0, 0), plain))
        if s.status == ANNOUNCED:
            out.append((Event(STARTED, s.owner, 0, True), *run(s._replace(status=RUNNING))))
        if s.status == RUNNING:
            out.append((Event(EXTENDED, s.owner, s.computed, True), *run(s)))
            # Decode with speculative drafts: the verified position, then d drafts, k of them accepted;
            # the scheduler rolls back to the accepted end (vLLM: num_computed_tokens -= rejected).
            c = s.computed
            for d in range(1, b.drafts + 1):
                if c + 1 + d > P:
                    break
                for k in range(d + 1):
                    out.append(
                        (Event(EXTENDED, s.owner, c, True), s._replace(computed=c + 1 + k), (c, c + 1 + d), (d, k))
                    )
            out.append((Event(FINISHED, s.owner, 0, True), s._replace(status=DONE), (0, 0), plain))
        if s.status in (RUNNING, PREEMPTED) and g < b.generations:
            o = (a, g + 1)
            out.append((Event(REPLACED, o, 0, True), *run(s._replace(owner=o, computed=0, status=RUNNING))))
        if s.status == PREEMPTED and w.current >= 0:
            # The resumed hit: the blocks of what the tenure computed, never past an accepted end.
            for h in range(min(w.tenures[w.current].verified, P) + 1):
                out.append((Event(RESUMED, s.owner, h, True), *run(s._replace(computed=h, status=RUNNING))))
        olds = [t.owner for t in w.tenures if t.owner < s.owner]
        if s.stale > 0 and olds:
            for kind in (STARTED, EXTENDED, FINISHED):
                out.append((Event(kind, olds[-1], 0, True), s._replace(stale=s.stale - 1), (0, 0), plain))
        return out

    def _new_step(
        self, w: LWorld, event: Event, sched: Sched, scheduled: tuple[int, int], drafts: tuple[int, int]
    ) -> Iterator[tuple[LLabel, LWorld]]:
        low = -1
        if event.kind == RESUMED and w.current >= 0:
            low = min(w.tenures[w.current].marks)  # ghost: the slowest consumer at the resume
        step = LStep(self.UNSAVED, event, scheduled, -1, 0, 0, (), low, *drafts)
        started = w._replace(sched=sched, steps=(*w.steps, step))
        yield from self._run(started, "engine", "new_step", 0, (len(w.steps), -1, -1))

    def _run(self, w: LWorld, thread: str, op: str, seg: int, args: tuple[int, ...]) -> Iterator[tuple[LLabel, LWorld]]:
        """One action: segment ``seg`` of ``op`` (on through invisible
        segments before it and after its last visible one, and through a
        continuation that changes nothing but where the thread is: it
        commutes with every other thread's action)."""
        label, out = self._action(w, thread, op, seg, args)
        while True:
            run = out.engine if thread == "engine" else out.reader
            if not run or run[0] != op or label[4]:
                break
            nxt_label, nxt = self._action(out, thread, op, run[1], args)
            if nxt._replace(engine=out.engine, reader=out.reader) != out:
                break
            label, out = (op, seg, nxt_label[2], args, nxt_label[4]), nxt
        yield label, out

    def _action(self, w: LWorld, thread: str, op: str, seg: int, args: tuple[int, ...]) -> tuple[LLabel, LWorld]:
        compiled, inv = self.ops[op], self.invisible[op]
        n = len(compiled.segments)
        c = LCtx(w, args)
        self._setup(c, op)
        raised, last = "", seg
        try:
            while True:
                compiled.segments[last](c)
                if last + 1 == n or not (inv[last] or all(inv[last + 1 :]) or op in WHOLE):
                    break
                last += 1
            self._receive(c, op)
        except GapRaised:
            raised = " raises: gap"
        except RefusedRaised:
            raised = " raises: refused"
        except ProtocolViolation as exc:
            v = Violation("protocol.required_move", str(exc))
            v.label = (op, seg, last, args, "")
            raise v from None
        except Violation as exc:
            exc.label = (op, seg, last, args, "")
            raise
        if op in ("delivery_view", "ack_delivery", "commit_output"):
            self._after_delivery(c, op, raised)
        nxt: LRunning = ()
        if not raised and last + 1 < n:
            nxt = (op, last + 1, args)
        elif not raised and op == "new_step":
            nxt = ("save", 0, args)
        engine = nxt if thread == "engine" else w.engine
        reader = nxt if thread == "reader" else w.reader
        return (op, seg, last, args, raised), c.freeze(engine, reader)

    def _setup(self, c: LCtx, op: str) -> None:
        """What the operation acts on: its step's tenure, or the consumer's item."""
        if op == "save" or op == "new_step":
            c.tenure = c.current
        elif op in ("materialize", "discard"):
            st = c.steps[c.sid]
            # request.accept? moves the tenure of a drafted step's materialize (a discard here carries no
            # accepted rows: it rejects every draft and counts none).
            c.tenure = st.tenure if op == "materialize" and st.drafts else -1
        elif op == "delivery_view":
            out = c.outputs[c.output]
            c.items = [[out.tenure, c.consumer, out.start, out.end]]
        elif op in ("ack_delivery", "commit_output"):
            view = c.views[c.consumer]
            assert view is not None
            t = c.outputs[view.output].tenure
            c.items = [[t, c.consumer, view.start, view.end]]
            c.live = [t]  # commit_output's live requests: the output's, until filter_retired
            if op == "ack_delivery" and view.state != SPENT:
                # The consumer took the view's rows; a spent view's ack is a retry (it took nothing again).
                c.received.append((t, c.consumer, view.start, view.rows_end))

    def _receive(self, c: LCtx, op: str) -> None:
        self.inv.handed(c.tenures, c.current, c.handed)
        for t, k, start, end in c.received:
            ten = c.tenures[t]
            got = LifeInvariants.receive(ten.got[k], t, k, start, end)
            c.tenures[t] = ten._replace(got=(*ten.got[:k], got, *ten.got[k + 1 :]))
        c.received = []

    @staticmethod
    def _after_delivery(c: LCtx, op: str, raised: str) -> None:
        if op == "delivery_view":
            if not raised:
                assert c.items is not None
                _, _, start, end = c.items[0]
                start, end = c.clipped if c.clipped is not None else (start, end)  # unclipped without clip_outputs
                c.views[c.consumer] = View(c.output, start, end)
        elif c.sid == KEEPS_VIEW and not raised:
            # A hostile consumer keeps the view it acknowledged (spent, unless nothing spent it).
            view = c.views[c.consumer]
            assert view is not None
            c.views[c.consumer] = view._replace(state=SPENT) if c.spent else view
            c.sched = c.sched._replace(hostile=c.sched.hostile - 1)
        else:
            c.views[c.consumer] = None  # taken (or refused): the consumer is done with the view

    # -------------------------------------------------------------- text
    def label_text(self, label: LLabel) -> str:
        op, first, last, (sid, k, o), raised = label
        segs = f"{first}" if last <= first else f"{first}-{last}"
        name = op + (f"[{segs}]" if op in self.ops and len(self.ops[op].segments) > 1 else "")
        if op == "preempt":
            return "(scheduler) preempt the request"
        if op == "drop_view":
            return f"(consumer {k}) drop its view of output {o} unacknowledged"
        if op == "edit_view":
            return f"(consumer {k}) edit its view of output {o} to reach one position further"
        what = f"step {sid}" if sid >= 0 else f"consumer {k}, output {o}"
        extra = {KEEPS_VIEW: ", keeping the view", EDITED_COPY: ", edited to reach one position further"}
        return f"{name}({what}{extra.get(sid, '')})" + raised

    def change_text(self, a: LWorld, b: LWorld) -> str:
        parts: list[str] = []
        if a.sched != b.sched:
            s = b.sched
            parts.append(f"scheduler: owner {s.owner} {SCHED_NAMES[s.status]}, computed {s.computed}")
        for i, st in enumerate(b.steps):
            if i >= len(a.steps):
                drafts = f" ({st.drafts} drafts, {st.accepted} accepted)" if st.drafts else ""
                parts.append(f"step {i}: {self._event_text(st.event)}, schedules {list(st.sched)}{drafts}")
            elif a.steps[i] != st and st.tenure >= 0:
                hit = f", hit [{st.hit[1]}, {st.hit[2]})" if st.hit else ""
                drafts = f", drafts {st.drafts} ({st.accepted} accepted)" if st.drafts else ""
                parts.append(f"step {i} {self._step_state(st.state)} saved [{st.start}, {st.end}){hit}{drafts}")
            elif a.steps[i].state != st.state:
                parts.append(f"step {i} {self._step_state(st.state)}")
        for t, ten in enumerate(b.tenures):
            if t >= len(a.tenures) or a.tenures[t] != ten:
                parts.append(f"tenure {t}: {self._tenure_text(ten)}")
        if (a.current, a.finished) != (b.current, b.finished):
            parts.append(f"current {b.current}, finished {b.finished}")
        for i, out in enumerate(b.outputs):
            if i >= len(a.outputs):
                parts.append(f"output {i}: tenure {out.tenure} [{out.start}, {out.end})")
        for k, v in enumerate(b.views):
            if a.views[k] != v:
                text = "none" if v is None else f"[{v.start}, {v.end}) of output {v.output}" + _VIEW_STATES[v.state]
                parts.append(f"consumer {k} view {text}")
        return "; ".join(parts) or "no change"

    def world_text(self, w: LWorld) -> list[str]:
        s = w.sched
        lines = [f"scheduler: owner {s.owner} {SCHED_NAMES[s.status]}, computed {s.computed}"]
        lines += [f"tenure {t}: {self._tenure_text(ten)}" for t, ten in enumerate(w.tenures)]
        lines.append(f"current {w.current}, finished {w.finished}, lookups {list(w.lookups)}")
        lines += [
            f"step {i}: {self._step_state(st.state)} {self._event_text(st.event)} saved [{st.start}, {st.end})"
            for i, st in enumerate(w.steps)
            if st.state != self.CONSUMED
        ]
        live = [(i, o) for i, o in enumerate(w.outputs) if o.tenure >= 0]
        lines += [f"output {i}: tenure {o.tenure} [{o.start}, {o.end})" for i, o in live]
        lines += [f"consumer {k}: view [{v.start}, {v.end}) of output {v.output}" for k, v in enumerate(w.views) if v]
        return lines

    def _step_state(self, state: int) -> str:
        return self.binding.m["step"].State(state).name

    @staticmethod
    def _event_text(e: Event | None) -> str:
        if e is None:
            return "no event"
        extra = f" hit {e.hit_end}" if e.kind in (STARTED, REPLACED, RESUMED) else ""
        return f"{KIND_NAMES[e.kind]} owner {e.owner}{extra}" + ("" if e.lookup_complete else " (control only)")

    def _tenure_text(self, ten: object) -> str:
        from omni_prefix_cache.testing.modelcheck.life_world import Ten

        assert isinstance(ten, Ten)
        b = self.binding
        dst = ",".join(b.m["delivery"].State(d).name for d in ten.dstates)
        return (
            f"owner {ten.owner} {b.m['request'].State(ten.state).name} computed {ten.computed} saved {ten.saved} "
            f"delivered {list(ten.marks)} ({dst}) received {list(ten.got)} verified {ten.verified}"
        )

    # The invariants this model binds, by name (the model's share of invariants_for("model")).
    def checker_names(self) -> tuple[str, ...]:
        return LifeInvariants.NAMES


Checker = Callable[[LWorld], None]
_VIEW_STATES = ("", " (edited)", " (spent)")
