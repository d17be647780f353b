"""The model's environment: which actions each thread may take next.

``ModelEnvironment`` is what the model chooses itself (the package
docstring lists it): from a world, every operation a thread may start or
continue, with which arguments, and where something may fail; each action
runs one segment of a compiled operation (on through segments the model
cannot observe). It also reduces the state space: interchangeable requests
and untouched slots are tried once (symmetry), and ``canonical`` forgets
what no later move or check reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from omni_prefix_cache.specs.composition import (
    CompiledOperation,
    Couple,
    Do,
    Fire,
    ProtocolViolation,
    Segment,
    walk_steps,
)
from omni_prefix_cache.testing.modelcheck.facts import ModelFacts
from omni_prefix_cache.testing.modelcheck.world import (
    COMMITTER,
    DEF,
    DEFQ,
    ENGINE,
    FAILER,
    IMM,
    NO_ARGS,
    READER,
    REJECTS,
    Bounds,
    Ctx,
    Label,
    Running,
    Slot,
    Step,
    Task,
    Violation,
    World,
    op_args,
    rep,
    with_tid,
)


def invisible(seg: Segment, roles: frozenset[str], no_ops: frozenset[str]) -> bool:
    """A wait on a monotone event, or a segment whose every step is a no-op
    here: an effect in ``no_ops``, a move of a role not in ``roles``."""
    if seg.wait:
        return seg.wait in ("done", "host_ready")
    for s in walk_steps(seg.steps):
        if isinstance(s, Do) and s.effect not in no_ops:
            return False
        if isinstance(s, Fire | Couple) and s.role in roles:
            return False
    return True


class ModelEnvironment:
    """The threads' next actions over ``ops`` (the compiled protocol).

    ``guards`` are the binding's protocol guards (a wait's ``raises``).
    Pure: every call maps a world to worlds and keeps no state of its own.
    """

    def __init__(
        self,
        bounds: Bounds,
        facts: ModelFacts,
        ops: Mapping[str, CompiledOperation],
        guards: Mapping[str, Callable[[Any], bool]],
        no_ops: frozenset[str],
    ):
        self.bounds = bounds
        self.f = facts
        self.ops = ops
        self.guards = guards
        roles = frozenset(facts.m)
        self.invisible = {
            name: tuple(invisible(seg, roles, no_ops) for seg in op.spec.segments) for name, op in ops.items()
        }
        # Where a save may fail and abandon its step: after the claim, before the step is issued.
        save = ops["save"].spec
        at = {x.label: i for i, sg in enumerate(save.segments) for x in sg.steps if isinstance(x, Fire)}
        claim, issue = at.get("step_holder.claim"), at.get("step.save")
        self._abandon_at = (
            frozenset(range(claim + 1, issue + 1))
            if "abandon_save" in ops and claim is not None and issue is not None
            else frozenset()
        )

    # ------------------------------------------------------------- world
    @property
    def fresh_slot(self) -> Slot:
        return Slot(int(self.f.m["slot"].initial), -1, 0, False, -1)

    def initial(self) -> World:
        b = self.bounds
        return World(
            tasks=(),
            steps=(),
            slots=tuple(self.fresh_slot for _ in range(b.slots * b.keys)),
            pages=tuple(frozenset() for _ in range(b.pages)),
            hi=(),
            lo=(),
            completed=(),
            failed=(),
            staged=0,
            sticky=False,
            failures_drained=False,
            reads=(),
            threads=((), (), (), ()),
            awake=False,
        )

    def settled(self, w: World) -> bool:
        """All tasks terminal with their events set, no page held, every
        slot at rest, no operation in progress."""
        return (
            all(t.state in self.f.task_final and not t.owed for t in w.tasks)
            and not any(w.pages)
            and all(s.state in self.f.slot_rest for s in w.slots)
            and not any(w.threads)
        )

    # ----------------------------------------------------------- actions
    def successors(self, w: World) -> Iterator[tuple[Label, World]]:
        """``(label, next world)`` for every enabled action. Raises
        Violation (with the label in ``.label``) for a broken move."""
        b = self.bounds
        th = w.threads
        failures = sum(t.state == self.f.FAILED for t in w.tasks) + sum(1 for r in th if r and r[0] == "fail")
        can_fail = failures < b.failures and "fail" in self.ops
        # engine
        if th[ENGINE]:
            yield from self._continue(w, ENGINE)
            op, seg, args = th[ENGINE]  # type: ignore[misc]
            if op == "save" and seg in self._abandon_at:
                yield from self._start(w, ENGINE, "abandon_save", args)  # the save fails after its claim
        else:
            if not w.sticky and len(w.steps) < b.steps:
                yield from self._new_steps(w)
                yield from self._saves(w)
            for tid, t in enumerate(w.tasks):
                if t.state not in self.f.task_final:
                    yield from self._start(w, ENGINE, "escalate", op_args(tid=tid))
            if w.completed or w.failed:
                yield from self._start(w, ENGINE, "drain", NO_ARGS)
            for sid, st in enumerate(w.steps):
                if st.state == self.f.SAVED:
                    yield from self._start(w, ENGINE, "discard", op_args(sid=sid))
                    if st.cells:  # its rows were speculative drafts, all rejected
                        yield from self._start(w, ENGINE, "discard", op_args(sid=sid, kind=REJECTS))
        # reader: a lagged materialize on another thread
        if th[READER]:
            yield from self._continue(w, READER)
        elif "materialize" in self.ops:
            for sid, st in enumerate(w.steps):
                # A save still in progress has not returned its step id to anyone yet.
                if st.state == self.f.SAVED and not (th[ENGINE] and th[ENGINE][2][3] == sid):  # type: ignore[misc]
                    yield from self._start(w, READER, "materialize", op_args(sid=sid))
                    if st.cells:  # its rows were speculative drafts the step rejected
                        yield from self._start(w, READER, "materialize", op_args(sid=sid, kind=REJECTS))
        if not th[READER] and "prefetch" in self.ops:
            # the prefetch thread's fetch of a pending read (here on the reader's thread)
            pending = int(self.f.R["PENDING"])
            for rid, r in enumerate(w.reads):
                if r.state == pending:
                    yield from self._start(w, READER, "prefetch", op_args(rid=rid, sid=r.step))
        # committer
        run = th[COMMITTER]
        if run:
            op, seg, args = run
            yield from self._continue(w, COMMITTER)
            if can_fail and seg == 0 and op in ("committer_copy", "committer_write"):
                yield from self._start(w, COMMITTER, "fail", args)  # the copy / pool write fails
        else:
            head = w.hi[0] if w.hi else w.lo[0] if w.lo else -1
            if head >= 0 and w.awake:
                yield from self._start(w, COMMITTER, "committer_claim", op_args(tid=head))
            elif head >= 0 and "linger" in self.ops:
                # Asleep with work a save queued and no kick since: its linger runs out (operation linger).
                yield from self._start(w, COMMITTER, "linger", NO_ARGS)
            if w.completed or w.failed:
                # The threaded committer drains too, between any two of the
                # other threads' segments (its try at the state lock won).
                yield from self._start(w, COMMITTER, "drain", NO_ARGS)
        # a failure on another thread (dispatch, shutdown) of a task no operation has in hand
        if th[FAILER]:
            yield from self._continue(w, FAILER)
        elif can_fail:
            busy = {r[2][4] for r in th if r}
            for tid, t in enumerate(w.tasks):
                if t.state not in self.f.task_final and tid not in busy:
                    yield from self._start(w, FAILER, "fail", op_args(tid=tid))

    def _new_steps(self, w: World) -> Iterator[tuple[Label, World]]:
        if "new_step" not in self.ops or sum(r.state not in self.f.read_final for r in w.reads) >= self.bounds.reads:
            return
        sid = len(w.steps)
        if any(r.step == sid for r in w.reads):
            return
        K = self.bounds.keys
        for slot in self._distinct_slots(w):
            for cell in range(slot * K, slot * K + K):
                if w.slots[cell].state == self.f.COMMITTED:
                    yield from self._start(w, ENGINE, "new_step", op_args(slot=cell, sid=sid))

    def _saves(self, w: World) -> Iterator[tuple[Label, World]]:
        if not any(not p for p in w.pages):
            return  # the engine never saves into a full staging pool (it would block until a timeout)
        sid = len(w.steps)
        with_step = w._replace(steps=(*w.steps, Step(int(self.f.m["step"].initial), self.f.unheld, -1, 0, (), False)))
        full = len(w.tasks) >= self.bounds.tasks
        for r in self._distinct_requests(w):
            open_def = any(t.req == r and t.sched == DEF and t.state in self.f.accepts for t in w.tasks)
            for kind in (IMM, DEF, DEFQ):
                if full and not (kind == DEF and open_def):
                    continue
                for slot in self._distinct_slots(w):
                    for keys in range(1 << (self.bounds.keys - 1)):
                        args = op_args(req=r, kind=kind, slot=slot, sid=sid, keys=keys)
                        yield from self._start(with_step, ENGINE, "save", args)

    def _distinct_requests(self, w: World) -> list[int]:
        """Requests with a write, plus the first without one: those are
        interchangeable (symmetry reduction)."""
        used = sorted({t.req for t in w.tasks})
        fresh = next((r for r in range(self.bounds.requests) if r not in used), None)
        return used if fresh is None else sorted([*used, fresh])

    def _distinct_slots(self, w: World) -> list[int]:
        """Slots in use, plus the first untouched one (symmetry reduction)."""
        K = self.bounds.keys
        used = {s // K for t in w.tasks for s in t.slots} | {r.slot // K for r in w.reads}
        used |= {i // K for i, s in enumerate(w.slots) if s != self.fresh_slot}
        out = sorted(used)
        fresh = next((i for i in range(self.bounds.slots) if i not in used), None)
        return out if fresh is None else sorted([*out, fresh])

    def _start(self, w: World, thread: int, op: str, args: tuple[int, ...]) -> Iterator[tuple[Label, World]]:
        compiled = self.ops[op]
        if compiled.spec.entry is not None and not compiled.admits(Ctx(w, args)):
            return
        yield from self._segment(w, thread, op, 0, args, start=True)

    def _continue(self, w: World, thread: int) -> Iterator[tuple[Label, World]]:
        op, seg, args = w.threads[thread]  # type: ignore[misc]
        yield from self._segment(w, thread, op, seg, args, start=False)

    def _segment(
        self, w: World, thread: int, op: str, seg: int, args: tuple[int, ...], *, start: bool
    ) -> Iterator[tuple[Label, World]]:
        """One action: segment ``seg`` of ``op``, run on in the same action
        through segments the model cannot observe (a wait on a monotone
        event, or only effects that are no-ops here): interleaving another
        thread before or after such a segment reaches the same states."""
        compiled = self.ops[op]
        segs = compiled.spec.segments
        c = Ctx(w, args)
        raised = ""
        last = seg
        try:
            while True:
                spec_seg = segs[last]
                if spec_seg.wait:
                    waited = self._waited(c, spec_seg.of or "")
                    if not all(self._event(c.tasks[t], spec_seg.wait) for t in waited):
                        return  # blocked: the thread waits
                    if spec_seg.raises:
                        guard = self.guards[spec_seg.raises]
                        hit = [t for t in waited if guard(with_tid(c, t))]
                        c.tid = args[4]
                        if hit:
                            raised = f" raises: {spec_seg.raises} (task {hit[0]})"
                            break
                else:
                    compiled.segments[last](c)
                if last + 1 == len(segs) or not self.invisible[op][last]:
                    break
                last += 1
        except ProtocolViolation as exc:
            v = Violation("protocol.required_move", str(exc))
            v.label = (op, seg, last, args, "")
            raise v from None
        except Violation as exc:
            exc.label = (op, seg, last, args, "")
            raise
        nxt = self._next(op, last, c, raised)
        threads = list(w.threads)
        threads[thread] = nxt
        out = c.freeze(tuple(threads))
        if start and not nxt and not raised and out == w._replace(threads=out.threads):
            return  # the operation changed nothing
        yield (op, seg, last, args, raised), out

    def _next(self, op: str, seg: int, c: Ctx, raised: str) -> Running:
        """Where the thread goes after this segment (its program)."""
        if raised:
            return ()
        if seg + 1 < len(self.ops[op].segments):
            return (op, seg + 1, c.args)
        # The committer's pipeline: a won claim goes on to the copy, the copy to the pool write.
        if op == "committer_claim" and ("task", "claim_copy") in c.fired:
            return ("committer_copy", 0, c.args)
        if op == "committer_copy":
            return ("committer_write", 0, c.args)
        return ()

    def _waited(self, c: Ctx, of: str) -> list[int]:
        if of == "task":
            return [c.tid]
        if of == "previous_immediate_writes":
            return [tid for tid, t in enumerate(c.tasks) if t.sched == IMM and 0 <= t.step < c.sid]
        raise Violation("model.outside", f"a wait of {of!r}: the model knows 'task' and 'previous_immediate_writes'")

    @staticmethod
    def _event(t: Task, event: str) -> bool:
        return bool(getattr(t, event))

    def canonical(self, w: World) -> World:
        """Forget what no later move or check can read, so equivalent
        states coincide: a drained terminal task keeps only its state,
        schedule, events and claims; finished reads go; a version no live
        read refers to reads as 0; the record lists are sets. And the
        committer, idle with both queues empty, is asleep (the runtime's
        committer waits once it finds no work: only a kick or its linger
        wakes it, a save's push does not)."""
        if w.awake and not w.hi and not w.lo and not w.threads[COMMITTER]:
            w = w._replace(awake=False)
        final, read_final = self.f.task_final, self.f.read_final
        tasks = w.tasks
        for t in tasks:
            if t.drained and t.slots and not t.owed and t.state in final:
                tasks = tuple(
                    rep(t, req=-1, slots=(), reassigned=(), pins=(), clone=False)
                    if t.drained and t.slots and not t.owed and t.state in final
                    else t
                    for t in tasks
                )
                break
        reads = w.reads
        for r in reads:
            if r.state in read_final:
                reads = tuple(r for r in reads if r.state not in read_final)
                break
        slots = w.slots
        for s in slots:
            if s.version:
                read_slots = {r.slot for r in reads}
                slots = tuple(
                    s if s.version == 0 or i in read_slots else rep(s, version=0) for i, s in enumerate(slots)
                )
                break
        steps = w.steps
        for st in steps:
            if st.freed and st.charged:
                steps = tuple(rep(st, charged=0) if st.freed else st for st in steps)
                break
        # A consumed step rejects nothing more: its cells and the stamps naming it are forgotten.
        done = {sid for sid, st in enumerate(steps) if st.state not in (self.f.UNSAVED, self.f.SAVED)}
        if done and any(steps[sid].cells for sid in done):
            steps = tuple(rep(st, cells=()) if sid in done else st for sid, st in enumerate(steps))
        if done and any(s.writer in done for s in slots):
            slots = tuple(rep(s, writer=-1) if s.writer in done else s for s in slots)
        completed, failed = w.completed, w.failed
        if len(completed) > 1:
            completed = tuple(sorted(completed))
        if len(failed) > 1:
            failed = tuple(sorted(failed))
        if (tasks, slots, completed, failed, reads, steps) == (
            w.tasks,
            w.slots,
            w.completed,
            w.failed,
            w.reads,
            w.steps,
        ):
            return w
        return w._replace(tasks=tasks, slots=slots, completed=completed, failed=failed, reads=reads, steps=steps)
