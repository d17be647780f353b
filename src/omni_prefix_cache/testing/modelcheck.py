"""Bounded exhaustive check of the composition spec (TLC-style).

The model interprets ``spec/protocol.yaml``: its actions are the protocol's
operations, compiled with ``specs.protocol.compile_protocol`` against this
module's ``Binding`` (``ComposedModel.move`` / ``coupling``), whose
component moves come from the compiled machines (``write_task``,
``copy_queue``, ``staging_holder``, ``step_context``, ``slot_occupancy``,
``planned_read``) and whose effect and guard handlers act on the model's
world. Each segment of an operation is one atomic action; an operation in
progress is part of the world (which segment each thread is at), so other
threads interleave only between segments. A segment the model cannot
observe (a wait on a monotone event, or only effects that are no-ops here)
runs on into the next one in the same action. No action moves a component
except through a compiled operation.

What the model chooses itself is the environment: which operation a thread
starts, for which request, task, step, slot or key, which save kind
(immediate, deferred, deferred submitted queued; which mm keys it writes),
where something fails (the committer's copy or pool write, a failure on
another thread, a save after its claim: ``abandon_save``), and the bounds.
The threads: the engine (new_step, save, escalate of any unfinished task,
drain, discard), a reader (lagged materialize), the committer (claim ->
copy -> write, high queue first) and a failing thread. Left out: eager
dispatch and budget flushes (``eager`` and ``over_budget`` are false; the
flush's escalate is covered by escalate), shutdown, joins by readers, a
read of an in-transit slot (reads plan committed cells) and hits on the
step's own writes (``replan_same_step_hits`` is a no-op).

The system invariants are the protocol's ``invariants_for("model")``, each
bound to one checker here by name; a name without a checker, or a checker
without a name, refuses to build the model. The machines' own invariants
are checked too. ``can_settle`` is liveness: every reachable state can
still reach a settled one. Broken variants (``BROKEN``) are spec mutations:
patches of the loaded protocol and/or component machines, or a whole
protocol file. A violation is reported with a shortest trace from the
initial state in operation-level steps (``escalate(task 0)``,
``committer_write[2](task 1)``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omni_prefix_cache.specs.compiled import CompiledMachine, compile_machine
from omni_prefix_cache.specs.composition import (
    CompiledOperation,
    Fire,
    ProtocolSpec,
    ProtocolViolation,
    compile_protocol,
)
from omni_prefix_cache.specs.loader import MachineSpec, MoveSpec, SpecError
from omni_prefix_cache.testing.model_mutations import BROKEN as BROKEN  # re-exported: the catalogue
from omni_prefix_cache.testing.model_mutations import Mutation as Mutation
from omni_prefix_cache.testing.model_mutations import load_variant
from omni_prefix_cache.testing.specfacts import states_after

IMM, DEF, DEFQ = 0, 1, 2  # save kinds: immediate, deferred, deferred submitted queued
_KIND = {IMM: "imm", DEF: "def", DEFQ: "def queued"}
STEP, TASK = 0, 1  # holder kinds
ENGINE, READER, COMMITTER, FAILER = 0, 1, 2, 3  # threads
_THREAD = ("engine", "reader", "committer", "failing thread")


class Task(NamedTuple):
    state: int  # write_task
    position: int  # copy_queue
    holder: int  # staging_holder of the task (an immediate write's view of its step's page)
    page: int  # page the holder holds, -1 if none
    sched: int  # IMM or DEF (a DEFQ save registers a DEF write)
    req: int
    step: int  # the step whose page an immediate write views; -1 if deferred
    host_ready: bool
    done: bool
    owed: tuple[str, int] | tuple[()]  # (trigger, source) of a move whose deferrable effects are owed
    clone: bool  # still holds its device clones
    pins: tuple[int, ...]  # steps whose budget tickets it pins
    slots: tuple[int, ...]
    reassigned: tuple[int, ...]
    claims: int  # successful copy claims
    drained: bool  # its record was drained by the engine


class Step(NamedTuple):
    state: int  # step_context
    holder: int  # staging_holder of the step
    page: int
    charged: int  # budget ticket: bytes charged (0 or 1 unit)
    tids: tuple[int, ...]  # tasks pinning the ticket
    freed: bool  # the ticket uncharged


class Slot(NamedTuple):
    """One (slot, key) cell: index ``slot * keys + key`` in ``World.slots``."""

    state: int  # slot_occupancy
    owner: int  # -1 when none
    version: int
    stale: bool  # holds rows of a previous tenant of the slot (tenant_owns_all_keys)


class Read(NamedTuple):
    state: int  # planned_read
    slot: int
    version: int
    preserved: bool
    step: int  # the step whose materialize serves it


# An action: (operation, first segment, last segment, arguments, what it raised).
Label = tuple[str, int, int, tuple[int, ...], str]
# One thread's operation in progress: (operation, next segment, arguments).
Running = tuple[str, int, tuple[int, ...]] | tuple[()]


class World(NamedTuple):
    tasks: tuple[Task, ...]
    steps: tuple[Step, ...]
    slots: tuple[Slot, ...]
    pages: tuple[frozenset[tuple[int, int]], ...]
    hi: tuple[int, ...]
    lo: tuple[int, ...]
    completed: tuple[int, ...]
    failed: tuple[int, ...]
    staged: int
    sticky: bool
    failures_drained: bool
    reads: tuple[Read, ...]
    threads: tuple[Running, ...]


@dataclass(frozen=True)
class Bounds:
    """Sizes of the explored world (defaults: the CI bound).

    Untouched slots and requests without a write are interchangeable, so
    only the first of them is tried. ``failures`` bounds failed writes.
    """

    requests: int = 2
    tasks: int = 2
    slots: int = 4
    pages: int = 2
    steps: int = 2
    reads: int = 1
    failures: int = 1
    keys: int = 1  # pool keys per slot: hidden (always written), then mm keys a step may write

    def describe(self) -> str:
        keys = f" ({self.keys} keys each)" if self.keys > 1 else ""
        return (
            f"{self.requests} requests, {self.tasks} tasks, {self.slots} slots{keys}, "
            f"{self.pages} staging pages, {self.steps} steps, {self.reads} planned reads, {self.failures} failures"
        )


CI_BOUNDS = Bounds()
# A bigger bound for a manual run: a third step, so a committed slot can be
# reused while an earlier step is still unconsumed.
BIG_BOUNDS = Bounds(requests=2, tasks=2, slots=4, pages=2, steps=3, reads=1, failures=1)


# ----------------------------------------------------------------- model


class Violation(Exception):
    """An invariant broken by a state or a move."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def _has_effect(effect: str, move: MoveSpec) -> bool:
    return effect in move.effects


class _Ctx:
    """Scratch world for one action: what the compiled operation and the
    handlers act on. ``tid``/``sid``/``slot``... are the operation's
    arguments; ``cur_*`` the component instance a move is firing on."""

    __slots__ = (
        *("tasks", "steps", "slots", "pages", "hi", "lo", "completed", "failed", "staged", "sticky"),
        *("failures_drained", "reads", "req", "kind", "slot", "sid", "tid", "target", "rid", "keys", "drop_pairs"),
        *(
            "commit_pairs",
            "found_failures",
            "link_slot",
            "fired",
            "cur_tid",
            "cur_slot",
            "cur_holder",
            "cur_page",
            "cur_read",
        ),
    )

    def __init__(self, w: World, args: tuple[int, ...]):
        self.tasks = list(w.tasks)
        self.steps = list(w.steps)
        self.slots = list(w.slots)
        self.pages = list(w.pages)
        self.hi = list(w.hi)
        self.lo = list(w.lo)
        self.completed = list(w.completed)
        self.failed = list(w.failed)
        self.staged = w.staged
        self.sticky = w.sticky
        self.failures_drained = w.failures_drained
        self.reads = list(w.reads)
        # Operation arguments: (req, kind, slot, sid, tid, rid, keys); -1 = none. ``slot``
        # is a slot for a save (``keys``: the bit mask of mm keys it writes), a cell for a read.
        self.req, self.kind, self.slot, self.sid, self.tid, self.rid, self.keys = args
        self.target = -1
        self.commit_pairs: list[tuple[int, int]] = []
        self.drop_pairs: list[tuple[int, int]] = []
        self.found_failures = False
        self.link_slot = -1
        self.fired: set[tuple[str, str]] = set()
        self.cur_tid = self.cur_slot = self.cur_page = self.cur_read = -1
        self.cur_holder: tuple[int, int] = (STEP, -1)

    @property
    def args(self) -> tuple[int, ...]:
        return (self.req, self.kind, self.slot, self.sid, self.tid, self.rid, self.keys)

    def freeze(self, threads: tuple[Running, ...]) -> World:
        return World(
            tuple(self.tasks),
            tuple(self.steps),
            tuple(self.slots),
            tuple(self.pages),
            tuple(self.hi),
            tuple(self.lo),
            tuple(self.completed),
            tuple(self.failed),
            self.staged,
            self.sticky,
            self.failures_drained,
            tuple(self.reads),
            threads,
        )

    def __repr__(self) -> str:
        return f"<task {self.tid} step {self.sid} slot {self.slot}>"


NO_ARGS = (-1, -1, -1, -1, -1, -1, 0)


def _args(**kw: int) -> tuple[int, ...]:
    a = dict(zip(("req", "kind", "slot", "sid", "tid", "rid", "keys"), NO_ARGS))
    a.update(kw)
    return tuple(a.values())


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


class _Role:
    """How the model finds a role's instances in a context and reads and
    writes their state (one compiled machine per role)."""

    def __init__(
        self,
        machine: CompiledMachine,
        instances: Callable[[_Ctx, str], list[Any]],
        get: Callable[[_Ctx, Any], int],
        put: Callable[[_Ctx, Any, int, str], None],
        focus: Callable[[_Ctx, Any, str], None],
    ):
        self.machine, self.instances, self.get, self.put, self.focus = machine, instances, get, put, focus


class ComposedModel:
    """The protocol's operations over the model world: initial state,
    actions (operation segments), invariants, descriptions."""

    def __init__(
        self,
        bounds: Bounds,
        broken: str | None = None,
        specs: Mapping[str, MachineSpec] | None = None,
        protocol: ProtocolSpec | None = None,
    ):
        """``broken``: a catalogued mutation or a protocol file; ``specs``
        replaces component machines by name; ``protocol`` a whole spec."""
        self.bounds = bounds
        self.broken = broken
        spec, self.expected = load_variant(broken) if protocol is None else (protocol, None)
        if specs:
            spec = dataclasses.replace(
                spec, components={role: specs.get(m.name, m) for role, m in spec.components.items()}
            )
        self.spec = spec
        comps = spec.components
        for role in ("task", "position", "task_holder", "step_holder", "step", "slot", "read"):
            if role not in comps:
                raise SpecError(f"{spec.origin}: the model needs component role {role!r}")
        self._link_fires: dict[tuple[str, str], Callable[[Any], None]] = {}
        handlers = self._machine_handlers()
        self.m = {role: self._compile(m, handlers) for role, m in comps.items()}
        T, P, H = self.m["task"].State, self.m["position"].State, self.m["task_holder"].State
        Occ, S, R = self.m["slot"].State, self.m["step"].State, self.m["read"].State
        self.T, self.P, self.H, self.Occ, self.S, self.R = T, P, H, Occ, S, R
        self.accepts = frozenset(int(s) for s in self.m["task"].tagged("accepts_chunks"))
        self.task_final = frozenset(int(s) for s in self.m["task"].final)
        self.read_final = frozenset(int(s) for s in self.m["read"].final)
        tspec = comps["task"]
        self.events = {
            name: tuple(
                frozenset(int(T[s]) for s in part) for part in states_after(tspec, functools.partial(_has_effect, eff))
            )
            for name, eff in (("host_ready", "set_host_ready"), ("done", "set_done"))
        }
        self.claimed = frozenset(int(T[s]) for s in states_after(tspec, lambda m: m.trigger == "claim_copy")[0])
        self.slot_rest = frozenset(int(Occ[s]) for s in comps["slot"].settling_states())
        self.held, self.unheld = int(H["HELD"]), int(H[comps["task_holder"].initial])
        self.FAILED = int(T["FAILED"])
        self.UNSAVED, self.SAVED = int(S["UNSAVED"]), int(S["SAVED"])
        self.ABSENT, self.IN_TRANSIT, self.COMMITTED = int(Occ["ABSENT"]), int(Occ["IN_TRANSIT"]), int(Occ["COMMITTED"])
        self.HIGH, self.LOW, self.STALE = int(P["HIGH"]), int(P["LOW"]), int(P["STALE"])
        self.on_queue = frozenset((self.HIGH, self.LOW, self.STALE))
        self.pairs = {int(P[p]): frozenset(int(T[t]) for t in ts) for p, ts in spec.pairs.items()}
        self.roles = self._roles()
        self._required = {
            (s.role, s.trigger) for op in spec.operations for s in op.walk() if isinstance(s, Fire) and not s.optional
        }
        self.guards = self._guards()
        self.ops: dict[str, CompiledOperation] = compile_protocol(spec, self, self._effects(), self.guards)
        self.invisible = {
            name: tuple(self._invisible(seg) for seg in op.spec.segments) for name, op in self.ops.items()
        }
        # Where a save may fail and abandon its step: after the claim, before the step is issued.
        save = self.ops["save"].spec
        at = {x.label: i for i, sg in enumerate(save.segments) for x in sg.steps if isinstance(x, Fire)}
        claim, issue = at.get("step_holder.claim"), at.get("step.save")
        self._abandon_at = (
            frozenset(range(claim + 1, issue + 1))
            if "abandon_save" in self.ops and claim is not None and issue is not None
            else frozenset()
        )
        self.checkers = self._checkers()
        declared = set(spec.invariants_for("model"))
        missing, extra = sorted(declared - set(self.checkers)), sorted(set(self.checkers) - declared)
        if missing or extra:
            raise SpecError(
                f"{spec.origin}: the model checks invariants {sorted(self.checkers)}; "
                f"declared for the model without a checker: {missing}; checkers with no declared name: {extra}"
            )
        for name in ("new_step", "save", "escalate", "committer_claim", "committer_copy", "committer_write"):
            if name not in self.ops:
                raise SpecError(f"{spec.origin}: the model needs operation {name!r}")

    # Protocol effects that change nothing in the model's world (rows are abstract).
    _NO_OPS = frozenset({"wake_committer", "copy_to_host", "pool_write", "fetch_rows", "merge_outputs"})

    def _invisible(self, seg: Any) -> bool:
        """A wait on a monotone event, or a segment of no-op effects only."""
        if seg.wait:
            return seg.wait in ("done", "host_ready")
        return all(getattr(s, "effect", None) in self._NO_OPS for s in seg.steps)

    # ------------------------------------------------------ machine handlers
    def _compile(self, spec: MachineSpec, handlers: dict[str, Callable[..., Any]]) -> CompiledMachine:
        guards = {g: handlers[g] for g in spec.guard_names if g in handlers}
        effects = {e: handlers[e] for e in spec.effect_names if e in handlers}
        return compile_machine(spec, guards=guards, effects=effects)

    def _machine_handlers(self) -> dict[str, Callable[..., Any]]:
        h: dict[str, Callable[..., Any]] = {
            # write_task
            "drop_device_clone": lambda c: self._set_task(c, c.cur_tid, clone=False),
            "set_host_ready": lambda c: self._set_task(c, c.cur_tid, host_ready=True),
            "set_done": lambda c: self._set_task(c, c.cur_tid, done=True),
            # slot_occupancy
            "owned_by_writer": lambda c: c.slots[c.cur_slot].owner == c.cur_tid,
            "set_owner": lambda c: self._set_slot(c, owner=c.cur_tid, stale=False),
            "clear_owner": lambda c: self._set_slot(c, owner=-1),
            "reassign_from_old_owner": self._reassign_from_old_owner,
            "bump_version": lambda c: self._set_slot(c, version=c.slots[c.cur_slot].version + 1),
            "preserve_pending_reads": self._unlinked("preserve_pending_reads"),  # the protocol links it below
            # staging_holder
            "is_step_holder": lambda c: c.cur_holder[0] == STEP,
            "is_task_holder": lambda c: c.cur_holder[0] == TASK,
            "page_free": lambda c: c.cur_page >= 0 and not c.pages[c.cur_page],
            "page_busy": lambda c: c.cur_page >= 0 and bool(c.pages[c.cur_page]),
            "wake_claimers_if_free": lambda c: None,  # a claim here is enabled by a free page
            # step_context: the protocol fires step_holder.consume itself (materialize, discard)
            "release_step_holder": lambda c: None,
            # planned_read: the live reads are the pending index
            "add_pending": lambda c: None,
            "forget_pending": lambda c: None,
            "copy_old_rows": lambda c: self._set_read(c, c.cur_read, preserved=True),
        }
        # A component effect the protocol implements by firing another component's move.
        for link in self.spec.links:
            h[link.effect[1]] = functools.partial(self._run_link, link.fires.role, link.fires.trigger)
        return h

    @staticmethod
    def _unlinked(effect: str) -> Callable[[Any], None]:
        def run(c: Any) -> None:
            raise Violation("model.outside", f"component effect {effect} ran, and the protocol links it to no move")

        return run

    def _run_link(self, role: str, trigger: str, c: _Ctx) -> None:
        fire = self._link_fires.get((role, trigger))
        if fire is None:
            fire = self._link_fires[(role, trigger)] = self.move(role, trigger)[1]
        saved = c.link_slot, c.cur_tid, c.cur_slot
        c.link_slot = c.cur_slot
        fire(c)
        c.link_slot, c.cur_tid, c.cur_slot = saved

    @staticmethod
    def _set_task(c: _Ctx, tid: int, **kw: Any) -> None:
        c.tasks[tid] = _rep(c.tasks[tid], **kw)

    @staticmethod
    def _set_slot(c: _Ctx, **kw: Any) -> None:
        c.slots[c.cur_slot] = _rep(c.slots[c.cur_slot], **kw)

    @staticmethod
    def _set_read(c: _Ctx, rid: int, **kw: Any) -> None:
        c.reads[rid] = _rep(c.reads[rid], **kw)

    def _reassign_from_old_owner(self, c: _Ctx) -> None:
        old = c.slots[c.cur_slot].owner
        if old >= 0 and old != c.cur_tid:
            prev = c.tasks[old].reassigned
            self._set_task(c, old, reassigned=tuple(sorted({*prev, c.cur_slot})))

    # ------------------------------------------------------------ roles
    def _roles(self) -> dict[str, _Role]:
        m = self.m

        def one_task(c: _Ctx, trigger: str) -> list[Any]:
            return [c.tid] if c.tid >= 0 else []

        def focus_task(c: _Ctx, i: Any, trigger: str) -> None:
            c.cur_tid = i

        def put_task(c: _Ctx, i: Any, dest: int, trigger: str) -> None:
            self._set_task(c, i, state=dest)
            if trigger == "claim_copy":
                self._set_task(c, i, claims=c.tasks[i].claims + 1)

        def put_position(c: _Ctx, i: Any, dest: int, trigger: str) -> None:
            was = c.tasks[i].position
            self._set_task(c, i, position=dest)
            self._queue(c, i, trigger, was, dest)

        def holder_page(c: _Ctx, holder: tuple[int, int], trigger: str) -> int:
            kind, ident = holder
            if kind == STEP:
                st = c.steps[ident]
                if st.holder == self.held:
                    return st.page
                return next((p for p, busy in enumerate(c.pages) if not busy), -1)
            t = c.tasks[ident]
            if t.holder == self.held:
                return t.page
            return c.steps[t.step].page if t.step >= 0 else -1

        def focus_task_holder(c: _Ctx, i: Any, trigger: str) -> None:
            c.cur_tid, c.cur_holder = i, (TASK, i)
            c.cur_page = holder_page(c, (TASK, i), trigger)

        def focus_step_holder(c: _Ctx, i: Any, trigger: str) -> None:
            c.cur_holder = (STEP, i)
            c.cur_page = holder_page(c, (STEP, i), trigger)

        def put_holder(c: _Ctx, holder: tuple[int, int], dest: int) -> None:
            page = c.cur_page
            if dest == self.held:
                c.pages[page] = c.pages[page] | {holder}
            else:
                c.pages[page] = c.pages[page] - {holder}
            new_page = page if dest == self.held else -1
            kind, ident = holder
            if kind == STEP:
                c.steps[ident] = _rep(c.steps[ident], holder=dest, page=new_page)
            else:
                self._set_task(c, ident, holder=dest, page=new_page)

        def one_step(c: _Ctx, trigger: str) -> list[Any]:
            return [c.sid] if c.sid >= 0 else []

        def slot_instances(c: _Ctx, trigger: str) -> list[Any]:
            if trigger == "commit":
                return c.commit_pairs
            if trigger == "drop":
                return c.drop_pairs
            return []  # map / reset: the take_tenancy coupling names its slots

        def focus_slot(c: _Ctx, i: Any, trigger: str) -> None:
            c.cur_slot, c.cur_tid = i

        def put_slot(c: _Ctx, i: Any, dest: int, trigger: str) -> None:
            # A cell back at its initial state holds no rows, stale or not.
            c.slots[i[0]] = _rep(c.slots[i[0]], state=dest, stale=c.slots[i[0]].stale and dest != self.ABSENT)

        def read_instances(c: _Ctx, trigger: str) -> list[Any]:
            if c.link_slot >= 0:
                return [i for i, r in enumerate(c.reads) if r.slot == c.link_slot and r.state not in self.read_final]
            if c.rid >= 0:
                return [c.rid]
            return [i for i, r in enumerate(c.reads) if r.step == c.sid and r.state not in self.read_final]

        def focus_read(c: _Ctx, i: Any, trigger: str) -> None:
            c.cur_read = i

        def put_read(c: _Ctx, i: Any, dest: int, trigger: str) -> None:
            self._set_read(c, i, state=dest)

        return {
            "task": _Role(m["task"], one_task, lambda c, i: c.tasks[i].state, put_task, focus_task),
            "position": _Role(m["position"], one_task, lambda c, i: c.tasks[i].position, put_position, focus_task),
            "task_holder": _Role(
                m["task_holder"],
                one_task,
                lambda c, i: c.tasks[i].holder,
                lambda c, i, d, t: put_holder(c, (TASK, i), d),
                focus_task_holder,
            ),
            "step_holder": _Role(
                m["step_holder"],
                one_step,
                lambda c, i: c.steps[i].holder,
                lambda c, i, d, t: put_holder(c, (STEP, i), d),
                focus_step_holder,
            ),
            "step": _Role(
                m["step"],
                one_step,
                lambda c, i: c.steps[i].state,
                lambda c, i, d, t: c.steps.__setitem__(i, _rep(c.steps[i], state=d)),
                lambda c, i, t: setattr(c, "cur_tid", i),
            ),
            "slot": _Role(m["slot"], slot_instances, lambda c, i: c.slots[i[0]].state, put_slot, focus_slot),
            "read": _Role(m["read"], read_instances, lambda c, i: c.reads[i].state, put_read, focus_read),
        }

    # The copy queues' order: which end of which queue a position move
    # touches (the copy_queue machine says where a task is, not the order).
    _QUEUE_OPS = {
        "push": ("hi", "tail"),
        "push_low": ("lo", "tail"),
        "push_head": ("hi", "head"),
        "promote": ("hi", "head"),
        "claim": (None, "pop"),
        "skip": (None, "pop"),
    }

    def _queue(self, c: _Ctx, tid: int, trigger: str, was: int, dest: int) -> None:
        where, how = self._QUEUE_OPS.get(trigger, (None, None))
        if how == "pop" or (was in (self.HIGH, self.LOW, self.STALE) and dest not in self.on_queue):
            for q in (c.hi, c.lo):
                if tid in q:
                    q.remove(tid)
                    return
            return
        if where is None:
            return
        if trigger == "promote" and tid in c.lo:
            c.lo.remove(tid)
        q = c.hi if where == "hi" else c.lo
        if how == "head":
            q.insert(0, tid)
        else:
            q.append(tid)

    # ------------------------------------------------------------ Binding
    def move(self, role: str, trigger: str) -> tuple[Callable[[Any], bool], Callable[[Any], None]]:
        """(enabled, fire) over the role's instances in the context. Several
        instances: a move fires on each where enabled; ``enabled`` is all of
        them for a move some operation requires, any of them otherwise."""
        r = self.roles[role]
        machine = r.machine
        need_all = (role, trigger) in self._required

        def one(c: _Ctx, inst: Any) -> Any:
            r.focus(c, inst, trigger)
            mv = machine.move(r.get(c, inst), trigger)
            if mv is None or not all(g(c) for g in mv.guards):
                return None
            return mv

        def enabled(c: _Ctx) -> bool:
            insts = r.instances(c, trigger)
            if len(insts) == 1:
                return one(c, insts[0]) is not None
            if not insts:
                return True
            if need_all:
                return all(one(c, i) is not None for i in insts)
            return any(one(c, i) is not None for i in insts)

        def fire(c: _Ctx) -> None:
            for inst in list(r.instances(c, trigger)):
                mv = one(c, inst)
                if mv is None:
                    continue
                r.put(c, inst, int(mv.dest), trigger)
                r.focus(c, inst, trigger)
                if mv.deferrable:
                    # The protocol runs these itself once its record is public (wake_failed).
                    for eff in mv.undeferrable:
                        eff(c)
                    self._set_task(c, inst, owed=(trigger, int(mv.source)))
                else:
                    for eff in mv.effects:
                        eff(c)
                c.fired.add((role, trigger))

        return enabled, fire

    def coupling(self, role: str, name: str) -> Callable[[Any], None]:
        cp = next(x for x in self.spec.components[role].couplings if x.name == name)
        fire_on, others = self._instance_move(role, cp.fires), self._instance_move(role, cp.others)
        K = self.bounds.keys

        def run(c: _Ctx) -> None:
            # The slot changes tenant: what its cells hold is the previous tenant's until rewritten.
            written = self._written(c)
            for cell in range(c.slot * K, c.slot * K + K):
                if c.slots[cell].state != self.ABSENT:
                    c.slots[cell] = _rep(c.slots[cell], stale=True)
                (fire_on if cell in written else others)(c, (cell, c.tid))

        return run

    def _written(self, c: _Ctx) -> tuple[int, ...]:
        """The cells a save writes: hidden, and the mm keys in its mask."""
        K = self.bounds.keys
        return tuple(c.slot * K + k for k in range(K) if k == 0 or c.keys >> (k - 1) & 1)

    def _instance_move(self, role: str, trigger: str) -> Callable[[_Ctx, Any], None]:
        r = self.roles[role]

        def run(c: _Ctx, inst: Any) -> None:
            r.focus(c, inst, trigger)
            mv = r.machine.move(r.get(c, inst), trigger)
            if mv is None or not all(g(c) for g in mv.guards):
                raise ProtocolViolation(f"{role}.{trigger} is not enabled for {inst}")
            r.put(c, inst, int(mv.dest), trigger)
            r.focus(c, inst, trigger)
            for eff in mv.effects:
                eff(c)
            c.fired.add((role, trigger))

        return run

    # ------------------------------------------------ protocol effects/guards
    def _effects(self) -> dict[str, Callable[[Any], None]]:
        def outside(name: str) -> Callable[[Any], None]:
            def run(c: Any) -> None:
                raise Violation("model.outside", f"effect {name} ran; the model leaves it out (see modelcheck)")

            return run

        # Rows are abstract: a copy's or a pool write's outcome is where a failure is
        # injected, and a fetch's version check is rows_fetched, under the state lock.
        nothing: dict[str, Callable[[Any], None]] = {name: _nothing for name in self._NO_OPS}
        return nothing | {
            "register_task": self._register_task,
            "append_chunk": self._append_chunk,
            "charge_budget": self._charge_budget,
            "refund_unpinned": self._refund_unpinned,
            "unpin_budget": self._unpin_budget,
            "publish_completed": lambda c: c.completed.append(c.tid),
            "publish_failed": lambda c: c.failed.append(c.tid),
            "wake_failed": self._wake_failed,
            "take_records": self._take_records,
            "sticky_failure": lambda c: setattr(c, "sticky", True),
            "plan_hits": self._plan_hits,
            # Reads plan committed slots of earlier steps; a same-step hit is not modelled.
            "replan_same_step_hits": lambda c: None,
            "dispatch_inline": outside("dispatch_inline"),
            "flush_oldest": outside("flush_oldest"),
            "close_staging": outside("close_staging"),
            "drain_queues": outside("drain_queues"),
        }

    def _guards(self) -> dict[str, Callable[[Any], bool]]:
        return {
            "immediate": lambda c: c.kind == IMM,
            "queued_at_submit": lambda c: c.kind == DEFQ,
            "open_write_accepts": self._open_write_accepts,
            "over_budget": lambda c: False,
            "task_failed": lambda c: c.tasks[c.tid].state == self.FAILED,
            "failures_drained": lambda c: c.found_failures,
            "rows_planned": lambda c: c.slots[c.slot].state in (self.IN_TRANSIT, self.COMMITTED),
            "rows_fetched": self._rows_fetched,
            "eager": lambda c: False,
        }

    def _open_write_accepts(self, c: _Ctx) -> bool:
        # Only a plain deferred save appends (a queued one would be pushed again).
        if c.kind != DEF:
            return False
        for tid, t in enumerate(c.tasks):
            taken = any(cell in t.reassigned for cell in self._written(c))
            if t.req == c.req and t.sched == DEF and t.state in self.accepts and not taken:
                c.target = tid
        return c.target >= 0

    def _register_task(self, c: _Ctx) -> None:
        tid = len(c.tasks)
        c.tasks.append(
            Task(
                state=int(self.m["task"].initial),
                position=int(self.m["position"].initial),
                holder=self.unheld,
                page=-1,
                sched=IMM if c.kind == IMM else DEF,
                req=c.req,
                step=c.sid if c.kind == IMM else -1,
                host_ready=False,
                done=False,
                owed=(),
                clone=True,
                pins=(c.sid,),
                slots=self._written(c),
                reassigned=(),
                claims=0,
                drained=False,
            )
        )
        c.tid = tid
        self._pin(c, tid)

    def _append_chunk(self, c: _Ctx) -> None:
        tid = c.target
        t = c.tasks[tid]
        if t.state not in self.accepts:
            raise Violation("write_task.append_only_before_copy", f"append to task {tid} in {self.T(t.state).name}")
        cells = tuple(sorted({*t.slots, *self._written(c)}))
        self._set_task(c, tid, slots=cells, pins=(*t.pins, c.sid), clone=True)
        c.tid = tid
        self._pin(c, tid)

    def _pin(self, c: _Ctx, tid: int) -> None:
        st = c.steps[c.sid]
        c.steps[c.sid] = _rep(st, tids=tuple(sorted({*st.tids, tid})))

    def _charge_budget(self, c: _Ctx) -> None:
        c.steps[c.sid] = _rep(c.steps[c.sid], charged=1)
        c.staged += 1

    def _refund_unpinned(self, c: _Ctx) -> None:
        st = c.steps[c.sid]
        if not st.tids and not st.freed:
            c.staged -= st.charged
            c.steps[c.sid] = _rep(st, freed=True)

    def _unpin_budget(self, c: _Ctx) -> None:
        """Leave the task's tickets; a ticket uncharges once, when its last task leaves."""
        tid = c.tid
        for sid in c.tasks[tid].pins:
            st = c.steps[sid]
            tids = tuple(x for x in st.tids if x != tid)
            freed = st.freed
            if not tids and not freed:
                c.staged -= st.charged
                freed = True
            c.steps[sid] = _rep(st, tids=tids, freed=freed)

    def _wake_failed(self, c: _Ctx) -> None:
        t = c.tasks[c.tid]
        if not t.owed:
            return
        trigger, source = t.owed
        mv = self.m["task"].move(source, trigger)
        assert mv is not None
        c.cur_tid = c.tid
        for eff in mv.deferrable:
            eff(c)
        self._set_task(c, c.tid, owed=())

    def _take_records(self, c: _Ctx) -> None:
        for tid in c.completed:
            c.commit_pairs.extend((s, tid) for s in c.tasks[tid].slots)
        for tid in c.failed:
            c.drop_pairs.extend((s, tid) for s in c.tasks[tid].slots)
        for tid in (*c.completed, *c.failed):
            self._set_task(c, tid, drained=True)
        if c.failed:
            c.failures_drained = c.found_failures = True
        c.completed, c.failed = [], []

    def _plan_hits(self, c: _Ctx) -> None:
        c.reads.append(Read(int(self.m["read"].initial), c.slot, c.slots[c.slot].version, False, c.sid))
        c.rid = len(c.reads) - 1

    def _rows_fetched(self, c: _Ctx) -> bool:
        for r in c.reads:
            if r.step == c.sid and r.state not in self.read_final:
                if c.slots[r.slot].version != r.version and not r.preserved:
                    return False
        return True

    # ------------------------------------------------------------- world
    @property
    def fresh_slot(self) -> Slot:
        return Slot(int(self.m["slot"].initial), -1, 0, False)

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
        )

    def unsettled(self, w: World) -> list[str]:
        """Why ``w`` is not settled (empty when it is)."""
        why = [
            f"task {tid} is {self.T(t.state).name}" + (" and owes its wakes" if t.owed else "")
            for tid, t in enumerate(w.tasks)
            if t.state not in self.task_final or t.owed
        ]
        why += [f"page {p} is held by {_holders(busy)}" for p, busy in enumerate(w.pages) if busy]
        why += [
            f"{self.cell(i)} is {self.Occ(s.state).name}"
            for i, s in enumerate(w.slots)
            if s.state not in self.slot_rest
        ]
        why += [f"the {_THREAD[i]} is inside {run[0]}" for i, run in enumerate(w.threads) if run]
        return why

    def settled(self, w: World) -> bool:
        """All tasks terminal with their events set, no page held, every
        slot at rest, no operation in progress."""
        return (
            all(t.state in self.task_final and not t.owed for t in w.tasks)
            and not any(w.pages)
            and all(s.state in self.slot_rest for s in w.slots)
            and not any(w.threads)
        )

    # ----------------------------------------------------------- actions
    def successors(self, w: World) -> Iterator[tuple[Label, World]]:
        """``(label, next world)`` for every enabled action. Raises
        Violation (with the label in ``.label``) for a broken move."""
        b = self.bounds
        th = w.threads
        failures = sum(t.state == self.FAILED for t in w.tasks) + sum(1 for r in th if r and r[0] == "fail")
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
                if t.state not in self.task_final:
                    yield from self._start(w, ENGINE, "escalate", _args(tid=tid))
            if w.completed or w.failed:
                yield from self._start(w, ENGINE, "drain", NO_ARGS)
            for sid, st in enumerate(w.steps):
                if st.state == self.SAVED:
                    yield from self._start(w, ENGINE, "discard", _args(sid=sid))
        # reader: a lagged materialize on another thread
        if th[READER]:
            yield from self._continue(w, READER)
        elif "materialize" in self.ops:
            for sid, st in enumerate(w.steps):
                # A save still in progress has not returned its step id to anyone yet.
                if st.state == self.SAVED and not (th[ENGINE] and th[ENGINE][2][3] == sid):  # type: ignore[misc]
                    yield from self._start(w, READER, "materialize", _args(sid=sid))
        # committer
        run = th[COMMITTER]
        if run:
            op, seg, args = run
            yield from self._continue(w, COMMITTER)
            if can_fail and seg == 0 and op in ("committer_copy", "committer_write"):
                yield from self._start(w, COMMITTER, "fail", args)  # the copy / pool write fails
        else:
            head = w.hi[0] if w.hi else w.lo[0] if w.lo else -1
            if head >= 0:
                yield from self._start(w, COMMITTER, "committer_claim", _args(tid=head))
        # a failure on another thread (dispatch, shutdown) of a task no operation has in hand
        if th[FAILER]:
            yield from self._continue(w, FAILER)
        elif can_fail:
            busy = {r[2][4] for r in th if r}
            for tid, t in enumerate(w.tasks):
                if t.state not in self.task_final and tid not in busy:
                    yield from self._start(w, FAILER, "fail", _args(tid=tid))

    def _new_steps(self, w: World) -> Iterator[tuple[Label, World]]:
        if "new_step" not in self.ops or sum(r.state not in self.read_final for r in w.reads) >= self.bounds.reads:
            return
        sid = len(w.steps)
        if any(r.step == sid for r in w.reads):
            return
        K = self.bounds.keys
        for slot in self._distinct_slots(w):
            for cell in range(slot * K, slot * K + K):
                if w.slots[cell].state == self.COMMITTED:
                    yield from self._start(w, ENGINE, "new_step", _args(slot=cell, sid=sid))

    def _saves(self, w: World) -> Iterator[tuple[Label, World]]:
        if not any(not p for p in w.pages):
            return  # the engine never saves into a full staging pool (it would block until a timeout)
        sid = len(w.steps)
        with_step = w._replace(steps=(*w.steps, Step(int(self.m["step"].initial), self.unheld, -1, 0, (), False)))
        full = len(w.tasks) >= self.bounds.tasks
        for r in self._distinct_requests(w):
            open_def = any(t.req == r and t.sched == DEF and t.state in self.accepts for t in w.tasks)
            for kind in (IMM, DEF, DEFQ):
                if full and not (kind == DEF and open_def):
                    continue
                for slot in self._distinct_slots(w):
                    for keys in range(1 << (self.bounds.keys - 1)):
                        args = _args(req=r, kind=kind, slot=slot, sid=sid, keys=keys)
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
        if compiled.spec.entry is not None and not compiled.admits(_Ctx(w, args)):
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
        c = _Ctx(w, args)
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
                        hit = [t for t in waited if guard(_with_tid(c, t))]
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
            v.label = (op, seg, last, args, "")  # type: ignore[attr-defined]
            raise v from None
        except Violation as exc:
            exc.label = (op, seg, last, args, "")  # type: ignore[attr-defined]
            raise
        nxt = self._next(op, last, c, raised)
        threads = list(w.threads)
        threads[thread] = nxt
        out = c.freeze(tuple(threads))
        if start and not nxt and not raised and out == w._replace(threads=out.threads):
            return  # the operation changed nothing
        yield (op, seg, last, args, raised), out

    def _next(self, op: str, seg: int, c: _Ctx, raised: str) -> Running:
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

    def _waited(self, c: _Ctx, of: str) -> list[int]:
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
        read refers to reads as 0; the record lists are sets."""
        final, read_final = self.task_final, self.read_final
        tasks = w.tasks
        for t in tasks:
            if t.drained and t.slots and not t.owed and t.state in final:
                tasks = tuple(
                    _rep(t, req=-1, slots=(), reassigned=(), pins=(), clone=False)
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
                    s if s.version == 0 or i in read_slots else _rep(s, version=0) for i, s in enumerate(slots)
                )
                break
        steps = w.steps
        for st in steps:
            if st.freed and st.charged:
                steps = tuple(_rep(st, charged=0) if st.freed else st for st in steps)
                break
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

    # -------------------------------------------------------- invariants
    def _checkers(self) -> dict[str, Callable[[World], None]]:
        return {
            "position_matches_task": self._position_matches_task,
            "one_queue_entry": self._one_queue_entry,
            "done_after_record": self._done_after_record,
            "staged_bytes": self._staged_bytes,
            "task_views_step_page": self._task_views_step_page,
            "copy_on_write": self._copy_on_write,
            "failure_is_sticky": self._failure_is_sticky,
            "save_waits_previous_writes": self._save_waits_previous_writes,
            "can_settle": lambda w: None,  # liveness: checked over the whole graph in check()
        }

    def _position_matches_task(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.state not in self.pairs.get(t.position, ()):
                raise Violation(
                    "position_matches_task",
                    f"task {tid} is {self.T(t.state).name} at queue position {self.P(t.position).name}",
                )

    def _one_queue_entry(self, w: World) -> None:
        queued = [*w.hi, *w.lo]
        if len(set(queued)) != len(queued):
            raise Violation("one_queue_entry", f"a task is queued twice: hi={list(w.hi)} lo={list(w.lo)}")
        for tid, t in enumerate(w.tasks):
            if (t.position in self.on_queue) != (tid in queued):
                raise Violation(
                    "one_queue_entry",
                    f"task {tid} at {self.P(t.position).name}, queues hi={list(w.hi)} lo={list(w.lo)}",
                )

    def _done_after_record(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.done and tid not in w.completed and tid not in w.failed and not t.drained:
                raise Violation("done_after_record", f"task {tid} is done but no completion/failure record is public")

    def _staged_bytes(self, w: World) -> None:
        live = sum(st.charged for st in w.steps if not st.freed)
        if w.staged != live or w.staged < 0:
            raise Violation("staged_bytes", f"budget counter {w.staged}, unfreed tickets charge {live}")
        for tid, t in enumerate(w.tasks):
            if t.clone:
                freed = [sid for sid in t.pins if w.steps[sid].freed]
                if freed:
                    raise Violation(
                        "staged_bytes",
                        f"task {tid} ({self.T(t.state).name}) still holds device clones of step {freed[0]}, "
                        "whose ticket is already uncharged",
                    )

    def _task_views_step_page(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.holder == self.held:
                step = w.steps[t.step]
                if step.holder == self.held and t.page != step.page:
                    raise Violation(
                        "task_views_step_page", f"task {tid} holds page {t.page}, its step {t.step} page {step.page}"
                    )

    def _copy_on_write(self, w: World) -> None:
        for r in w.reads:
            if r.state not in self.read_final and w.slots[r.slot].version != r.version and not r.preserved:
                raise Violation(
                    "copy_on_write",
                    f"a planned read of {self.cell(r.slot)} (version {r.version}) lost its rows: it is now "
                    f"version {w.slots[r.slot].version} and nothing was preserved",
                )

    def _failure_is_sticky(self, w: World) -> None:
        if w.failures_drained and not w.sticky:
            raise Violation("failure_is_sticky", "a failure was drained but later facade entries would not raise")

    def _save_waits_previous_writes(self, w: World) -> None:
        for sid, st in enumerate(w.steps):
            if st.state == self.UNSAVED:
                continue
            for tid, t in enumerate(w.tasks):
                if t.sched == IMM and 0 <= t.step < sid and not t.done:
                    raise Violation(
                        "save_waits_previous_writes",
                        f"step {sid} was saved while the immediate write task {tid} of step {t.step} is not done",
                    )

    def check_state(self, w: World) -> None:
        """Raise Violation for the first invariant ``w`` breaks: the
        protocol's, then the component machines' own."""
        for check in self.checkers.values():
            check(w)
        self._machine_invariants(w)

    def _machine_invariants(self, w: World) -> None:
        T = self.T
        for tid, t in enumerate(w.tasks):
            name = T(t.state).name
            if not t.owed:
                for event, (always, sometimes) in self.events.items():
                    is_set = getattr(t, event)
                    if (t.state in always and not is_set) or (t.state not in sometimes and is_set):
                        raise Violation("write_task.events_match_state", f"task {tid} in {name} has {event}={is_set}")
            if t.claims > 1 or (t.state in self.claimed and t.claims != 1):
                raise Violation("write_task.single_copy_claim", f"task {tid} in {name} has {t.claims} copy claims")
            # A fail in progress (wakes owed) releases the holder in its next segment.
            if t.holder == self.held and t.state in self.task_final and not t.owed:
                raise Violation("staging_holder.task_holder_has_live_task", f"task {tid} is {name} and holds a page")
        for slot, s in enumerate(w.slots):
            if (s.owner >= 0) != (s.state == self.IN_TRANSIT):
                raise Violation(
                    "slot_occupancy.owner_iff_in_transit",
                    f"{self.cell(slot)} is {self.Occ(s.state).name}, owner {s.owner}",
                )
            if s.stale and s.state != self.ABSENT:
                raise Violation(
                    "slot_occupancy.tenant_owns_all_keys",
                    f"{self.cell(slot)} is {self.Occ(s.state).name} with rows of the slot's previous tenant",
                )
            if s.owner >= 0:
                owner = w.tasks[s.owner]
                if owner.drained or slot in owner.reassigned:
                    raise Violation(
                        "slot_occupancy.owner_is_live_task",
                        f"{self.cell(slot)} is owned by task {s.owner}, which is drained or reassigned",
                    )
        held: list[set[tuple[int, int]]] = [set() for _ in w.pages]
        for sid, st in enumerate(w.steps):
            if (st.state == self.SAVED) and st.holder != self.held:
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

    def check_move(self, before: World, after: World) -> None:
        """Per-move invariants: versions only grow, by one per reuse."""
        if before.slots == after.slots:
            return
        for slot, (a, b) in enumerate(zip(before.slots, after.slots, strict=True)):
            if a is b:
                continue
            if b.version < a.version or b.version > a.version + 1:
                raise Violation(
                    "slot_occupancy.version_monotonic", f"{self.cell(slot)} version {a.version} -> {b.version}"
                )
            if b.version == a.version + 1 and a.state != self.COMMITTED:
                raise Violation(
                    "slot_occupancy.version_monotonic", f"{self.cell(slot)} bumped from {self.Occ(a.state).name}"
                )

    # ------------------------------------------------------------ printing
    def cell(self, index: int) -> str:
        """A (slot, key) cell by name."""
        K = self.bounds.keys
        return f"slot {index // K}" + (f" key {index % K}" if K > 1 else "")

    def describe_label(self, label: Label) -> str:
        op, first, last, args, raised = label
        return self.label(op, first, args, last) + raised

    def label(self, op: str, seg: int, args: tuple[int, ...], last: int = -1) -> str:
        req, kind, slot, sid, tid, _, keys = args
        segs = f"{seg}" if last <= seg else f"{seg}-{last}"
        name = op + (f"[{segs}]" if len(self.ops[op].segments) > 1 else "")
        if op == "save":
            mm = "".join(f"+mm{k}" for k in range(1, self.bounds.keys) if keys >> (k - 1) & 1)
            what = f"r{req}, {_KIND[kind]} write of slot {slot}{mm}, step {sid}"
        elif op == "new_step":
            what = f"plan a read of {self.cell(slot)} for step {sid}"
        elif op in ("materialize", "discard", "abandon_save"):
            what = f"step {sid}"
        elif tid >= 0:
            what = f"task {tid}"
        else:
            what = ""
        return f"{name}({what})"

    def describe_change(self, a: World, b: World) -> str:
        T, Occ, H, S, P = self.T, self.Occ, self.H, self.S, self.P
        parts: list[str] = []
        for tid, t in enumerate(b.tasks):
            if tid >= len(a.tasks):
                parts.append(f"task {tid} {'imm' if t.sched == IMM else 'def'} {T(t.state).name}")
                continue
            o = a.tasks[tid]
            if o.state != t.state:
                parts.append(f"task {tid} {T(o.state).name}->{T(t.state).name}")
            if o.position != t.position:
                parts.append(f"task {tid} position {P(o.position).name}->{P(t.position).name}")
            if o.holder != t.holder:
                parts.append(f"task {tid} holder {H(o.holder).name}->{H(t.holder).name}")
            if o.reassigned != t.reassigned:
                parts.append(f"task {tid} reassigned {list(t.reassigned)}")
            if (o.host_ready, o.done) != (t.host_ready, t.done):
                parts.append(f"task {tid} events host_ready={t.host_ready} done={t.done}")
        for sid, step in enumerate(b.steps):
            was = a.steps[sid] if sid < len(a.steps) else None
            if was is None or (was.state, was.holder) != (step.state, step.holder):
                parts.append(f"step {sid} {S(step.state).name} holder {H(step.holder).name} (page {step.page})")
        for slot, cell in enumerate(b.slots):
            if a.slots[slot] != cell:
                owner = f" owner task {cell.owner}" if cell.owner >= 0 else ""
                stale = " (previous tenant's rows)" if cell.stale else ""
                parts.append(f"{self.cell(slot)} {Occ(cell.state).name}{owner} v{cell.version}{stale}")
        if (a.hi, a.lo) != (b.hi, b.lo):
            parts.append(f"queues hi={list(b.hi)} lo={list(b.lo)}")
        if a.completed != b.completed or a.failed != b.failed:
            parts.append(f"records completed={list(b.completed)} failed={list(b.failed)}")
        if a.staged != b.staged:
            parts.append(f"staged {b.staged}")
        if a.sticky != b.sticky:
            parts.append("failure sticky")
        if a.reads != b.reads:
            parts.append(
                "reads "
                + ", ".join(
                    f"{self.R(r.state).name} {self.cell(r.slot)} v{r.version}" + (" preserved" if r.preserved else "")
                    for r in b.reads
                )
            )
        return "; ".join(parts) or "no change"

    def describe_world(self, w: World) -> list[str]:
        T, H, P = self.T, self.H, self.P
        lines = [
            f"task {tid}: {T(t.state).name} at {P(t.position).name} ({'immediate' if t.sched == IMM else 'deferred'}, "
            f"r{t.req}) host_ready={t.host_ready} done={t.done} holder={H(t.holder).name} slots={list(t.slots)}"
            + (f" reassigned={list(t.reassigned)}" if t.reassigned else "")
            + (" wakes owed" if t.owed else "")
            for tid, t in enumerate(w.tasks)
        ]
        lines.append(f"queues hi={list(w.hi)} lo={list(w.lo)}; staged {w.staged}")
        lines += [
            f"{_THREAD[i]}: inside {self.label(run[0], run[1], run[2])}, next segment {run[1]}"
            for i, run in enumerate(w.threads)
            if run
        ]
        lines.append("pages " + ", ".join(f"{p}: [{_holders(h)}]" for p, h in enumerate(w.pages)))
        lines.append(
            "slots "
            + ", ".join(
                f"{self.cell(i)}: {self.Occ(s.state).name}/{s.owner}/v{s.version}" for i, s in enumerate(w.slots)
            )
        )
        return lines


_FIELDS: dict[type, dict[str, int]] = {}


def _rep(t: Any, **kw: Any) -> Any:
    """``t._replace(**kw)`` without its per-call overhead (a hot path here)."""
    cls = type(t)
    index = _FIELDS.get(cls)
    if index is None:
        index = _FIELDS[cls] = {name: i for i, name in enumerate(cls._fields)}
    values = list(t)
    for name, value in kw.items():
        values[index[name]] = value
    return tuple.__new__(cls, values)


def _nothing(c: Any) -> None:
    return None


def _with_tid(c: _Ctx, tid: int) -> _Ctx:
    c.tid = tid
    return c


def _holders(busy: frozenset[tuple[int, int]]) -> str:
    return ", ".join(f"{'step' if kind == STEP else 'task'} {ident}" for kind, ident in sorted(busy))


def check(
    bounds: Bounds | None = None,
    broken: str | None = None,
    *,
    specs: Mapping[str, MachineSpec] | None = None,
    protocol: ProtocolSpec | None = None,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> CheckResult:
    """Breadth-first over every reachable state of the model.

    Stops at the first (hence shallowest) invariant violation. With none,
    checks that every reachable state can still reach a settled state
    (reverse reachability over the explored graph) and reports the
    shallowest one that cannot. ``max_states`` aborts a run that grows past
    it (ValueError). ``progress(expanded, found, depth)`` is called every
    1,000 expanded states.
    """
    bounds = bounds or Bounds()
    if broken in BROKEN and BROKEN[broken].at_least:
        raise_to = {k: max(v, getattr(bounds, k)) for k, v in BROKEN[broken].at_least.items()}
        bounds = dataclasses.replace(bounds, **raise_to)
    model = ComposedModel(bounds, broken, specs, protocol)
    result = CheckResult(bounds=bounds, broken=broken)
    start = time.perf_counter()
    init = model.initial()
    index: dict[World, int] = {init: 0}
    worlds: list[World] = [init]
    parent: list[int] = [-1]
    via: list[Label | None] = [None]
    depth: list[int] = [0]
    succ: list[list[int]] = []
    transitions = 0

    def trace_to(i: int) -> list[str]:
        path = []
        while parent[i] >= 0:
            path.append(i)
            i = parent[i]
        return [
            f"{model.describe_label(via[j])}  =>  {model.describe_change(worlds[parent[j]], worlds[j])}"  # type: ignore[arg-type]
            for j in reversed(path)
        ]

    def fail(i: int, exc: Violation, label: Label | None = None) -> CheckResult:
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
        fail(worst, Violation("can_settle", f"{reason} (unsettled there: {why})"))
    result.seconds = time.perf_counter() - start
    return result
