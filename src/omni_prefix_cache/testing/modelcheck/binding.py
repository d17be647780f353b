"""The write-path model's ``Binding`` of the protocol: component moves and handlers.

``ModelBinding`` compiles the write path's component machines with the
model's guard and effect handlers, finds each role's instances in an
action's context (``Ctx``), and gives ``compile_protocol`` the ``move`` /
``coupling`` callables and the protocol's own effect and guard handlers, all
acting on the scratch world. No component moves except through these.

The roles, effects and guards of the request lifecycle (``scope.LIFE_SCOPE``)
are the lifecycle model's: here a move of such a role is a no-op, and so is
such an effect inside an operation this model runs (its steps carry no
events: ``apply_events`` applies none, ``record_saved`` records no tenure).
``scope.check_coverage`` proves the lifecycle model reads each of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from omni_prefix_cache.specs.compiled import CompiledMachine, compile_machine
from omni_prefix_cache.specs.composition import Do, Fire, ProtocolSpec, ProtocolViolation
from omni_prefix_cache.specs.loader import MachineSpec, SpecError
from omni_prefix_cache.testing.modelcheck.facts import ModelFacts
from omni_prefix_cache.testing.modelcheck.scope import WRITE_SCOPE
from omni_prefix_cache.testing.modelcheck.world import (
    DEF,
    DEFQ,
    IMM,
    REJECTS,
    STEP,
    TASK,
    Bounds,
    Ctx,
    Read,
    Task,
    Violation,
    nothing,
    rep,
)

# Protocol effects that change nothing in the model's world (rows are abstract).
NO_OPS = frozenset({"copy_to_host", "pool_write", "fetch_rows", "merge_outputs"})
REQUIRED_ROLES = ("task", "position", "task_holder", "step_holder", "step", "slot", "read")


def _always(c: Any) -> bool:
    return True


class _Role:
    """How the model finds a role's instances in a context and reads and
    writes their state (one compiled machine per role)."""

    def __init__(
        self,
        machine: CompiledMachine,
        instances: Callable[[Ctx, str], list[Any]],
        get: Callable[[Ctx, Any], int],
        put: Callable[[Ctx, Any, int, str], None],
        focus: Callable[[Ctx, Any, str], None],
    ):
        self.machine, self.instances, self.get, self.put, self.focus = machine, instances, get, put, focus


class ModelBinding:
    """The protocol's binding over the model's scratch world (``Ctx``).

    Built once per model: compiles ``spec``'s component machines with the
    handlers below (``m``, and what they mean: ``facts``). ``move`` and
    ``coupling`` are the ``specs.composition.Binding`` calls;
    ``effects()`` and ``guards`` are the protocol's own handlers. Raises
    SpecError for a spec that lacks a role the model needs.
    """

    def __init__(self, bounds: Bounds, spec: ProtocolSpec):
        self.bounds = bounds
        self.spec = spec
        for role in REQUIRED_ROLES:
            if role not in spec.components:
                raise SpecError(f"{spec.origin}: the model needs component role {role!r}")
        self._link_fires: dict[tuple[str, str], Callable[[Any], None]] = {}
        handlers = self._machine_handlers()
        # Only the write path's machines: the lifecycle's are the lifecycle model's.
        self.m: Mapping[str, CompiledMachine] = {
            role: self._compile(m, handlers) for role, m in spec.components.items() if role in WRITE_SCOPE.roles
        }
        self.f = ModelFacts(spec, self.m, bounds.keys)
        self.roles = self._roles()
        self._required = {
            (s.role, s.trigger) for op in spec.operations for s in op.walk() if isinstance(s, Fire) and not s.optional
        }
        self.guards = self._guards()

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
            "set_owner": lambda c: self._set_slot(c, owner=c.cur_tid, stale=False, rejected=False),
            "clear_owner": lambda c: self._set_slot(c, owner=-1),
            "reassign_from_old_owner": self._reassign_from_old_owner,
            "bump_version": lambda c: self._set_slot(c, version=c.slots[c.cur_slot].version + 1),
            "written_by_step": lambda c: c.slots[c.cur_slot].writer == c.sid,
            "stamp_writer": lambda c: self._set_slot(c, writer=c.sid),
            "clear_writer": lambda c: self._set_slot(c, writer=-1),
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

    def _run_link(self, role: str, trigger: str, c: Ctx) -> None:
        fire = self._link_fires.get((role, trigger))
        if fire is None:
            fire = self._link_fires[(role, trigger)] = self.move(role, trigger)[1]
        saved = c.link_slot, c.cur_tid, c.cur_slot
        c.link_slot = c.cur_slot
        fire(c)
        c.link_slot, c.cur_tid, c.cur_slot = saved

    @staticmethod
    def _set_task(c: Ctx, tid: int, **kw: Any) -> None:
        c.tasks[tid] = rep(c.tasks[tid], **kw)

    @staticmethod
    def _set_slot(c: Ctx, **kw: Any) -> None:
        c.slots[c.cur_slot] = rep(c.slots[c.cur_slot], **kw)

    @staticmethod
    def _set_read(c: Ctx, rid: int, **kw: Any) -> None:
        c.reads[rid] = rep(c.reads[rid], **kw)

    def _put_step(self, c: Ctx, sid: int, dest: int, trigger: str) -> None:
        c.steps[sid] = rep(c.steps[sid], state=dest)
        if c.kind == REJECTS and trigger in ("materialize", "discard"):
            # Ghost, whatever the spec moves: the step's rows it still holds are rejected drafts now,
            # and so is what a live read planned on one of them would serve.
            for cell in c.steps[sid].cells:
                if c.slots[cell].writer == sid:
                    c.slots[cell] = rep(c.slots[cell], rejected=True)
                    for rid, r in enumerate(c.reads):
                        if r.slot == cell and r.state not in self.f.read_final and r.version == c.slots[cell].version:
                            self._set_read(c, rid, rejected=True)

    def _reassign_from_old_owner(self, c: Ctx) -> None:
        old = c.slots[c.cur_slot].owner
        if old >= 0 and old != c.cur_tid:
            prev = c.tasks[old].reassigned
            self._set_task(c, old, reassigned=tuple(sorted({*prev, c.cur_slot})))

    # ------------------------------------------------------------ roles
    def _roles(self) -> dict[str, _Role]:
        m = self.m

        def one_task(c: Ctx, trigger: str) -> list[Any]:
            return [c.tid] if c.tid >= 0 else []

        def focus_task(c: Ctx, i: Any, trigger: str) -> None:
            c.cur_tid = i

        def put_task(c: Ctx, i: Any, dest: int, trigger: str) -> None:
            self._set_task(c, i, state=dest)
            if trigger == "claim_copy":
                self._set_task(c, i, claims=c.tasks[i].claims + 1)

        def put_position(c: Ctx, i: Any, dest: int, trigger: str) -> None:
            was = c.tasks[i].position
            self._set_task(c, i, position=dest)
            self._queue(c, i, trigger, was, dest)

        def holder_page(c: Ctx, holder: tuple[int, int], trigger: str) -> int:
            kind, ident = holder
            if kind == STEP:
                st = c.steps[ident]
                if st.holder == self.f.held:
                    return st.page
                return next((p for p, busy in enumerate(c.pages) if not busy), -1)
            t = c.tasks[ident]
            if t.holder == self.f.held:
                return t.page
            return c.steps[t.step].page if t.step >= 0 else -1

        def focus_task_holder(c: Ctx, i: Any, trigger: str) -> None:
            c.cur_tid, c.cur_holder = i, (TASK, i)
            c.cur_page = holder_page(c, (TASK, i), trigger)

        def focus_step_holder(c: Ctx, i: Any, trigger: str) -> None:
            c.cur_holder = (STEP, i)
            c.cur_page = holder_page(c, (STEP, i), trigger)

        def put_holder(c: Ctx, holder: tuple[int, int], dest: int) -> None:
            page = c.cur_page
            if dest == self.f.held:
                c.pages[page] = c.pages[page] | {holder}
            else:
                c.pages[page] = c.pages[page] - {holder}
            new_page = page if dest == self.f.held else -1
            kind, ident = holder
            if kind == STEP:
                c.steps[ident] = rep(c.steps[ident], holder=dest, page=new_page)
            else:
                self._set_task(c, ident, holder=dest, page=new_page)

        def one_step(c: Ctx, trigger: str) -> list[Any]:
            return [c.sid] if c.sid >= 0 else []

        def slot_instances(c: Ctx, trigger: str) -> list[Any]:
            if trigger == "commit":
                return c.commit_pairs
            if trigger == "drop":
                return c.drop_pairs
            if trigger == "reject":  # a materialize or discard whose step's rows were rejected drafts
                return [(cell, -1) for cell in c.steps[c.sid].cells] if c.kind == REJECTS and c.sid >= 0 else []
            return []  # map / reset: the take_tenancy coupling names its slots

        def focus_slot(c: Ctx, i: Any, trigger: str) -> None:
            c.cur_slot, c.cur_tid = i

        def put_slot(c: Ctx, i: Any, dest: int, trigger: str) -> None:
            # A cell back at its initial state holds no rows, stale or not.
            cell = c.slots[i[0]]
            absent = dest == self.f.ABSENT
            c.slots[i[0]] = rep(
                cell, state=dest, stale=cell.stale and not absent, rejected=cell.rejected and not absent
            )

        def read_instances(c: Ctx, trigger: str) -> list[Any]:
            if c.link_slot >= 0:
                return [i for i, r in enumerate(c.reads) if r.slot == c.link_slot and r.state not in self.f.read_final]
            if c.rid >= 0:
                return [c.rid]
            return [i for i, r in enumerate(c.reads) if r.step == c.sid and r.state not in self.f.read_final]

        def focus_read(c: Ctx, i: Any, trigger: str) -> None:
            c.cur_read = i

        def put_read(c: Ctx, i: Any, dest: int, trigger: str) -> None:
            if c.reads[i].rejected and trigger == "serve":
                raise Violation(
                    "slot_occupancy.rejected_never_served",
                    f"a planned read of {self.f.cell(c.reads[i].slot)} is served after its row was rejected",
                )
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
                self._put_step,
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

    def _queue(self, c: Ctx, tid: int, trigger: str, was: int, dest: int) -> None:
        where, how = self._QUEUE_OPS.get(trigger, (None, None))
        if how == "pop" or (was in (self.f.HIGH, self.f.LOW, self.f.STALE) and dest not in self.f.on_queue):
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
        if role not in self.roles:
            # A lifecycle role: the lifecycle model fires it (scope.check_coverage).
            return _always, nothing
        r = self.roles[role]
        machine = r.machine
        need_all = (role, trigger) in self._required

        def one(c: Ctx, inst: Any) -> Any:
            r.focus(c, inst, trigger)
            mv = machine.move(r.get(c, inst), trigger)
            if mv is None or not all(g(c) for g in mv.guards):
                return None
            return mv

        def enabled(c: Ctx) -> bool:
            insts = r.instances(c, trigger)
            if len(insts) == 1:
                return one(c, insts[0]) is not None
            if not insts:
                return True
            if need_all:
                return all(one(c, i) is not None for i in insts)
            return any(one(c, i) is not None for i in insts)

        def fire(c: Ctx) -> None:
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

        def run(c: Ctx) -> None:
            # The slot changes tenant: what its cells hold is the previous tenant's until rewritten.
            written = self._written(c)
            for cell in range(c.slot * K, c.slot * K + K):
                if c.slots[cell].state != self.f.ABSENT:
                    c.slots[cell] = rep(c.slots[cell], stale=True)
                (fire_on if cell in written else others)(c, (cell, c.tid))

        return run

    def _written(self, c: Ctx) -> tuple[int, ...]:
        """The cells a save writes: hidden, and the mm keys in its mask."""
        K = self.bounds.keys
        return tuple(c.slot * K + k for k in range(K) if k == 0 or c.keys >> (k - 1) & 1)

    def _instance_move(self, role: str, trigger: str) -> Callable[[Ctx, Any], None]:
        r = self.roles[role]

        def run(c: Ctx, inst: Any) -> None:
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
    def effects(self) -> dict[str, Callable[[Any], None]]:
        def outside(name: str) -> Callable[[Any], None]:
            def run(c: Any) -> None:
                raise Violation("model.outside", f"effect {name} ran; the model leaves it out (see modelcheck)")

            return run

        # Rows are abstract: a copy's or a pool write's outcome is where a failure is
        # injected, and a fetch's version check is rows_fetched, under the state lock.
        no_ops: dict[str, Callable[[Any], None]] = {name: nothing for name in NO_OPS}
        # The lifecycle's effects: no-ops in an operation this model runs (its steps carry
        # no events and record no tenure), outside in one it never starts.
        ops = [op for op in self.spec.operations if op.name in WRITE_SCOPE.runs]
        runs = {s.effect for op in ops for s in op.walk() if isinstance(s, Do)}
        for name in self.spec.effect_names - WRITE_SCOPE.effects - NO_OPS:
            no_ops[name] = nothing if name in runs else outside(name)
        self.no_op_effects = frozenset(name for name, run in no_ops.items() if run is nothing)
        return no_ops | {
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
            "wake_committer": lambda c: setattr(c, "awake", True),
            "plan_hits": self._plan_hits,
            # Reads plan committed slots of earlier steps; a same-step hit is not modelled.
            "dispatch_inline": outside("dispatch_inline"),
            "flush_oldest": outside("flush_oldest"),
            "close_staging": outside("close_staging"),
            "drain_queues": outside("drain_queues"),
            "replan_same_step_hits": nothing,
        }

    def _guards(self) -> dict[str, Callable[[Any], bool]]:
        def outside(name: str) -> Callable[[Any], bool]:
            def read(c: Any) -> bool:
                raise Violation("model.outside", f"guard {name} was read; it is the lifecycle model's")

            return read

        lifecycle = {name: outside(name) for name in self.spec.guard_names - WRITE_SCOPE.guards}
        return (
            lifecycle
            | {name: (lambda c, v=value: v) for name, value in WRITE_SCOPE.assumed.items()}
            | {
                "immediate": lambda c: c.kind == IMM,
                "queued_at_submit": lambda c: c.kind == DEFQ,
                "open_write_accepts": self._open_write_accepts,
                "task_failed": lambda c: c.tasks[c.tid].state == self.f.FAILED,
                "failures_drained": lambda c: c.found_failures,
                "rows_planned": lambda c: c.slots[c.slot].state in (self.f.IN_TRANSIT, self.f.COMMITTED),
                "rows_fetched": self._rows_fetched,
            }
        )

    def _open_write_accepts(self, c: Ctx) -> bool:
        # Only a plain deferred save appends (a queued one would be pushed again).
        if c.kind != DEF:
            return False
        for tid, t in enumerate(c.tasks):
            taken = any(cell in t.reassigned for cell in self._written(c))
            if t.req == c.req and t.sched == DEF and t.state in self.f.accepts and not taken:
                c.target = tid
        return c.target >= 0

    def _register_task(self, c: Ctx) -> None:
        tid = len(c.tasks)
        c.tasks.append(
            Task(
                state=int(self.m["task"].initial),
                position=int(self.m["position"].initial),
                holder=self.f.unheld,
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

    def _append_chunk(self, c: Ctx) -> None:
        tid = c.target
        t = c.tasks[tid]
        if t.state not in self.f.accepts:
            raise Violation("write_task.append_only_before_copy", f"append to task {tid} in {self.f.T(t.state).name}")
        cells = tuple(sorted({*t.slots, *self._written(c)}))
        self._set_task(c, tid, slots=cells, pins=(*t.pins, c.sid), clone=True)
        c.tid = tid
        self._pin(c, tid)

    def _pin(self, c: Ctx, tid: int) -> None:
        st = c.steps[c.sid]
        c.steps[c.sid] = rep(
            st, tids=tuple(sorted({*st.tids, tid})), cells=tuple(sorted({*st.cells, *self._written(c)}))
        )

    def _charge_budget(self, c: Ctx) -> None:
        c.steps[c.sid] = rep(c.steps[c.sid], charged=1)
        c.staged += 1

    def _refund_unpinned(self, c: Ctx) -> None:
        st = c.steps[c.sid]
        if not st.tids and not st.freed:
            c.staged -= st.charged
            c.steps[c.sid] = rep(st, freed=True)

    def _unpin_budget(self, c: Ctx) -> None:
        """Leave the task's tickets; a ticket uncharges once, when its last task leaves."""
        tid = c.tid
        for sid in c.tasks[tid].pins:
            st = c.steps[sid]
            tids = tuple(x for x in st.tids if x != tid)
            freed = st.freed
            if not tids and not freed:
                c.staged -= st.charged
                freed = True
            c.steps[sid] = rep(st, tids=tids, freed=freed)

    def _wake_failed(self, c: Ctx) -> None:
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

    def _take_records(self, c: Ctx) -> None:
        for tid in c.completed:
            c.commit_pairs.extend((s, tid) for s in c.tasks[tid].slots)
        for tid in c.failed:
            c.drop_pairs.extend((s, tid) for s in c.tasks[tid].slots)
        for tid in (*c.completed, *c.failed):
            self._set_task(c, tid, drained=True)
        if c.failed:
            c.failures_drained = c.found_failures = True
        c.completed, c.failed = [], []

    def _plan_hits(self, c: Ctx) -> None:
        cell = c.slots[c.slot]
        c.reads.append(Read(int(self.m["read"].initial), c.slot, cell.version, False, c.sid, cell.rejected))
        c.rid = len(c.reads) - 1

    def _rows_fetched(self, c: Ctx) -> bool:
        for r in c.reads:
            if r.step == c.sid and r.state not in self.f.read_final:
                if c.slots[r.slot].version != r.version and not r.preserved:
                    return False
        return True
