"""Bounded exhaustive check of the composed model (TLC-style).

The composed model is the write pipeline at small bounds: requests that
save steps, write tasks (immediate and deferred), slot occupancy, staging
pages and their holders, the single committer, and the engine's drain.
Every per-component move is taken from the compiled specs
(``write_task``, ``slot_occupancy``, ``staging_holder``, ``step_context``);
the composition rules come from the brief and the upstream controller:

- save waits for every earlier immediate write to be done (a failed one
  makes the join raise: the engine stops), claims a free page for its step,
  opens or appends writes and maps their slots (takeover records the old
  owner's rows as reassigned; reuse of a committed slot bumps its version
  and preserves a planned read's rows);
- the committer pops high priority first and claims under the same lock;
  it copies, then the pool write releases the task's holder, publishes the
  completion record, and only then sets ``done``;
- escalate (finish, abort, budget flush) moves PENDING to the head of the
  high queue or a low-queued task up; it never touches COPYING and later;
- a failure publishes its record before its wakes (deferred effects);
- drain commits (or drops, on failure) the occupancy of published writes;
- materialize / discard consume a step and release its page hold.

``check`` explores every reachable state breadth first, checks every
invariant in every state (and the per-move ones on every edge), then checks
that from every reachable state a settled state is still reachable (all
tasks terminal with their events set, every holder released, every slot at
rest). A violation is reported with a shortest trace from the initial state.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omni_prefix_cache.specs.compiled import CompiledMachine, CompiledMove, compile_machine
from omni_prefix_cache.specs.loader import MachineSpec, MoveSpec, load_spec
from omni_prefix_cache.testing.specfacts import states_after

IMM, DEF = 0, 1  # write schedules: JOIN_NEXT_STEP, JOIN_ON_FINISH
STEP, TASK = 0, 1  # holder kinds
IDLE, COPY, WRITE, PUBLISHED = 0, 1, 2, 3  # committer phases
_PHASE = {IDLE: "idle", COPY: "copying", WRITE: "pool write", PUBLISHED: "completion published"}


class Task(NamedTuple):
    state: int
    sched: int
    req: int
    step: int  # the step whose page an immediate write views; -1 if deferred
    host_ready: bool
    done: bool
    clones: int  # device clones (chunks) still charged to the GPU budget
    holder: int  # staging_holder state of the task's holder
    page: int  # page the holder holds, -1 if none
    slots: tuple[int, ...]
    reassigned: tuple[int, ...]
    claims: int  # successful copy claims
    drained: bool  # its record was drained by the engine
    owed: tuple[str, int] | tuple[()]  # (trigger, source) of a move whose deferred wakes are owed


_TASK_FIELD = {name: i for i, name in enumerate(Task._fields)}


class Step(NamedTuple):
    state: int
    page: int
    holder: int


class Slot(NamedTuple):
    state: int
    owner: int  # -1 when none
    version: int


class Read(NamedTuple):
    slot: int
    version: int
    preserved: bool


class World(NamedTuple):
    tasks: tuple[Task, ...]
    steps: tuple[Step, ...]
    slots: tuple[Slot, ...]
    pages: tuple[frozenset[tuple[int, int]], ...]
    hi: tuple[int, ...]
    lo: tuple[int, ...]
    live: tuple[bool, ...]
    committer: tuple[int, int]  # (phase, tid)
    completed: tuple[int, ...]
    failed: tuple[int, ...]
    staged: int
    fatal: bool
    reads: tuple[Read, ...]


@dataclass(frozen=True)
class Bounds:
    """Sizes of the explored world (defaults: the CI bound, about a minute).

    Untouched slots and requests without a write are interchangeable, so
    only the first of them is tried; ``slots`` beyond what ``steps`` saves
    can map add no states. ``failures`` bounds injected write failures.
    """

    requests: int = 2
    tasks: int = 2
    slots: int = 4
    pages: int = 2
    steps: int = 2
    reads: int = 1
    failures: int = 1

    def describe(self) -> str:
        return (
            f"{self.requests} requests, {self.tasks} tasks, {self.slots} slots, "
            f"{self.pages} staging pages, {self.steps} steps, {self.reads} planned reads, {self.failures} failures"
        )


CI_BOUNDS = Bounds()
# A bigger bound for a manual run (a few minutes): a third step, so a
# committed slot can be reused while an earlier step is still unconsumed.
BIG_BOUNDS = Bounds(requests=2, tasks=2, slots=4, pages=2, steps=3, reads=1, failures=1)

# Deliberately broken variants: name -> what is wrong.
BROKEN: dict[str, str] = {
    "escalate-requeues-copying": "escalate pushes a task the committer already claimed (COPYING) back on a queue",
    "done-before-publish": "the pool write sets done before it publishes the completion record",
    "fail-never-wakes": "a failure never runs its deferred wakes (host_ready / done stay unset)",
    "no-copy-on-write": "reusing a committed slot skips preserving the rows of a planned read",
    "spec-no-drop": "slot_occupancy spec without the drop move: a failed write's slots stay IN_TRANSIT",
}


def _holders(busy: frozenset[tuple[int, int]]) -> str:
    return ", ".join(f"{'step' if kind == STEP else 'task'} {ident}" for kind, ident in sorted(busy))


class Violation(Exception):
    """An invariant broken by a state or a move."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def _has_effect(effect: str, move: MoveSpec) -> bool:
    return effect in move.effects


class _Ctx:
    """Scratch world for one action, and what the spec handlers act on."""

    __slots__ = (
        *("tasks", "steps", "slots", "pages", "hi", "lo", "live", "committer"),
        *("completed", "failed", "staged", "fatal", "reads", "tid", "slot", "holder", "page"),
    )

    def __init__(self, w: World):
        self.tasks = list(w.tasks)
        self.steps = list(w.steps)
        self.slots = list(w.slots)
        self.pages = list(w.pages)
        self.hi = list(w.hi)
        self.lo = list(w.lo)
        self.live = list(w.live)
        self.committer = w.committer
        self.completed = list(w.completed)
        self.failed = list(w.failed)
        self.staged = w.staged
        self.fatal = w.fatal
        self.reads = list(w.reads)
        self.tid = -1
        self.slot = -1
        self.holder: tuple[int, int] = (STEP, -1)
        self.page = -1

    def freeze(self) -> World:
        return World(
            tuple(self.tasks),
            tuple(self.steps),
            tuple(self.slots),
            tuple(self.pages),
            tuple(self.hi),
            tuple(self.lo),
            tuple(self.live),
            self.committer,
            tuple(self.completed),
            tuple(self.failed),
            self.staged,
            self.fatal,
            tuple(self.reads),
        )

    def set_task(self, tid: int, **kw: Any) -> None:
        values = list(self.tasks[tid])
        for name, value in kw.items():
            values[_TASK_FIELD[name]] = value
        self.tasks[tid] = tuple.__new__(Task, values)


@dataclass
class CheckResult:
    """What ``check`` found."""

    bounds: Bounds
    broken: str | None
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    final_state: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        head = f"model check ({self.bounds.describe()})" + (f", broken variant {self.broken!r}" if self.broken else "")
        lines = [
            head,
            f"states explored: {self.states}, transitions: {self.transitions}, max depth: {self.depth}, "
            f"elapsed: {self.seconds:.1f}s",
        ]
        if self.ok:
            lines.append("OK: every invariant holds in every reachable state; every state can still settle")
            return "\n".join(lines)
        assert self.violation is not None
        lines.append(f"VIOLATION {self.violation.name}: {self.violation.message}")
        lines.append(f"shortest counterexample ({len(self.trace)} steps):")
        lines += [f"  {i}. {step}" for i, step in enumerate(self.trace, 1)]
        if self.final_state:
            lines.append("state reached:")
            lines += [f"    {line}" for line in self.final_state]
        return "\n".join(lines)


class ComposedModel:
    """The composed world's initial state, actions and invariants."""

    def __init__(self, bounds: Bounds, broken: str | None = None, specs: Mapping[str, MachineSpec] | None = None):
        """``specs`` replaces shipped specs by name (e.g. a mutant copy)."""
        if broken is not None and broken not in BROKEN:
            raise ValueError(f"unknown broken variant {broken!r}; known: {', '.join(BROKEN)}")
        self.bounds = bounds
        self.broken = broken
        # What a save may carry: nothing (leftover only), an immediate write,
        # a deferred write (PENDING), a deferred write submitted queued (low queue).
        self.save_kinds: tuple[str, ...] = ("none", "imm", "def", "defq")
        chosen = {name: load_spec(name) for name in ("write_task", "slot_occupancy", "staging_holder", "step_context")}
        chosen.update(specs or {})
        if broken == "spec-no-drop":
            from omni_prefix_cache.testing.mutants import without_move

            chosen["slot_occupancy"] = without_move(chosen["slot_occupancy"], "drop", "IN_TRANSIT")
        self.task_m = self._compile(chosen["write_task"])
        self.slot_m = self._compile(chosen["slot_occupancy"])
        self.holder_m = self._compile(chosen["staging_holder"])
        self.step_m = self._compile(chosen["step_context"])
        T, H, Occ, S = self.task_m.State, self.holder_m.State, self.slot_m.State, self.step_m.State
        self.T, self.H, self.Occ, self.S = T, H, Occ, S
        self.accepts = frozenset(int(s) for s in self.task_m.tagged("accepts_chunks"))
        self.task_final = frozenset(int(s) for s in self.task_m.final)
        spec = self.task_m.spec
        self.events = {
            name: tuple(
                frozenset(int(T[s]) for s in part) for part in states_after(spec, functools.partial(_has_effect, eff))
            )
            for name, eff in (("host_ready", "set_host_ready"), ("done", "set_done"))
        }
        self.claimed = frozenset(int(T[s]) for s in states_after(spec, lambda m: m.trigger == "claim_copy")[0])
        self.slot_rest = frozenset(int(Occ[s]) for s in self.slot_m.spec.settling_states())
        self.held = int(H["HELD"])
        self.released = int(H["RELEASED"])
        self.QUEUED, self.COPYING, self.FAILED = int(T["QUEUED"]), int(T["COPYING"]), int(T["FAILED"])
        self.SAVED = int(S["SAVED"])
        # Step triggers other than save: materialize / discard, by source state.
        self.consumers: dict[int, tuple[str, ...]] = {}
        for m in self.step_m.moves:
            if m.trigger != "save":
                self.consumers[int(m.source)] = (*self.consumers.get(int(m.source), ()), m.trigger)
        self.ABSENT, self.IN_TRANSIT, self.COMMITTED = int(Occ["ABSENT"]), int(Occ["IN_TRANSIT"]), int(Occ["COMMITTED"])

    # ----------------------------------------------------------- spec glue
    def _compile(self, spec: MachineSpec) -> CompiledMachine:
        handlers: dict[str, Callable[..., Any]] = {
            # write_task
            "drop_device_clone": self._drop_device_clone,
            "set_host_ready": lambda c: c.set_task(c.tid, host_ready=True),
            "set_done": lambda c: c.set_task(c.tid, done=True),
            # slot_occupancy
            "owned_by_writer": lambda c: c.slots[c.slot].owner == c.tid,
            "set_owner": lambda c: self._set_slot(c, owner=c.tid),
            "clear_owner": lambda c: self._set_slot(c, owner=-1),
            "reassign_from_old_owner": self._reassign_from_old_owner,
            "preserve_pending_reads": self._preserve_pending_reads,
            "bump_version": lambda c: self._set_slot(c, version=c.slots[c.slot].version + 1),
            # staging_holder
            "is_step_holder": lambda c: c.holder[0] == STEP,
            "is_task_holder": lambda c: c.holder[0] == TASK,
            "page_free": lambda c: not c.pages[c.page],
            "page_busy": lambda c: bool(c.pages[c.page]),
            "wake_claimers_if_free": lambda c: None,  # claimers here are enabled by a free page
            # step_context
            "release_step_holder": self._release_step_holder,
        }
        guards = {g: handlers[g] for g in spec.guard_names}
        effects = {e: handlers[e] for e in spec.effect_names}
        return compile_machine(spec, guards=guards, effects=effects)

    @staticmethod
    def _set_slot(c: _Ctx, **kw: Any) -> None:
        c.slots[c.slot] = c.slots[c.slot]._replace(**kw)

    @staticmethod
    def _drop_device_clone(c: _Ctx) -> None:
        task = c.tasks[c.tid]
        c.staged -= task.clones
        c.set_task(c.tid, clones=0)

    @staticmethod
    def _reassign_from_old_owner(c: _Ctx) -> None:
        old = c.slots[c.slot].owner
        if old >= 0 and old != c.tid:
            prev = c.tasks[old].reassigned
            c.set_task(old, reassigned=tuple(sorted({*prev, c.slot})))

    def _preserve_pending_reads(self, c: _Ctx) -> None:
        if self.broken == "no-copy-on-write":
            return
        version = c.slots[c.slot].version
        c.reads = [r._replace(preserved=True) if r.slot == c.slot and r.version == version else r for r in c.reads]

    def _release_step_holder(self, c: _Ctx) -> None:
        step = c.steps[c.tid]
        self._holder(c, (STEP, c.tid), "consume", step.page)

    def _fire(self, machine: CompiledMachine, state: int, trigger: str, c: _Ctx, what: str) -> CompiledMove | None:
        """The spec's move for ``trigger`` from ``state`` if its guards pass;
        None if a guard refuses. An undeclared move is a violation."""
        move = machine.move(state, trigger)
        if move is None:
            raise Violation(
                f"{machine.spec.name}.declared_moves",
                f"{what}: {trigger} from {machine.State(state).name} is not declared",
            )
        if not all(g(c) for g in move.guards):
            return None
        return move

    def _task_move(self, c: _Ctx, tid: int, trigger: str, *, defer: bool = False) -> None:
        c.tid = tid
        move = self._fire(self.task_m, c.tasks[tid].state, trigger, c, f"task {tid}")
        assert move is not None  # write_task has no guards
        c.set_task(tid, state=int(move.dest))
        for effect in move.undeferrable if defer else move.effects:
            effect(c)
        if defer and move.deferrable:
            c.set_task(tid, owed=(trigger, int(move.source)))

    def _slot_move(self, c: _Ctx, slot: int, trigger: str, writer: int) -> bool:
        c.slot, c.tid = slot, writer
        move = self._fire(self.slot_m, c.slots[slot].state, trigger, c, f"slot {slot}")
        if move is None:
            return False
        self._set_slot(c, state=int(move.dest))
        for effect in move.effects:
            effect(c)
        return True

    def _holder_state(self, c: _Ctx, holder: tuple[int, int]) -> int:
        kind, ident = holder
        return c.steps[ident].holder if kind == STEP else c.tasks[ident].holder

    def _holder(self, c: _Ctx, holder: tuple[int, int], trigger: str, page: int) -> bool:
        """Fire a staging_holder move; keeps the page's holder set in step."""
        c.holder, c.page = holder, page
        state = self._holder_state(c, holder)
        move = self._fire(self.holder_m, state, trigger, c, f"holder {holder}")
        if move is None:
            return False
        kind, ident = holder
        dest = int(move.dest)
        if dest == self.held:
            c.pages[page] = c.pages[page] | {holder}
        else:
            c.pages[page] = c.pages[page] - {holder}
        new_page = page if dest == self.held else -1
        if kind == STEP:
            c.steps[ident] = Step(c.steps[ident].state, new_page, dest)
        else:
            c.set_task(ident, holder=dest, page=new_page)
        c.holder, c.page = holder, page
        for effect in move.effects:
            effect(c)
        return True

    # ------------------------------------------------------------- world
    @property
    def fresh_slot(self) -> Slot:
        return Slot(int(self.slot_m.initial), -1, 0)

    def initial(self) -> World:
        b = self.bounds
        return World(
            tasks=(),
            steps=(),
            slots=tuple(self.fresh_slot for _ in range(b.slots)),
            pages=tuple(frozenset() for _ in range(b.pages)),
            hi=(),
            lo=(),
            live=tuple(True for _ in range(b.requests)),
            committer=(IDLE, -1),
            completed=(),
            failed=(),
            staged=0,
            fatal=False,
            reads=(),
        )

    def unsettled(self, w: World) -> list[str]:
        """Why ``w`` is not settled (empty when it is)."""
        why = [
            f"task {tid} is {self.T(t.state).name}" + (" and owes its wakes" if t.owed else "")
            for tid, t in enumerate(w.tasks)
            if t.state not in self.task_final or t.owed
        ]
        why += [f"page {p} is held by {_holders(busy)}" for p, busy in enumerate(w.pages) if busy]
        why += [f"slot {i} is {self.Occ(s.state).name}" for i, s in enumerate(w.slots) if s.state not in self.slot_rest]
        if w.committer[0] != IDLE:
            why.append(f"the committer is busy with task {w.committer[1]}")
        return why

    def settled(self, w: World) -> bool:
        """All tasks terminal with their events set, no page held, every
        slot at rest, the committer idle."""
        return (
            all(t.state in self.task_final and not t.owed for t in w.tasks)
            and not any(w.pages)
            and all(s.state in self.slot_rest for s in w.slots)
            and w.committer[0] == IDLE
        )

    # ----------------------------------------------------------- actions
    def successors(self, w: World) -> Iterator[tuple[tuple[Any, ...], World]]:
        """``(label, next world)`` for every enabled action. Raises
        Violation (with the label in ``.label``) for a broken move."""
        b = self.bounds
        if not w.fatal and len(w.steps) < b.steps:
            yield from self._saves(w)
        for r in self._distinct_requests(w):
            yield self._act(w, ("finish", r), self._finish)
        # Budget flush escalates the oldest unfinished write (upstream: the
        # non-terminal task with the oldest enqueue time).
        oldest = next((tid for tid, t in enumerate(w.tasks) if t.state not in self.task_final), None)
        if oldest is not None:
            yield self._act(w, ("escalate", oldest), self._escalate)
        can_fail = sum(t.state == self.FAILED for t in w.tasks) < b.failures
        yield from self._committer(w, can_fail)
        for tid, task in enumerate(w.tasks):
            if can_fail and task.state not in self.task_final and w.committer[1] != tid:
                yield self._act(w, ("fail", tid), self._fail)
            if task.owed and self.broken != "fail-never-wakes":
                yield self._act(w, ("wake", tid), self._wake)
        if w.completed or w.failed:
            yield self._act(w, ("drain",), self._drain)
        for sid, step in enumerate(w.steps):
            for trigger in self.consumers.get(step.state, ()):
                yield self._act(w, (trigger, sid), self._consume)
        if len(w.reads) < b.reads:
            for slot, s in enumerate(w.slots):
                if s.state == self.COMMITTED and all(r.slot != slot for r in w.reads):
                    yield self._act(w, ("plan_read", slot), self._plan_read)
        for i in range(len(w.reads)):
            yield self._act(w, ("fetch_read", i), self._fetch_read)

    def _act(self, w: World, label: tuple[Any, ...], fn: Callable[[_Ctx, tuple[Any, ...]], None]) -> tuple[Any, World]:
        c = _Ctx(w)
        try:
            fn(c, label)
        except Violation as exc:
            exc.label = label  # type: ignore[attr-defined]
            raise
        return label, c.freeze()

    # save ----------------------------------------------------------------
    def _saves(self, w: World) -> Iterator[tuple[tuple[Any, ...], World]]:
        # join: every earlier immediate write must be done.
        waits = [tid for tid, t in enumerate(w.tasks) if t.sched == IMM and not t.done]
        if waits:
            return
        failed = [tid for tid, t in enumerate(w.tasks) if t.sched == IMM and t.state == self.FAILED]
        if failed:
            yield self._act(w, ("save_join_raises", failed[0]), self._join_raises)
            return
        if not any(not p for p in w.pages):
            return  # the claim waits for a free page
        requests = self._distinct_requests(w)
        slots = self._distinct_slots(w)
        options: list[tuple[Any, ...]] = [("save", r, "none", -1) for r in requests if "none" in self.save_kinds]
        for r in requests:
            for kind in self.save_kinds:
                if kind != "none":
                    options.extend(("save", r, kind, slot) for slot in slots)
        for label in options:
            out = self._try_save(w, label)
            if out is not None:
                yield out

    def _distinct_requests(self, w: World) -> list[int]:
        """Live requests, fresh ones (no write yet) collapsed to the first:
        fresh requests are interchangeable (symmetry reduction)."""
        used = {t.req for t in w.tasks}
        out = [r for r, live in enumerate(w.live) if live and r in used]
        fresh = next((r for r, live in enumerate(w.live) if live and r not in used), None)
        return out if fresh is None else sorted([*out, fresh])

    def _distinct_slots(self, w: World) -> list[int]:
        """Slots in use (referenced by a write or a read, or not in their
        initial state), plus the first untouched one: untouched slots are
        interchangeable (symmetry reduction)."""
        used = {s for t in w.tasks for s in t.slots} | {r.slot for r in w.reads}
        used |= {i for i, s in enumerate(w.slots) if s != self.fresh_slot}
        out = sorted(used)
        fresh = next((i for i in range(len(w.slots)) if i not in used), None)
        return out if fresh is None else sorted([*out, fresh])

    def canonical(self, w: World) -> World:
        """Forget what no later move or check can read, so equivalent
        states coincide: a drained terminal task keeps only its state,
        schedule, events and claims; a version no planned read refers to
        reads as 0; the record lists are sets."""
        final = self.task_final
        tasks = w.tasks
        for t in tasks:
            if t.drained and t.slots and not t.owed and t.state in final:
                tasks = tuple(
                    Task(
                        t.state, t.sched, -1, -1, t.host_ready, t.done, 0, self.released, -1, (), (), t.claims, True, ()
                    )
                    if t.drained and t.slots and not t.owed and t.state in final
                    else t
                    for t in tasks
                )
                break
        slots = w.slots
        for s in slots:
            if s.version:
                read_slots = {r.slot for r in w.reads}
                slots = tuple(
                    s if s.version == 0 or i in read_slots else Slot(s.state, s.owner, 0) for i, s in enumerate(slots)
                )
                break
        completed, failed = w.completed, w.failed
        if len(completed) > 1:
            completed = tuple(sorted(completed))
        if len(failed) > 1:
            failed = tuple(sorted(failed))
        if tasks is w.tasks and slots is w.slots and completed is w.completed and failed is w.failed:
            return w
        return w._replace(tasks=tasks, slots=slots, completed=completed, failed=failed)

    def _join_raises(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        c.fatal = True

    def _try_save(self, w: World, label: tuple[Any, ...]) -> tuple[Any, World] | None:
        _, r, kind, slot = label
        c = _Ctx(w)
        append_to = -1
        if kind == "def":
            for tid, t in enumerate(c.tasks):
                if t.req == r and t.sched == DEF and t.state in self.accepts and slot not in t.reassigned:
                    append_to = tid
        if kind != "none" and append_to < 0 and len(c.tasks) >= self.bounds.tasks:
            return None
        try:
            sid = len(c.steps)
            c.steps.append(Step(int(self.step_m.initial), -1, int(self.holder_m.initial)))
            c.tid = sid
            move = self._fire(self.step_m, c.steps[sid].state, "save", c, f"step {sid}")
            assert move is not None
            c.steps[sid] = c.steps[sid]._replace(state=int(move.dest))
            page = next(p for p, busy in enumerate(c.pages) if not busy)
            if not self._holder(c, (STEP, sid), "claim", page):
                raise Violation("staging_holder.claim", f"step {sid} could not claim free page {page}")
            if kind == "none":
                return label, c.freeze()
            if append_to >= 0:
                tid = append_to
                t = c.tasks[tid]
                if t.state not in self.accepts:
                    raise Violation("write_task.append_only_before_copy", f"append to task {tid} in {t.state}")
                c.set_task(tid, slots=tuple(sorted({*t.slots, slot})), clones=t.clones + 1)
                c.staged += 1
            else:
                tid = len(c.tasks)
                c.tasks.append(
                    Task(
                        state=int(self.task_m.initial),
                        sched=IMM if kind == "imm" else DEF,
                        req=r,
                        step=sid if kind == "imm" else -1,
                        host_ready=False,
                        done=False,
                        clones=1,
                        holder=int(self.holder_m.initial),
                        page=-1,
                        slots=(slot,),
                        reassigned=(),
                        claims=0,
                        drained=False,
                        owed=(),
                    )
                )
                c.staged += 1
                if kind in ("imm", "defq"):
                    self._task_move(c, tid, "enqueue")
                    (c.hi if kind == "imm" else c.lo).append(tid)
                if kind == "imm" and not self._holder(c, (TASK, tid), "bind", page):
                    raise Violation("staging_holder.bind", f"task {tid} could not bind page {page}")
            self._slot_move(c, slot, "map", tid)
        except Violation as exc:
            exc.label = label  # type: ignore[attr-defined]
            raise
        return label, c.freeze()

    # escalate / finish ------------------------------------------------------
    def _escalate_one(self, c: _Ctx, tid: int) -> None:
        t = c.tasks[tid]
        if self.task_m.move(t.state, "enqueue") is not None:
            self._task_move(c, tid, "enqueue")
            c.hi.insert(0, tid)
        elif t.state == self.QUEUED and tid in c.lo:
            c.lo.remove(tid)
            c.hi.insert(0, tid)
        elif self.broken == "escalate-requeues-copying" and t.state == self.COPYING and tid not in c.hi:
            c.hi.insert(0, tid)

    def _escalate(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        self._escalate_one(c, label[1])

    def _finish(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        r = label[1]
        c.live[r] = False
        for tid, t in enumerate(c.tasks):
            if t.req == r and not t.drained:
                self._escalate_one(c, tid)

    # committer ---------------------------------------------------------------
    def _committer(self, w: World, can_fail: bool) -> Iterator[tuple[tuple[Any, ...], World]]:
        phase, tid = w.committer
        if phase == IDLE:
            if w.hi or w.lo:
                yield self._act(w, ("claim",), self._claim)
            return
        if phase == COPY:
            yield self._act(w, ("copy", tid), self._copy)
            if can_fail:
                yield self._act(w, ("copy_fails", tid), self._committer_fail)
        elif phase == WRITE:
            yield self._act(w, ("pool_write", tid), self._pool_write)
            if can_fail:
                yield self._act(w, ("pool_write_fails", tid), self._committer_fail)
        elif phase == PUBLISHED:
            yield self._act(w, ("mark_done", tid), self._mark_done)

    def _claim(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        tid = c.hi.pop(0) if c.hi else c.lo.pop(0)
        t = c.tasks[tid]
        if t.state in self.task_final:
            c.committer = (IDLE, -1)  # a failed task left on a queue: popped and skipped
            return
        self._task_move(c, tid, "claim_copy")
        c.set_task(tid, claims=c.tasks[tid].claims + 1)
        c.committer = (COPY, tid)

    def _copy(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        tid = label[1]
        self._task_move(c, tid, "host_ready")
        c.committer = (WRITE, tid)

    def _pool_write(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        tid = label[1]
        t = c.tasks[tid]
        if t.holder == self.held:
            self._holder(c, (TASK, tid), "written", t.page)
        if self.broken == "done-before-publish":
            self._task_move(c, tid, "written")
            c.committer = (PUBLISHED, tid)
            return
        c.completed.append(tid)
        c.committer = (PUBLISHED, tid)

    def _mark_done(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        tid = label[1]
        if self.broken == "done-before-publish":
            c.completed.append(tid)
        else:
            self._task_move(c, tid, "written")
        c.committer = (IDLE, -1)

    def _committer_fail(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        self._fail_task(c, label[1])
        c.committer = (IDLE, -1)

    # failure -------------------------------------------------------------------
    def _fail_task(self, c: _Ctx, tid: int) -> None:
        """FAILED with the wakes deferred; release the holder; publish."""
        self._task_move(c, tid, "fail", defer=True)
        t = c.tasks[tid]
        if t.holder == self.held:
            self._holder(c, (TASK, tid), "fail", t.page)
        c.failed.append(tid)

    def _fail(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        self._fail_task(c, label[1])

    def _wake(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        tid = label[1]
        trigger, source = c.tasks[tid].owed
        move = self.task_m.move(source, trigger)
        assert move is not None
        c.tid = tid
        for effect in move.deferrable:
            effect(c)
        c.set_task(tid, owed=())

    # drain / consume / reads -------------------------------------------------
    def _settle_slots(self, c: _Ctx, tid: int, trigger: str) -> None:
        """Commit (or drop) the slots of a drained write; the spec's
        owned_by_writer guard leaves taken-over slots with their new owner."""
        t = c.tasks[tid]
        for slot in t.slots:
            if c.slots[slot].state == self.IN_TRANSIT:
                self._slot_move(c, slot, trigger, tid)
            elif slot not in t.reassigned:
                raise Violation(
                    "slot_occupancy.owner_iff_in_transit",
                    f"drain of task {tid}: its slot {slot} is {self.Occ(c.slots[slot].state).name}, not IN_TRANSIT",
                )
        c.set_task(tid, drained=True)

    def _drain(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        for tid in c.completed:
            self._settle_slots(c, tid, "commit")
        for tid in c.failed:
            self._settle_slots(c, tid, "drop")
        if c.failed:
            c.fatal = True
        c.completed, c.failed = [], []

    def _consume(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        trigger, sid = label
        c.tid = sid
        move = self._fire(self.step_m, c.steps[sid].state, trigger, c, f"step {sid}")
        assert move is not None
        c.steps[sid] = c.steps[sid]._replace(state=int(move.dest))
        for effect in move.effects:
            c.tid = sid
            effect(c)

    def _plan_read(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        slot = label[1]
        c.reads.append(Read(slot, c.slots[slot].version, False))

    def _fetch_read(self, c: _Ctx, label: tuple[Any, ...]) -> None:
        c.reads.pop(label[1])

    # -------------------------------------------------------- invariants
    def check_state(self, w: World) -> None:
        """Raise Violation for the first invariant ``w`` breaks."""
        T = self.T
        queued = [*w.hi, *w.lo]
        if len(set(queued)) != len(queued):
            raise Violation("composed.one_queue_entry", f"a task is queued twice: hi={w.hi} lo={w.lo}")
        for tid in queued:
            state = w.tasks[tid].state
            if state != int(T["QUEUED"]) and state != int(T["FAILED"]):
                raise Violation("composed.queued_not_claimed", f"task {tid} is on a copy queue while {T(state).name}")
        phase, cur = w.committer
        for tid, t in enumerate(w.tasks):
            name = T(t.state).name
            if t.state == int(T["QUEUED"]) and tid not in queued:
                raise Violation("composed.queued_is_on_a_queue", f"task {tid} is QUEUED but on no queue")
            for event, (always, sometimes) in self.events.items():
                is_set = getattr(t, event)
                if t.owed:
                    continue
                if (t.state in always and not is_set) or (t.state not in sometimes and is_set):
                    raise Violation("write_task.events_match_state", f"task {tid} in {name} has {event}={is_set}")
            if t.claims > 1 or (t.state in self.claimed and t.claims != 1):
                raise Violation("write_task.single_copy_claim", f"task {tid} in {name} has {t.claims} copy claims")
            if t.done and not t.owed and tid not in w.completed and tid not in w.failed and not t.drained:
                raise Violation(
                    "composed.done_after_record", f"task {tid} is done but no completion/failure record is public"
                )
            if t.clones and t.state not in self.accepts and t.state != int(T["COPYING"]):
                raise Violation("composed.staged_bytes", f"task {tid} in {name} still charges {t.clones} device clones")
            if t.holder == self.held:
                if t.state in self.task_final:
                    raise Violation(
                        "staging_holder.task_holder_has_live_task", f"task {tid} is {name} and holds a page"
                    )
                step = w.steps[t.step]
                if step.holder == self.held and t.page != step.page:
                    raise Violation(
                        "composed.task_views_step_page",
                        f"task {tid} holds page {t.page}, its step {t.step} page {step.page}",
                    )
        if phase != IDLE and w.tasks[cur].state not in self.claimed and w.tasks[cur].state not in self.task_final:
            raise Violation(
                "write_task.single_copy_claim",
                f"the committer works on task {cur}, which is {T(w.tasks[cur].state).name}",
            )
        if w.staged != sum(t.clones for t in w.tasks) or w.staged < 0:
            raise Violation("composed.staged_bytes", f"staged counter {w.staged} != clones held")
        in_transit = self.IN_TRANSIT
        for slot, s in enumerate(w.slots):
            if (s.owner >= 0) != (s.state == in_transit):
                raise Violation(
                    "slot_occupancy.owner_iff_in_transit", f"slot {slot} is {self.Occ(s.state).name}, owner {s.owner}"
                )
            if s.owner >= 0:
                owner = w.tasks[s.owner]
                if owner.drained or slot in owner.reassigned:
                    raise Violation(
                        "slot_occupancy.owner_is_live_task",
                        f"slot {slot} is owned by task {s.owner}, drained or reassigned",
                    )
        held: list[set[tuple[int, int]]] = [set() for _ in w.pages]
        for sid, st in enumerate(w.steps):
            saved = st.state == self.SAVED
            if saved != (st.holder == self.held):
                raise Violation(
                    "step_context.one_holder_per_saved_step",
                    f"step {sid} is {self.S(st.state).name} with holder {self.H(st.holder).name}",
                )
            if st.holder == self.held:
                held[st.page].add((STEP, sid))
        for tid, t in enumerate(w.tasks):
            if t.holder == self.held:
                held[t.page].add((TASK, tid))
        for p, busy in enumerate(w.pages):
            if set(busy) != held[p]:
                raise Violation(
                    "staging_holder.free_iff_no_holder", f"page {p} busy set {sorted(busy)}, holders {sorted(held[p])}"
                )
            if sum(1 for k, _ in busy if k == STEP) > 1:
                raise Violation("staging_holder.one_step_holder_per_page", f"page {p} has two step holders")
        for r in w.reads:
            if w.slots[r.slot].version != r.version and not r.preserved:
                raise Violation(
                    "composed.copy_on_write",
                    f"a planned read of slot {r.slot} (version {r.version}) lost its rows: the slot is now version "
                    f"{w.slots[r.slot].version} and nothing was preserved",
                )

    def check_move(self, before: World, after: World) -> None:
        """Per-move invariants: versions only grow, by one per reuse."""
        for slot, (a, b) in enumerate(zip(before.slots, after.slots, strict=True)):
            if a is b:
                continue
            if b.version < a.version or b.version > a.version + 1:
                raise Violation("slot_occupancy.version_monotonic", f"slot {slot} version {a.version} -> {b.version}")
            if b.version == a.version + 1 and a.state != self.COMMITTED:
                raise Violation("slot_occupancy.version_monotonic", f"slot {slot} bumped from {self.Occ(a.state).name}")

    # ------------------------------------------------------------ printing
    def describe_label(self, label: tuple[Any, ...]) -> str:
        kind = label[0]
        if kind == "save":
            _, r, what, slot = label
            text = {
                "none": "with no cached rows (leftover only)",
                "imm": f"with an immediate write of slot {slot}",
                "def": f"with a deferred write of slot {slot}",
                "defq": f"with a deferred write of slot {slot}, submitted queued (low priority)",
            }[what]
            return f"engine: save a step for request r{r} {text}"
        return {
            "save_join_raises": "engine: save joins the earlier immediate writes; task {} failed, the join raises",
            "finish": "engine: request r{} finishes (its writes are escalated)",
            "escalate": "escalate task {} (budget flush / abort)",
            "fail": "task {} fails (dispatch failure)",
            "wake": "the failure's deferred wakes run for task {}",
            "drain": "engine: drain published completions and failures",
            "materialize": "materialize step {}",
            "discard": "discard step {}",
            "plan_read": "a reader plans a delayed read of committed slot {}",
            "fetch_read": "the planned read #{} is fetched",
            "claim": "committer: pop the next task (high priority first) and claim its copy",
            "copy": "committer: task {} copy landed on the host",
            "copy_fails": "committer: the copy of task {} fails",
            "pool_write": "committer: pool write of task {} (release its page hold, publish completion)",
            "pool_write_fails": "committer: the pool write of task {} fails",
            "mark_done": "committer: mark task {} written (done)",
        }[kind].format(*label[1:])

    def describe_change(self, a: World, b: World) -> str:
        T, Occ, H, S = self.T, self.Occ, self.H, self.S
        parts: list[str] = []
        for tid, t in enumerate(b.tasks):
            if tid >= len(a.tasks):
                parts.append(f"task {tid} {'imm' if t.sched == IMM else 'def'} {T(t.state).name}")
                continue
            o = a.tasks[tid]
            if o.state != t.state:
                parts.append(f"task {tid} {T(o.state).name}->{T(t.state).name}")
            if o.holder != t.holder:
                parts.append(f"task {tid} holder {H(o.holder).name}->{H(t.holder).name}")
            if o.reassigned != t.reassigned:
                parts.append(f"task {tid} reassigned {list(t.reassigned)}")
            if (o.host_ready, o.done) != (t.host_ready, t.done):
                parts.append(f"task {tid} events host_ready={t.host_ready} done={t.done}")
        for sid, step in enumerate(b.steps):
            was = a.steps[sid] if sid < len(a.steps) else None
            if was is None or was.state != step.state:
                parts.append(f"step {sid} {S(step.state).name} (page {step.page})")
        for slot, cell in enumerate(b.slots):
            if a.slots[slot] != cell:
                owner = f" owner task {cell.owner}" if cell.owner >= 0 else ""
                parts.append(f"slot {slot} {Occ(cell.state).name}{owner} v{cell.version}")
        if (a.hi, a.lo) != (b.hi, b.lo):
            parts.append(f"queues hi={list(b.hi)} lo={list(b.lo)}")
        if a.committer != b.committer:
            phase, tid = b.committer
            parts.append(f"committer {_PHASE[phase]}" + (f" task {tid}" if tid >= 0 else ""))
        if a.completed != b.completed or a.failed != b.failed:
            parts.append(f"records completed={list(b.completed)} failed={list(b.failed)}")
        if a.fatal != b.fatal and b.fatal:
            parts.append("engine stopped (write failed)")
        if a.reads != b.reads:
            parts.append(f"reads {[tuple(r) for r in b.reads]}")
        return "; ".join(parts) or "no change"

    def describe_world(self, w: World) -> list[str]:
        T, H = self.T, self.H
        lines = [
            f"task {tid}: {T(t.state).name} ({'immediate' if t.sched == IMM else 'deferred'}, r{t.req}) "
            f"host_ready={t.host_ready} done={t.done} holder={H(t.holder).name} slots={list(t.slots)}"
            + (f" reassigned={list(t.reassigned)}" if t.reassigned else "")
            + (" wakes owed" if t.owed else "")
            for tid, t in enumerate(w.tasks)
        ]
        lines.append(f"queues hi={list(w.hi)} lo={list(w.lo)}; committer {_PHASE[w.committer[0]]} {w.committer[1]}")
        lines.append("pages " + ", ".join(f"{p}: [{_holders(h)}]" for p, h in enumerate(w.pages)))
        lines.append(
            "slots " + ", ".join(f"{i}: {self.Occ(s.state).name}/{s.owner}/v{s.version}" for i, s in enumerate(w.slots))
        )
        return lines


def check(
    bounds: Bounds | None = None,
    broken: str | None = None,
    *,
    specs: Mapping[str, MachineSpec] | None = None,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> CheckResult:
    """Breadth-first over every reachable state of the composed model.

    Stops at the first (hence shallowest) invariant violation. With none,
    checks that every reachable state can still reach a settled state
    (reverse reachability over the explored graph) and reports the
    shallowest one that cannot. ``max_states`` aborts a run that grows past
    it (ValueError). ``progress(expanded, found, depth)`` is called every
    1,000 expanded states.
    """
    bounds = bounds or Bounds()
    model = ComposedModel(bounds, broken, specs)
    result = CheckResult(bounds=bounds, broken=broken)
    start = time.perf_counter()
    init = model.initial()
    index: dict[World, int] = {init: 0}
    worlds: list[World] = [init]
    parent: list[int] = [-1]
    via: list[Any] = [None]
    depth: list[int] = [0]
    succ: list[list[int]] = []
    transitions = 0

    def trace_to(i: int) -> list[str]:
        path = []
        while parent[i] >= 0:
            path.append(i)
            i = parent[i]
        steps = []
        for j in reversed(path):
            change = model.describe_change(worlds[parent[j]], worlds[j])
            steps.append(f"{model.describe_label(via[j])}  =>  {change}")
        return steps

    def fail(i: int, exc: Violation, label: Any = None) -> CheckResult:
        result.violation = exc
        result.trace = trace_to(i)
        if label is not None:
            result.trace.append(f"{model.describe_label(label)}  =>  breaks {exc.name}")
        result.final_state = model.describe_world(worlds[i])
        result.states, result.transitions = len(worlds), transitions
        result.depth = max(depth)
        result.seconds = time.perf_counter() - start
        return result

    try:
        model.check_state(init)
    except Violation as exc:
        return fail(0, exc)
    queue = deque([0])
    while queue:
        i = queue.popleft()
        if progress is not None and i % 1000 == 0:
            progress(i, len(worlds), depth[i])
        w = worlds[i]
        out: list[int] = []
        try:
            for label, raw in model.successors(w):
                transitions += 1
                model.check_move(w, raw)
                nxt = model.canonical(raw)
                j = index.get(nxt)
                if j is None:
                    j = len(worlds)
                    index[nxt] = j
                    worlds.append(nxt)
                    parent.append(i)
                    via.append(label)
                    depth.append(depth[i] + 1)
                    try:
                        model.check_state(nxt)
                    except Violation as exc:
                        return fail(j, exc)
                    queue.append(j)
                    if max_states is not None and len(worlds) > max_states:
                        raise ValueError(f"more than {max_states} states; lower the bounds")
                out.append(j)
        except Violation as exc:
            return fail(i, exc, getattr(exc, "label", None))
        succ.append(out)
    # Liveness: every state must still reach a settled one.
    pred: list[list[int]] = [[] for _ in worlds]
    for i, outs in enumerate(succ):
        for j in outs:
            pred[j].append(i)
    can = bytearray(len(worlds))
    todo = deque(i for i, w in enumerate(worlds) if model.settled(w))
    for i in todo:
        can[i] = 1
    while todo:
        for k in pred[todo.popleft()]:
            if not can[k]:
                can[k] = 1
                todo.append(k)
    stuck = [i for i in range(len(worlds)) if not can[i]]
    result.states, result.transitions = len(worlds), transitions
    result.depth = max(depth)
    if stuck:
        worst = min(stuck, key=lambda i: depth[i])
        reason = "no sequence of actions from the state reached settles it"
        if not succ[worst]:
            reason = "deadlock: no action is enabled in the state reached"
        why = "; ".join(model.unsettled(worlds[worst]))
        fail(worst, Violation("composed.can_settle", f"{reason} (unsettled there: {why})"))
    result.seconds = time.perf_counter() - start
    return result
