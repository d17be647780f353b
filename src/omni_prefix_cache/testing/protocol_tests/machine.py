"""``ProtocolMachine``: the protocol tests' drivers over the real runtime.

A manager with the manual committer and a lazy prefetch executor
(``serving_model.racing_manager``), the seams a run instruments (joins,
registrations, escalations, injected failures, a prefetch paused at its
version check), and one ``drive_<rule>`` method per driver rule: each
plays a step of the engine's workload or a protocol operation and records
what the checkers (``checks.ProtocolChecks``) and the row oracle need.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheSchedulerAdapter
from omni_prefix_cache.controller import TaskState, WriteChunk, WriteTask
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, WriteSchedule
from omni_prefix_cache.manager import PREFETCH_THREAD_PREFIX
from omni_prefix_cache.specs.composition import ProtocolSpec
from omni_prefix_cache.specs.types.copy_queue import QueuePosition
from omni_prefix_cache.testing.protocol_tests.checks import ProtocolChecks
from omni_prefix_cache.testing.protocol_tests.consumers import Desk, marks
from omni_prefix_cache.testing.protocol_tests.draft_drivers import DraftDrivers
from omni_prefix_cache.testing.protocol_tests.life_drivers import LifecycleDrivers
from omni_prefix_cache.testing.protocol_tests.lifecycle import EventEngine, OracleTenure, TenureOracle, resumable
from omni_prefix_cache.testing.protocol_tests.workload import (
    BLOCK_SIZE,
    CAPACITY,
    CHECKERS,
    DEFERRED,
    DEPTH,
    IMMEDIATE,
    LEFTOVER,
    MAX_REQUESTS,
    NUM_BLOCKS,
    PREFIXES,
    SIDE_KEY,
    WIDTHS,
    Served,
    leftover_rows,
    sparse_rows,
)
from omni_prefix_cache.testing.serving_model import (
    PlannedStep,
    RecentFirstAllocator,
    ServingModel,
    racing_manager,
)
from omni_prefix_cache.testing.write_fakes import install_failing_stages, probe_joins
from omni_prefix_cache.writes.staging import StagingBufferHolder


class ProtocolMachine(DraftDrivers, LifecycleDrivers, RuleBasedStateMachine):
    """The drivers (``drive_<rule>``), over the real manager, and its
    checkers (``checks``); ``build_machine`` turns them into rules and
    invariants from the spec. Not a test on its own (no rules)."""

    EAGER = False
    SPEC: ProtocolSpec

    steps = Bundle("steps")

    def __init__(self) -> None:
        super().__init__()
        self.model = ServingModel(NUM_BLOCKS, BLOCK_SIZE, WIDTHS, PREFIXES)
        # Twelve deferred rows of GPU budget: some saves force flushes.
        self.mgr, self.prefetch = racing_manager(
            self.model,
            NUM_BLOCKS,
            eager=self.EAGER,
            committer="manual",
            capacity=CAPACITY,
            depth=DEPTH,
            deferred_key=DEFERRED,
            deferred_rows=12,
        )
        self.ctrl = self.mgr.components.controller
        self.mgr.components.pool.ensure_key(SIDE_KEY, torch.float32, 1)
        self.side_tids = itertools.count(-1, -1)  # never a tid the manager's ledger hands out
        self.escalated: set[int] = set()
        self.side_submitted = False
        self.pending: PlannedStep | None = None  # scheduled by new_step, not saved yet
        self.pending_absent: frozenset[str] = frozenset()
        self.expects: dict[int, tuple[PlannedStep, frozenset[str]]] = {}
        self.poison: dict[str, set[int]] = {"copy": set(), "write": set()}
        self.dead = False  # a facade entry raised the write failure
        self.max_tid = 0
        self.saves = 0
        self.violations: dict[str, list[str]] = {name: [] for name in CHECKERS}
        self.previous_immediate: list[int] = []
        self.prefetch_errors: list[str] = []
        self.paused: threading.Thread | None = None
        self.paused_reader: str | None = None
        self.paused_fut: Any = None
        self.at_seam, self.go = threading.Event(), threading.Event()
        # The request lifecycle: the engine's events, their oracle, the consumers.
        self.oracle = TenureOracle()
        self.engine = EventEngine(self.model, self.oracle)
        self.adapter = PrefixCacheSchedulerAdapter()
        self.desk = Desk(self.mgr, self.oracle, self.violations)
        self.step_tenures: dict[int, dict[str, OracleTenure]] = {}
        self.recovering: dict[str, int] = {}  # this step's RESUMED hits: where each must start
        self.recover_at: dict[int, dict[str, int]] = {}
        # Requests whose drafted step was materialized: rid -> (step, verified end, draft end, block ids),
        # and the last step that scheduled each request.
        self.drafted: dict[str, tuple[int, int, int, list[int]]] = {}
        self.last_sched: dict[str, int] = {}
        self.checks = ProtocolChecks(self)
        self._instrument()

    # ------------------------------------------------------------ seams

    def _instrument(self) -> None:
        ctrl, mgr, race = self.ctrl, self.mgr, self
        register_many, escalate = ctrl.register_many, ctrl.escalate

        def joining(tids: list[int], event_name: Any) -> None:
            # The join operation: never under the state lock; the joiner
            # steps the manual committer until the event fires.
            if mgr.components.state_lock.locked():
                race.violations["no_join_under_state_lock"].append(f"join({event_name}) of {list(tids)}")
            if not race.EAGER:
                for tid in tids:
                    task = ctrl.parts.registry.get(tid)
                    for _ in range(64):
                        if task is None or getattr(task, event_name).is_set() or not race._committer_unit():
                            break

        def registering(tasks: list[Any], queued: bool = True) -> None:
            for task in tasks:
                race._probe_done(task)
                race.max_tid = max(race.max_tid, task.tid)
            register_many(tasks, queued)

        def escalating(tids: list[int]) -> None:
            states = {
                QueuePosition(int(t.position)).name for tid in tids if (t := ctrl.parts.registry.get(tid)) is not None
            }
            event(f"escalate at positions {sorted(states)}")
            race.escalated.update(tids)
            escalate(tids)

        # Instance attributes shadow the methods; mutants patch the class.
        seams = {"register_many": registering, "escalate": escalating}
        for name, seam in seams.items():
            setattr(ctrl, name, seam)
        probe_joins(ctrl, joining)
        poison = self.poison
        install_failing_stages(
            ctrl, copy=lambda task: task.tid in poison["copy"], write=lambda task: task.tid in poison["write"]
        )
        self._install_fetch_seam()

    def _probe_done(self, task: Any) -> None:
        """release -> publish -> done, and the failure record before wakes:
        when ``done`` fires, the record is public and the page is free."""
        ctrl, tid, original = self.ctrl, task.tid, task.done.set
        out = self.violations["done_after_record"]

        def checked() -> None:
            if task.state is TaskState.FAILED and tid not in ctrl.parts.registry.failed:
                out.append(f"task {tid}: done fired before its failure record")
            if task.state is TaskState.WRITTEN and tid not in ctrl.parts.registry.completed:
                out.append(f"task {tid}: done fired before its completion record")
            if ctrl.parts.staging_pool.holds(StagingBufferHolder.for_task(tid)):
                out.append(f"task {tid}: done fired while it still holds its staging page")
            original()

        task.done.set = checked

    def _install_fetch_seam(self) -> None:
        """Let a rule hold a prefetch at its version check, just before it
        takes the reads lock: the one point of a fetch where another
        thread's reuse of its slots can interleave."""
        reads, race = self.mgr.components.reads, self
        real = reads.lock

        class SeamLock:
            def __enter__(self) -> SeamLock:
                caller = sys._getframe(1).f_code.co_name
                if threading.current_thread() is race.paused and caller == "ensure_not_overwritten":
                    race.at_seam.set()
                    race.go.wait(30)
                real.acquire()
                return self

            def __exit__(self, *exc: object) -> None:
                real.release()

            def acquire(self, *args: Any) -> bool:
                return real.acquire(*args)

            def release(self) -> None:
                real.release()

            def locked(self) -> bool:
                return real.locked()

        reads.lock = SeamLock()  # type: ignore[assignment]

    # ------------------------------------------------------------ helpers

    def _any_failed(self) -> bool:
        return any(t.state is TaskState.FAILED for t in list(self.ctrl.parts.registry.tasks.values()))

    def _facade(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A facade entry; after a drained write failure it must raise."""
        if self.dead:
            try:
                fn(*args)
            except OmniPrefixCacheUnmatchError as exc:
                if "write failed" not in str(exc):
                    raise
                return None
            self.violations["failure_is_sticky"].append(f"{getattr(fn, '__name__', fn)} ran after a failure")
            return None
        try:
            return fn(*args)
        except (OmniPrefixCacheUnmatchError, RuntimeError) as exc:
            if self._any_failed() or "injected" in str(exc):
                event("a write failure reached the facade")
                self.dead = True
                return None
            raise

    def _committer_unit(self) -> bool:
        """One committer operation (copy, else write, else claim): True if it moved."""
        try:
            if self.ctrl.queues.claimed:
                self.ctrl.parts.committer.copy()
                return True
            if self.ctrl.parts.committer.write():
                return True
            return self.ctrl.parts.committer.claim() is not None
        except Exception as exc:
            self.violations["committer_never_raises"].append(f"a committer step raised {exc!r}")
            return False

    def _resume_paused(self) -> None:
        if self.paused is None:
            return
        self.go.set()
        self.paused.join(30)
        alive, self.paused = self.paused.is_alive(), None
        if alive:
            self.prefetch_errors.append("a resumed prefetch did not finish")
            return
        ref = self.paused_fut.args[0]
        versions = self.mgr.components.occupancy.get_slot_status(ref.key).slot_version[ref.slots]
        if not torch.equal(versions, ref.planned_version):
            event("a paused prefetch's slots were reused before it resumed")
        fut = self.paused_fut
        exc = fut.exception() if fut.done() and not fut.cancelled() else None
        if exc is not None and not self._any_failed():
            self.prefetch_errors.append(f"a prefetch refused rows it planned, with no write failed: {exc}")

    def teardown(self) -> None:
        """shutdown: after every step is consumed and every request ended."""
        self._resume_paused()
        # The committer finishes what is queued (shutdown would do the same),
        # through the checked unit, so a raising stage is named, not a crash.
        for _ in range(256):
            if self.EAGER or not self._committer_unit():
                break
        self.checks.committer_never_raises()
        for rid in list(self.model.requests):
            self.model.end(rid)
        for sid in list(self.expects):
            self.mgr.discard_step(sid)
        self.expects.clear()
        self.mgr.shutdown()
        left = {t: task.state.name for t, task in self.ctrl.parts.registry.tasks.items() if not task.is_terminal}
        assert not left, f"unfinished tasks after shutdown: {left}"

    # ------------------------------------------------------------ workload

    @initialize(prefixes=st.lists(st.integers(0, 2), min_size=2, max_size=3), recent_first=st.booleans())
    def first_arrivals(self, prefixes: list[int], recent_first: bool) -> None:
        """Requests already waiting (prompts often shared), and which freed
        block the engine reuses first (recent first: a preempted request's
        block goes to an interim tenant, then back to it)."""
        if recent_first:
            self.model.alloc = RecentFirstAllocator(NUM_BLOCKS, BLOCK_SIZE)
        for prefix in prefixes:
            self.model.arrive(prefix, [21, 22][:prefix])

    def _arrivals(self, data: Any) -> None:
        """Requests (or identical pairs: the second hits blocks the first
        computes in the same step) arrive before a step; prompts share prefixes."""
        model = self.model
        least = 1 if len(model.requests) < 2 else 0
        for _ in range(data.draw(st.integers(least, 2), label="arrivals")):
            if len(model.requests) >= MAX_REQUESTS:
                return
            prefix = data.draw(st.integers(0, 2), label="prefix")
            tail = data.draw(st.lists(st.integers(20, 24), max_size=3), label="tail")
            for _ in range(2 if data.draw(st.booleans(), label="pair") else 1):
                model.arrive(prefix, tail)

    def drive_preempt(self, data: Any) -> None:
        """A running request is preempted: its blocks recycle (recent first,
        an interim tenant may take them); it resumes later, still live."""
        pool = [r.rid for r in self.model.running()]
        self.model.preempt(data.draw(st.sampled_from(sorted(pool)), label="preempt"))

    def drive_prefetch_run(self) -> None:
        """The prefetch thread runs the oldest waiting fetch."""
        self.prefetch.run_next()

    def drive_prefetch_pause(self) -> None:
        """The next prefetch runs on its own thread up to its version check
        and waits there; saves reusing its slots may run before it resumes."""
        fut = self.prefetch.pending.pop(0)
        self.paused_fut = fut
        self.paused_reader = getattr(fut.args[0], "req_id", None)
        self.at_seam.clear()
        self.go.clear()
        self.paused = threading.Thread(target=fut.run_now, name=f"{PREFETCH_THREAD_PREFIX}-race")
        self.paused.start()
        while self.paused.is_alive() and not self.at_seam.wait(0.05):
            pass
        if not self.at_seam.is_set():
            self._resume_paused()

    def drive_prefetch_resume(self) -> None:
        self._resume_paused()

    def drive_paused_reader_slots_reused(self, prefix: int, data: Any) -> None:
        """The paused reader aborts (its blocks go back to the free list), a
        new request arrives and the next step may place it on those blocks."""
        assert self.paused_reader is not None
        self.model.end(self.paused_reader)
        self.model.arrive(prefix, [23, 24, 20])
        if self.drive_new_step(data) is None:
            self.drive_save()

    def drive_interim_tenant(self, data: Any) -> list[int]:
        """A running request is preempted; an interim tenant takes its freed
        blocks (recent first) for one step and aborts; the request resumes
        onto them and rewrites rows its open deferred write already lost."""
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.model.running())), label="preempt")
        self.model.preempt(rid)
        tenant = self.model.arrive(data.draw(st.integers(0, 2), label="tenant prefix"), [24, 23])
        sids = [self.drive_new_step(data, admit_only=tenant)]
        if tenant in self.model.requests:
            self.model.end(tenant)
        self.drive_drain()
        if not self.dead:
            sids.append(self.drive_new_step(data, admit_only=rid))
        return [sid for sid in sids if sid is not None]

    # ------------------------------------------------------------ operations

    def drive_new_step(self, data: Any, admit_only: str | None = None) -> int | None:
        """new_step: the scheduler plans a step; the manager plans its hits."""
        draw = data.draw
        if admit_only is None:
            self._arrivals(data)
        waiting = resumable(self.model)  # preempted requests: admitted again, they are RESUMED
        # A pool key that is not token-major this step is a leftover: the
        # step's tenant does not write it (hits later get the baseline).
        absent = frozenset(draw(st.sampled_from([(), (), (IMMEDIATE,), (DEFERRED,)]), label="keys as leftovers"))

        def drafts(req: Any) -> tuple[int, int]:
            # Speculative decoding: a decoding request may carry drafts, the first k of them right.
            d = draw(st.integers(0, 3), label=f"drafts {req.rid}")
            return (d, draw(st.integers(0, d), label=f"accepted {req.rid}")) if d else (0, 0)

        planned = self.model.schedule(
            admit=lambda req: draw(st.integers(1, 6), label=f"admit {req.rid}") if admit_only in (None, req.rid) else 0,
            run=lambda req: draw(st.integers(1, 3), label=f"run {req.rid}"),
            capacity=CAPACITY,
            absent_keys=absent,
            drafts=drafts,
        )
        if planned is None:
            return None
        step = self.engine.step(planned.out, waiting)
        hits = self.announce(step)
        if not self.dead:
            resumed = {e.req_id for e in step.events if e.kind is PrefixCacheEventKind.RESUMED}
            self.recovering = {rid: start for rid, start in hits.items() if rid in resumed}
            planned.expects = [
                self.model.recovered(e, self.recovering[e.rid]) if e.rid in self.recovering else e
                for e in planned.expects
            ]
            self.pending, self.pending_absent = planned, absent
        if self.pending is not None and (
            admit_only is not None or draw(st.integers(0, 3), label="forward, then save at once") > 0
        ):
            # Mostly the engine saves right after its forward; otherwise the
            # save rule runs it later, after other threads' moves.
            return self.drive_save()
        return None

    def drive_save(self) -> int | None:
        """save (eager: with eager_run inline; a failing flush: abandon_save)."""
        planned, absent = self.pending, self.pending_absent
        self.pending = None
        if planned is None or self.dead:
            return None
        mm = dict(planned.mm, **{LEFTOVER: leftover_rows(planned.n)})
        mm.update({key: sparse_rows(planned.n, key) for key in absent})
        layout = self.adapter.build_write_layout(self.model.view, num_scheduled_tokens=planned.out.num_scheduled_tokens)
        sid = self._facade(
            lambda: self.mgr.save_outputs(
                planned.hidden, mm, num_tokens_unpadded=planned.n, num_tokens_padded=planned.n, write_layout=layout
            )
        )
        if sid is None:
            return None
        self.saved(int(sid), planned)
        self.last_sched.update(dict.fromkeys(planned.order, int(sid)))
        for tid in self.previous_immediate:
            task = self.ctrl.parts.registry.get(tid)
            if task is not None and not task.is_terminal:
                self.violations["save_waits_previous_writes"].append(
                    f"step {sid} mapped its slots while task {tid} of the previous step was {task.state.name}"
                )
        self.previous_immediate = list(self.mgr.components.ledger.previous_step_writes)
        self.expects[sid] = (planned, absent)
        self.saves += 1
        return int(sid)

    def drive_finish_or_abort(self, action: str, data: Any) -> None:
        """A request finishes after decoding or aborts (even mid-prefill);
        the facade entry announcing it escalates its unfinished writes."""
        model = self.model
        if action == "finish":
            pool = [r.rid for r in model.running() if r.computed > len(r.tokens) - 2 and len(r.tokens) > 4]
        else:
            pool = sorted(model.requests)
        if not pool or self.pending is not None:
            return
        rid = data.draw(st.sampled_from(sorted(pool)), label=action)
        model.end(rid)
        self.engine.kinds[rid] = PrefixCacheEventKind.FINISHED if action == "finish" else PrefixCacheEventKind.ABORTED
        self.drive_drain()

    def drive_drain(self, data: Any = None) -> None:
        """A facade entry with nothing scheduled: drains the records and
        announces finished requests. Meanwhile the client may take an output."""
        if data is not None and self.desk.inbox and not self.dead:
            self.drive_client(data)
        if self.pending is not None:
            return
        finished, self.model.finished_pending = self.model.finished_pending, set()
        self.announce(self.engine.entry(finished))

    def _committer_op(self, op: Callable[[], Any]) -> None:
        try:
            op()
        except Exception as exc:
            self.violations["committer_never_raises"].append(f"{getattr(op, '__name__', op)} raised {exc!r}")

    def drive_committer_claim(self) -> None:
        self._committer_op(self.ctrl.parts.committer.claim)

    def drive_committer_copy(self) -> None:
        self._committer_op(self.ctrl.parts.committer.copy)

    def drive_committer_write(self) -> None:
        self._committer_op(self.ctrl.parts.committer.write)

    def drive_inject_failure(self, where: str, data: Any) -> None:
        """Arm a copy or pool-write failure for a live task or one of the
        next tasks a save registers."""
        if self.dead:
            return
        alive = [t for t, task in list(self.ctrl.parts.registry.tasks.items()) if not task.is_terminal]
        future = list(range(self.max_tid + 1, self.max_tid + 4))
        self.poison[where].add(data.draw(st.sampled_from(sorted(alive) + future), label=f"fail {where}"))

    def drive_join(self, data: Any) -> None:
        """join a queued (or later) task from the engine thread."""
        joinable = [
            t for t, task in list(self.ctrl.parts.registry.tasks.items()) if task.state is not TaskState.PENDING
        ]
        if not joinable:
            return
        tid = data.draw(st.sampled_from(sorted(joinable)), label="join")
        try:
            self.ctrl.join([tid])
        except OmniPrefixCacheUnmatchError:
            # A failed task raises; a live one the committer cannot finish
            # times out (its position is what the invariants check).
            task = self.ctrl.parts.registry.get(tid)
            event("join raised: " + ("failed task" if task is not None and task.state is TaskState.FAILED else "stuck"))

    def drive_submit_queued(self, slot: int) -> None:
        """save's ``queued_at_submit`` branch, which the manager never takes:
        a deferred write registered and dispatched at once through the
        controller's public ``submit`` (as upstream callers do), on a side
        pool key the row oracle does not read."""
        tid = next(self.side_tids)
        self.side_submitted = True
        chunk = WriteChunk(slots_cpu=torch.tensor([slot]), tensors={SIDE_KEY: torch.full((1, 1), float(tid))})
        task = WriteTask(
            tid=tid, req_id=f"side{-tid}", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[chunk]
        )
        self.ctrl.submit(task, queued=True)

    def drive_materialize(self, sid: int | None, data: Any = None) -> None:
        """materialize (possibly lagged); the talker takes the output at
        once (``data`` None: views and acknowledges it), the client later."""
        if sid is None or sid not in self.expects:
            return
        self._resume_paused()  # materialize waits for its prefetches
        planned, absent = self.expects.pop(sid)
        accepted = planned.accepted or None  # the runner's len(sampled_token_ids[i]) of a drafted step
        try:
            outs = self._facade(lambda: self.mgr.materialize(sid, list(planned.order), accepted_rows=accepted))
        except OmniPrefixCacheUnmatchError as exc:
            raise AssertionError(f"row oracle: materialize(step {sid}) refused servable rows: {exc}") from exc
        if outs is not None:
            if planned.accepted:
                event("materialized a step with speculative drafts")
                self.drafted.update({rid: (sid, *where) for rid, where in planned.drafted.items()})
            # The row oracle before any consumer sees it (a consumer's view of rows past what was
            # saved would raise first, hiding what was served).
            self.checks.check_served(Served(sid, outs, planned, absent))
            self.delivered(sid, outs, planned, data)
            if (
                planned.accepted
                and data is not None
                and self.pending is None
                and not self.dead
                and len(self.expects) < DEPTH
                and self.model.alloc.can_allocate(1)
                and self.optimistic_candidates()
                and data.draw(st.booleans(), label="an optimistic resume right away")
            ):
                self.drive_optimistic_resume(data)

    def drive_discard(self, sid: int | None) -> None:
        if sid is None or sid not in self.expects:
            return
        planned, _ = self.expects.pop(sid)
        self.step_tenures.pop(sid, None)
        before = marks(self.oracle.every)
        # A drafted step's accepted rows on every other discard (without, every draft row is rejected).
        accepted = planned.accepted if planned.accepted and sid % 2 else None
        self.mgr.discard_step(sid, accepted_rows=accepted)  # works after a failure: it only releases
        self.desk.unmoved(before, "discard_is_not_delivery", f"discard_step({sid})")

    # ------------------------------------------------------------ checkers
