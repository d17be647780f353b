"""Hypothesis state machines generated from the composition spec
(``spec/protocol.yaml``), run against the real manager and controller.

``build_machine(spec, eager=...)`` makes one rule per driver of the spec's
operations (``DRIVERS`` is the one table mapping each operation to the rule
that starts it) and one ``@invariant()`` per name in
``spec.invariants_for("tests")`` (``CHECKERS`` binds each to a method of
that name). An operation without a driver, or an invariant without a
checker, is a build-time error, so the spec and the tests cannot drift.

The manager runs with ``committer="manual"``: the committer moves only when
a committer rule runs (``committer_claim``, ``committer_copy``,
``committer_write``) or when someone joins a task (the join operation: the
save barrier, a budget flush, a prefetch waiting for a pool write, or the
``join`` rule), in which case the joining thread steps the committer itself
until the task's event fires. Prefetches wait in a lazy executor until a
rule runs them (in order, or one paused at its version check on its own
thread while later saves reuse its slots: the copy-on-write race).

The row oracle is ``ServingModel``: a sequential engine that knows every
request's tokens and block table, so every materialized row and every
committed pool row is predicted with no cache at all (an mm key the slot's
tenant never wrote is the baseline, zeros). Its failures start with
"row oracle:".
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from omni_prefix_cache.controller import TaskState, WriteChunk, WriteTask
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheUnmatchError,
    WriteSchedule,
)
from omni_prefix_cache.manager import PREFETCH_THREAD_PREFIX
from omni_prefix_cache.specs.composition import ProtocolSpec, load_protocol
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.specs.types.copy_queue import QueuePosition
from omni_prefix_cache.steps.occupancy import SlotState
from omni_prefix_cache.testing.serving_model import (
    PlannedStep,
    RecentFirstAllocator,
    ServingModel,
    racing_manager,
)
from omni_prefix_cache.testing.write_fakes import install_failing_stages, probe_joins
from omni_prefix_cache.tools.simulate.rows import rows_from_hashes
from omni_prefix_cache.writes.staging import StagingBufferHolder

NUM_BLOCKS, BLOCK_SIZE, CAPACITY, DEPTH = 8, 2, 12, 3
IMMEDIATE, DEFERRED, LEFTOVER = "talker.h", "codes.audio", "codes.ref"
# A pool key only ``submit_queued`` writes (outside the row oracle's keys).
SIDE_KEY = "side.queued"
WIDTHS = {HIDDEN_KEY: 4, IMMEDIATE: 3, DEFERRED: 2}
PREFIXES = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
MAX_REQUESTS = 6
# Where a task's queue entry is, by its copy_queue position (one_queue_entry).
_ENTRY_OF: dict[str, tuple[str, ...]] = {
    "HIGH": ("high",),
    "LOW": ("low",),
    "STALE": ("high", "low"),
    "CLAIMED": ("claimed",),
    "BLOCKED": ("blocked",),
}

# Operation -> the rule that starts it. Several operations may share a rule
# (an eager save runs eager_run inline; a facade entry drains). "teardown"
# is the end of every run.
DRIVERS: dict[str, str] = {
    "new_step": "new_step",
    "save": "save",
    "abandon_save": "save",  # a save whose budget flush joins a failed write is abandoned
    "escalate": "finish_or_abort",  # escalated at the facade entry announcing the finish
    "committer_claim": "committer_claim",
    "committer_copy": "committer_copy",
    "committer_write": "committer_write",
    "eager_run": "save",  # eager: save, escalate and a budget flush run each write inline
    "fail": "inject_failure",  # an injected copy or pool-write failure of a live or next task
    "join": "join",  # also inside save (barrier, budget flush) and a prefetch of a queued write
    "drain": "drain",  # every facade entry drains; this rule is an entry with nothing scheduled
    "materialize": "materialize",  # possibly lagged: steps wait in a bundle
    "discard": "discard",
    "shutdown": "teardown",
}

# Rules for the engine's workload, not protocol operations.
WORKLOAD_RULES = (
    "preempt",
    "interim_tenant",
    "prefetch_run",
    "prefetch_pause",
    "prefetch_resume",
    "paused_reader_slots_reused",
    "submit_queued",
)

# Invariant name (spec/protocol.yaml, checked_by tests) -> checker method.
CHECKERS: dict[str, str] = {
    "position_matches_task": "position_matches_task",
    "one_queue_entry": "one_queue_entry",
    "done_after_record": "done_after_record",
    "staged_bytes": "staged_bytes",
    "task_views_step_page": "task_views_step_page",
    "copy_on_write": "copy_on_write",
    "failure_is_sticky": "failure_is_sticky",
    "save_waits_previous_writes": "save_waits_previous_writes",
    "queue_by_priority": "queue_by_priority",
    "committer_never_raises": "committer_never_raises",
    "no_join_under_state_lock": "no_join_under_state_lock",
    "rows_match_reference": "rows_match_reference",
}


@dataclass
class _Sched:
    scheduled_new_reqs: list[Any]
    finished_req_ids: set[str]
    num_scheduled_tokens: dict[str, int]


@dataclass
class _Served:
    sid: int
    outs: Any
    planned: PlannedStep
    absent: frozenset[str]


def _leftover(n: int) -> torch.Tensor:
    return torch.arange((n + 3) * 2, dtype=torch.float32).reshape(n + 3, 2)


def _sparse(n: int, key: str) -> torch.Tensor:
    """A pool key passed as a leftover (first dim not the token count)."""
    return -torch.arange((n + 3) * WIDTHS[key], dtype=torch.float32).reshape(n + 3, WIDTHS[key])


class ProtocolMachine(RuleBasedStateMachine):
    """The drivers and checkers; ``build_machine`` turns them into rules and
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
        self.ctrl = self.mgr._controller
        self.mgr._pool.ensure_key(SIDE_KEY, torch.float32, 1)
        self.side_tids = itertools.count(-1, -1)  # never a tid the manager's ledger hands out
        self.escalated: set[int] = set()
        self.side_submitted = False
        self.pending: PlannedStep | None = None  # scheduled by new_step, not saved yet
        self.pending_absent: frozenset[str] = frozenset()
        self.expects: dict[int, tuple[PlannedStep, frozenset[str]]] = {}
        self.served: list[_Served] = []
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
        self._instrument()

    # ------------------------------------------------------------ seams

    def _instrument(self) -> None:
        ctrl, mgr, race = self.ctrl, self.mgr, self
        register_many, escalate = ctrl.register_many, ctrl.escalate

        def joining(tids: list[int], event_name: Any) -> None:
            # The join operation: never under the state lock; the joiner
            # steps the manual committer until the event fires.
            if mgr._state_lock.locked():
                race.violations["no_join_under_state_lock"].append(f"join({event_name}) of {list(tids)}")
            if not race.EAGER:
                for tid in tids:
                    task = ctrl.get_task(tid)
                    for _ in range(64):
                        if task is None or getattr(task, event_name).is_set() or not race._committer_unit():
                            break

        def registering(tasks: list[Any], queued: bool = True) -> None:
            for task in tasks:
                race._probe_done(task)
                race.max_tid = max(race.max_tid, task.tid)
            register_many(tasks, queued)

        def escalating(tids: list[int]) -> None:
            states = {QueuePosition(int(t.position)).name for tid in tids if (t := ctrl.get_task(tid)) is not None}
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
            if task.state is TaskState.FAILED and tid not in ctrl._failed:
                out.append(f"task {tid}: done fired before its failure record")
            if task.state is TaskState.WRITTEN and tid not in ctrl._completed:
                out.append(f"task {tid}: done fired before its completion record")
            if ctrl._staging_pool.holds(StagingBufferHolder.for_task(tid)):
                out.append(f"task {tid}: done fired while it still holds its staging page")
            original()

        task.done.set = checked

    def _install_fetch_seam(self) -> None:
        """Let a rule hold a prefetch at its version check, just before it
        takes the reads lock: the one point of a fetch where another
        thread's reuse of its slots can interleave."""
        reads, race = self.mgr._reads, self
        real = reads.lock

        class SeamLock:
            def __enter__(self) -> SeamLock:
                caller = sys._getframe(1).f_code.co_name
                if threading.current_thread() is race.paused and caller == "ensure_not_reassigned":
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
        return any(t.state is TaskState.FAILED for t in list(self.ctrl._tasks.values()))

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
            if self.ctrl._claimed:
                self.ctrl.committer_copy()
                return True
            if self.ctrl.committer_write():
                return True
            return self.ctrl.committer_claim() is not None
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
        ref = self.paused_fut._job[1][0]
        versions = self.mgr._slot_status.get_slot_status(ref.key).slot_version[ref.slots]
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
        self.committer_never_raises()
        for rid in list(self.model.requests):
            self.model.end(rid)
        for sid in list(self.expects):
            self.mgr.discard_step(sid)
        self.expects.clear()
        self.mgr.shutdown()
        left = {t: task.state.name for t, task in self.ctrl._tasks.items() if not task.is_terminal}
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

    def _drive_preempt(self, data: Any) -> None:
        """A running request is preempted: its blocks recycle (recent first,
        an interim tenant may take them); it resumes later, still live."""
        pool = [r.rid for r in self.model.running()]
        self.model.preempt(data.draw(st.sampled_from(sorted(pool)), label="preempt"))

    def _drive_prefetch_run(self) -> None:
        """The prefetch thread runs the oldest waiting fetch."""
        self.prefetch.run_next()

    def _drive_prefetch_pause(self) -> None:
        """The next prefetch runs on its own thread up to its version check
        and waits there; saves reusing its slots may run before it resumes."""
        fut = self.prefetch.pending.pop(0)
        self.paused_fut = fut
        self.paused_reader = getattr(fut._job[1][0], "req_id", None)
        self.at_seam.clear()
        self.go.clear()
        self.paused = threading.Thread(target=fut.run_now, name=f"{PREFETCH_THREAD_PREFIX}-race")
        self.paused.start()
        while self.paused.is_alive() and not self.at_seam.wait(0.05):
            pass
        if not self.at_seam.is_set():
            self._resume_paused()

    def _drive_prefetch_resume(self) -> None:
        self._resume_paused()

    def _drive_paused_reader_slots_reused(self, prefix: int, data: Any) -> None:
        """The paused reader aborts (its blocks go back to the free list), a
        new request arrives and the next step may place it on those blocks."""
        assert self.paused_reader is not None
        self.model.end(self.paused_reader)
        self.model.arrive(prefix, [23, 24, 20])
        if self._drive_new_step(data) is None:
            self._drive_save()

    def _drive_interim_tenant(self, data: Any) -> list[int]:
        """A running request is preempted; an interim tenant takes its freed
        blocks (recent first) for one step and aborts; the request resumes
        onto them and rewrites rows its open deferred write already lost."""
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.model.running())), label="preempt")
        self.model.preempt(rid)
        tenant = self.model.arrive(data.draw(st.integers(0, 2), label="tenant prefix"), [24, 23])
        sids = [self._drive_new_step(data, admit_only=tenant)]
        if tenant in self.model.requests:
            self.model.end(tenant)
        self._drive_drain()
        if not self.dead:
            sids.append(self._drive_new_step(data, admit_only=rid))
        return [sid for sid in sids if sid is not None]

    # ------------------------------------------------------------ operations

    def _drive_new_step(self, data: Any, admit_only: str | None = None) -> int | None:
        """new_step: the scheduler plans a step; the manager plans its hits."""
        draw = data.draw
        if admit_only is None:
            self._arrivals(data)
        # A pool key that is not token-major this step is a leftover: the
        # step's tenant does not write it (hits later get the baseline).
        absent = frozenset(draw(st.sampled_from([(), (), (IMMEDIATE,), (DEFERRED,)]), label="keys as leftovers"))
        planned = self.model.schedule(
            admit=lambda req: draw(st.integers(1, 6), label=f"admit {req.rid}") if admit_only in (None, req.rid) else 0,
            run=lambda req: draw(st.integers(1, 3), label=f"run {req.rid}"),
            capacity=CAPACITY,
            absent_keys=absent,
        )
        if planned is None:
            return None
        self._facade(self.mgr.new_step_starts, planned.out)
        if not self.dead:
            self.pending, self.pending_absent = planned, absent
        if self.pending is not None and (
            admit_only is not None or draw(st.integers(0, 3), label="forward, then save at once") > 0
        ):
            # Mostly the engine saves right after its forward; otherwise the
            # save rule runs it later, after other threads' moves.
            return self._drive_save()
        return None

    def _drive_save(self) -> int | None:
        """save (eager: with eager_run inline; a failing flush: abandon_save)."""
        planned, absent = self.pending, self.pending_absent
        self.pending = None
        if planned is None or self.dead:
            return None
        mm = dict(planned.mm, **{LEFTOVER: _leftover(planned.n)})
        mm.update({key: _sparse(planned.n, key) for key in absent})
        sid = self._facade(
            lambda: self.mgr.save_outputs(
                planned.hidden, mm, num_tokens_unpadded=planned.n, num_tokens_padded=planned.n
            )
        )
        if sid is None:
            return None
        for tid in self.previous_immediate:
            task = self.ctrl.get_task(tid)
            if task is not None and not task.is_terminal:
                self.violations["save_waits_previous_writes"].append(
                    f"step {sid} mapped its slots while task {tid} of the previous step was {task.state.name}"
                )
        self.previous_immediate = list(self.mgr._ledger.previous_step_writes)
        self.expects[sid] = (planned, absent)
        self.saves += 1
        return int(sid)

    def _drive_finish_or_abort(self, action: str, data: Any) -> None:
        """A request finishes after decoding or aborts (even mid-prefill);
        the facade entry announcing it escalates its unfinished writes."""
        model = self.model
        if action == "finish":
            pool = [r.rid for r in model.running() if r.computed > len(r.tokens) - 2 and len(r.tokens) > 4]
        else:
            pool = sorted(model.requests)
        if not pool or self.pending is not None:
            return
        model.end(data.draw(st.sampled_from(sorted(pool)), label=action))
        self._drive_drain()

    def _drive_drain(self) -> None:
        """A facade entry with nothing scheduled: drains the records and
        announces finished requests."""
        if self.pending is not None:
            return
        finished, self.model.finished_pending = self.model.finished_pending, set()
        self._facade(self.mgr.new_step_starts, _Sched([], finished, {}))

    def _committer_op(self, op: Callable[[], Any]) -> None:
        try:
            op()
        except Exception as exc:
            self.violations["committer_never_raises"].append(f"{getattr(op, '__name__', op)} raised {exc!r}")

    def _drive_committer_claim(self) -> None:
        self._committer_op(self.ctrl.committer_claim)

    def _drive_committer_copy(self) -> None:
        self._committer_op(self.ctrl.committer_copy)

    def _drive_committer_write(self) -> None:
        self._committer_op(self.ctrl.committer_write)

    def _drive_inject_failure(self, where: str, data: Any) -> None:
        """Arm a copy or pool-write failure for a live task or one of the
        next tasks a save registers."""
        if self.dead:
            return
        alive = [t for t, task in list(self.ctrl._tasks.items()) if not task.is_terminal]
        future = list(range(self.max_tid + 1, self.max_tid + 4))
        self.poison[where].add(data.draw(st.sampled_from(sorted(alive) + future), label=f"fail {where}"))

    def _drive_join(self, data: Any) -> None:
        """join a queued (or later) task from the engine thread."""
        joinable = [t for t, task in list(self.ctrl._tasks.items()) if task.state is not TaskState.PENDING]
        if not joinable:
            return
        tid = data.draw(st.sampled_from(sorted(joinable)), label="join")
        try:
            self.ctrl.join([tid])
        except OmniPrefixCacheUnmatchError:
            # A failed task raises; a live one the committer cannot finish
            # times out (its position is what the invariants check).
            task = self.ctrl.get_task(tid)
            event("join raised: " + ("failed task" if task is not None and task.state is TaskState.FAILED else "stuck"))

    def _drive_submit_queued(self, slot: int) -> None:
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

    def _drive_materialize(self, sid: int | None) -> None:
        if sid is None or sid not in self.expects:
            return
        self._resume_paused()  # materialize waits for its prefetches
        planned, absent = self.expects.pop(sid)
        try:
            outs = self._facade(self.mgr.materialize, sid, list(planned.order))
        except OmniPrefixCacheUnmatchError as exc:
            raise AssertionError(f"row oracle: materialize(step {sid}) refused servable rows: {exc}") from exc
        if outs is not None:
            self.served.append(_Served(sid, outs, planned, absent))

    def _drive_discard(self, sid: int | None) -> None:
        if sid is None or sid not in self.expects:
            return
        self.expects.pop(sid)
        self.mgr.discard_step(sid)  # works after a failure: it only releases

    # ------------------------------------------------------------ checkers

    def position_matches_task(self) -> None:
        """Every task's copy_queue state (``task.position``, the runtime's
        own) and its task state form a pair the spec's ``pairs`` lists."""
        pairs = self.SPEC.pairs
        for tid, task in list(self.ctrl._tasks.items()):
            pos = QueuePosition(int(task.position)).name
            assert task.state.name in pairs[pos], (
                f"task {tid} is {task.state.name} at queue position {pos} (pairs allow {list(pairs[pos])})"
            )

    def one_queue_entry(self) -> None:
        """A task is on at most one queue or list, once, and that entry is
        the one its position names (HIGH/LOW/STALE: a copy queue; CLAIMED:
        claimed; BLOCKED: blocked; any other position: none)."""
        queues = self.ctrl.queues
        lists = {"high": queues.high, "low": queues.low, "claimed": queues.claimed, "blocked": queues.blocked}
        entries = [tid for box in lists.values() for tid in box]
        twice = sorted({t for t in entries if entries.count(t) > 1})
        assert not twice, f"tasks {twice} on more than one queue entry: " + ", ".join(
            f"{name}={list(box)}" for name, box in lists.items()
        )
        where = {tid: name for name, box in lists.items() for tid in box}
        for tid, task in list(self.ctrl._tasks.items()):
            pos = QueuePosition(int(task.position)).name
            allowed = _ENTRY_OF.get(pos, ())
            got = where.get(tid)
            assert (got in allowed) if allowed else got is None, (
                f"task {tid} at position {pos} has queue entry {got or 'none'} (expected {allowed or 'none'})"
            )
        unknown = sorted(t for t in where if t not in self.ctrl._tasks)
        assert not unknown, f"queue entries {unknown} name no registered task"

    def done_after_record(self) -> None:
        assert not self.violations["done_after_record"], self.violations["done_after_record"]

    def staged_bytes(self) -> None:
        tickets = {id(c.budget): c.budget for t in list(self.ctrl._tasks.values()) for c in t.chunks if c.budget}
        live = sum(t.nbytes for t in tickets.values() if not t.freed)
        assert self.ctrl._staged_bytes == live, f"budget counter {self.ctrl._staged_bytes} != live clone bytes {live}"

    def task_views_step_page(self) -> None:
        pool = self.ctrl._staging_pool
        for page, holders in enumerate(pool._busy):
            kinds = {h.kind for h in holders}
            steps = {h.owner_id for h in holders if h.kind == "step"}
            for h in holders:
                if h.kind == "task":
                    task = self.ctrl.get_task(h.owner_id)
                    assert task is not None and not task.is_terminal, f"task {h.owner_id} holds page {page} after done"
                    assert task.staging_slot == page, f"task {h.owner_id} holds page {page}, views {task.staging_slot}"
            assert steps <= set(self.mgr._step_ctxs), f"page {page} held by consumed steps {steps}"
            assert kinds <= {"step", "task"}, kinds
        held = {h.owner_id for page in pool._busy for h in page if h.kind == "step"}
        assert held == set(self.mgr._step_ctxs), f"step holders {held} != live steps {set(self.mgr._step_ctxs)}"

    def copy_on_write(self) -> None:
        status = self.mgr._slot_status
        for ref in list(self.mgr._reads.pending):
            if not status.has_key(ref.key):
                continue
            current = status.get_slot_status(ref.key).slot_version.index_select(0, ref.slots)
            changed = current != ref.planned_version
            for part in ref.staged_list:  # served from the task itself, not the pool
                changed[part.positions] = False
            lost = [s for s in ref.slots[changed].tolist() if s not in ref.preserved]
            assert not lost, f"planned read of {ref.req_id} {ref.key}: slots {lost} were reused with no preserved copy"

    def failure_is_sticky(self) -> None:
        assert not self.violations["failure_is_sticky"], self.violations["failure_is_sticky"]
        drained = [t for t, task in list(self.ctrl._tasks.items()) if task.state is TaskState.FAILED]
        drained = [t for t in drained if t not in self.ctrl._failed]
        if drained:
            try:
                self.mgr.new_step_starts(_Sched([], set(), {}))
            except OmniPrefixCacheUnmatchError as exc:
                assert "write failed" in str(exc), exc
                self.dead = True
                return
            raise AssertionError(f"failed writes {drained} were drained, yet a facade entry did not raise")

    def save_waits_previous_writes(self) -> None:
        assert not self.violations["save_waits_previous_writes"], self.violations["save_waits_previous_writes"]

    def queue_by_priority(self) -> None:
        for tid, task in list(self.ctrl._tasks.items()):
            pos = QueuePosition(int(task.position))
            immediate = task.schedule is WriteSchedule.JOIN_NEXT_STEP
            if pos is QueuePosition.HIGH:
                assert immediate or tid in self.escalated, f"deferred task {tid} is on the high queue, never escalated"
            elif pos is QueuePosition.LOW:
                assert not immediate and tid not in self.escalated, (
                    f"task {tid} ({task.schedule.value}, escalated: {tid in self.escalated}) is on the low queue"
                )

    def committer_never_raises(self) -> None:
        assert not self.violations["committer_never_raises"], self.violations["committer_never_raises"]

    def no_join_under_state_lock(self) -> None:
        assert not self.violations["no_join_under_state_lock"], self.violations["no_join_under_state_lock"]

    def rows_match_reference(self) -> None:
        errors, self.prefetch_errors = self.prefetch_errors, []
        assert not errors, f"row oracle: {errors}"
        served, self.served = self.served, []
        for item in served:
            self._check_served(item)
        if not self.dead and self.pending is None and self.paused is None:
            self._check_committed_rows()

    def _check_served(self, item: _Served) -> None:
        sid, outs, planned = item.sid, item.outs, item.planned
        for exp in planned.expects:
            for key in WIDTHS:
                got = outs.hidden_states[exp.rid] if key == HIDDEN_KEY else outs.mm_outputs[key][exp.rid]
                want = _sparse(planned.n, key) if key in item.absent else self.model.expected_rows(exp, key)
                assert got.shape == want.shape, f"row oracle: step {sid} req {exp.rid} key {key}: {tuple(got.shape)}"
                assert torch.equal(got, want), (
                    f"row oracle: step {sid} req {exp.rid} key {key} rows [{exp.start},{exp.end}) differ"
                )
            assert torch.equal(outs.mm_outputs[LEFTOVER][exp.rid], _leftover(planned.n)), (
                f"row oracle: step {sid} req {exp.rid} leftover"
            )
            event("materialized a prefix hit" if exp.hit else "materialized a step's own rows")

    def _check_committed_rows(self) -> None:
        """Every cached block's COMMITTED rows are its content's rows, and an
        mm key its tenant never wrote is ABSENT there (never an older
        tenant's rows behind a hash a later request could hit)."""
        status = self.mgr._slot_status
        for block, hashes in sorted(self.model.cached_blocks().items()):
            slots = torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            for key, width in WIDTHS.items():
                if not status.has_key(key):
                    continue
                state = status.state[key][slots]
                absent = torch.zeros(BLOCK_SIZE, dtype=torch.bool)
                if key != HIDDEN_KEY:
                    absent = self.model.absent_slots(key, slots)
                    stale = absent & (state == int(SlotState.COMMITTED))
                    assert not bool(stale.any()), (
                        f"row oracle: block {block} key {key}: slots {slots[stale].tolist()} its tenant never wrote "
                        "are COMMITTED (an older tenant's rows would be served)"
                    )
                committed = (state == int(SlotState.COMMITTED)) & ~absent
                if bool(committed.any()):
                    want = rows_from_hashes(hashes, key, width, torch.float32)
                    got = self.mgr._pool.rows(key, slots)
                    assert torch.equal(got[committed], want[committed]), (
                        f"row oracle: block {block} key {key}: committed pool rows at slots "
                        f"{slots[committed].tolist()} differ from the block's content"
                    )


# ---------------------------------------------------------------- building


def _rule_defs(eager: bool) -> dict[str, Callable[[type[ProtocolMachine]], Any]]:
    """Rule name -> a factory making the Hypothesis rule on the class."""
    steps = ProtocolMachine.steps

    def plain(name: str, pre: Callable[[Any], bool] | None = None, **strategies: Any) -> Any:
        def make(cls: type[ProtocolMachine]) -> Any:
            driver: Callable[..., Any] = getattr(cls, f"_drive_{name}")

            def run(self: Any, **kw: Any) -> Any:
                return driver(self, **kw)

            run.__name__ = run.__qualname__ = name
            run.__doc__ = driver.__doc__
            as_rule: Callable[[Any], Any] = rule(**strategies)
            out = as_rule(run)
            return precondition(pre)(out) if pre is not None else out

        return make

    def new_step_rule(cls: type[ProtocolMachine]) -> Any:
        def new_step(self: Any, data: Any) -> Any:
            sid = self._drive_new_step(data)
            return multiple() if sid is None else sid

        new_step.__doc__ = ProtocolMachine._drive_new_step.__doc__
        ready = precondition(lambda self: self.pending is None and len(self.expects) < DEPTH)
        return ready(rule(target=steps, data=st.data())(new_step))

    def interim_tenant_rule(cls: type[ProtocolMachine]) -> Any:
        def interim_tenant(self: Any, data: Any) -> Any:
            return multiple(*self._drive_interim_tenant(data))

        interim_tenant.__doc__ = ProtocolMachine._drive_interim_tenant.__doc__
        ready = precondition(
            lambda self: (
                self.pending is None
                and len(self.expects) <= DEPTH - 2
                and isinstance(self.model.alloc, RecentFirstAllocator)
                and bool(self.model.running())
                and len(self.model.requests) < MAX_REQUESTS
            )
        )
        return ready(rule(target=steps, data=st.data())(interim_tenant))

    def save_rule(cls: type[ProtocolMachine]) -> Any:
        def save(self: Any) -> Any:
            sid = self._drive_save()
            return multiple() if sid is None else sid

        save.__doc__ = ProtocolMachine._drive_save.__doc__
        return precondition(lambda self: self.pending is not None)(rule(target=steps)(save))

    def consume(name: str) -> Any:
        def make(cls: type[ProtocolMachine]) -> Any:
            driver = getattr(cls, f"_drive_{name}")

            def run(self: Any, sid: Any) -> None:
                driver(self, sid)

            run.__name__ = run.__qualname__ = name
            return rule(sid=consumes(steps))(run)

        return make

    return {
        "new_step": new_step_rule,
        "save": save_rule,
        "interim_tenant": interim_tenant_rule,
        "finish_or_abort": plain(
            "finish_or_abort",
            lambda self: len(self.model.requests) >= 2 and self.pending is None,
            action=st.sampled_from(["finish", "abort"]),
            data=st.data(),
        ),
        "drain": plain("drain", lambda self: self.pending is None),
        # The committer's operations, each enabled when it has work.
        "committer_claim": plain(
            "committer_claim", lambda self: not self.EAGER and bool(self.ctrl._queue_hi or self.ctrl._queue_lo)
        ),
        "committer_copy": plain("committer_copy", lambda self: not self.EAGER and bool(self.ctrl._claimed)),
        "committer_write": plain("committer_write", lambda self: not self.EAGER and bool(self.ctrl._blocked)),
        # One armed failure per run, after a few saves: a run keeps serving
        # (and reusing blocks) for a while before it dies.
        "inject_failure": plain(
            "inject_failure",
            lambda self: not self.dead and self.saves >= 2 and not (self.poison["copy"] or self.poison["write"]),
            where=st.sampled_from(["copy", "write"]),
            data=st.data(),
        ),
        "join": plain("join", lambda self: bool(self.ctrl._tasks), data=st.data()),
        "submit_queued": plain(
            "submit_queued",
            lambda self: not self.dead and not self.side_submitted,  # once per run
            slot=st.integers(0, NUM_BLOCKS * BLOCK_SIZE - 1),
        ),
        "materialize": consume("materialize"),
        "discard": consume("discard"),
        "preempt": plain("preempt", lambda self: self.pending is None and bool(self.model.running()), data=st.data()),
        "prefetch_run": plain("prefetch_run", lambda self: bool(self.prefetch.pending) and self.paused is None),
        "prefetch_pause": plain("prefetch_pause", lambda self: self.paused is None and bool(self.prefetch.pending)),
        "prefetch_resume": plain("prefetch_resume", lambda self: self.paused is not None),
        "paused_reader_slots_reused": plain(
            "paused_reader_slots_reused",
            lambda self: (
                self.paused is not None
                and self.paused_reader in self.model.requests
                and self.pending is None
                and len(self.expects) < DEPTH
            ),
            prefix=st.integers(0, 2),
            data=st.data(),
        ),
    }


def _checker(method: Callable[[Any], None]) -> Any:
    def check(self: Any) -> None:
        method(self)

    check.__name__ = check.__qualname__ = method.__name__
    check.__doc__ = method.__doc__
    return invariant()(check)


def rule_table(spec: ProtocolSpec) -> dict[str, str]:
    """Operation -> driver rule, for every operation of ``spec``. Raises
    SpecError for an operation with no driver (the spec grew, the tests did not)."""
    missing = [op.name for op in spec.operations if op.name not in DRIVERS]
    if missing:
        raise SpecError(f"{spec.origin}: operations {missing} have no driver in protocol_tests.DRIVERS")
    return {op.name: DRIVERS[op.name] for op in spec.operations}


def invariant_table(spec: ProtocolSpec) -> dict[str, str]:
    """Invariant (checked_by tests) -> checker method. Raises SpecError for a
    declared invariant with no checker."""
    names = spec.invariants_for("tests")
    missing = [n for n in names if n not in CHECKERS]
    if missing:
        raise SpecError(f"{spec.origin}: invariants {missing} have no checker in protocol_tests.CHECKERS")
    return {n: CHECKERS[n] for n in names}


def build_machine(spec: ProtocolSpec | None = None, *, eager: bool) -> type[ProtocolMachine]:
    """A RuleBasedStateMachine class for ``spec`` (default: the shipped one)."""
    spec = spec or load_protocol()
    ops = rule_table(spec)
    checks = invariant_table(spec)
    defs = _rule_defs(eager)
    names = list(dict.fromkeys(r for r in ops.values() if r != "teardown")) + list(WORKLOAD_RULES)
    attrs: dict[str, Any] = {"EAGER": eager, "SPEC": spec, "__module__": __name__}
    for name in names:
        attrs[name] = defs[name](ProtocolMachine)
    for inv, method in checks.items():
        attrs[f"inv_{inv}"] = _checker(getattr(ProtocolMachine, method))
    title = "Eager" if eager else "Manual"
    return type(f"{title}ProtocolMachine", (ProtocolMachine,), attrs)


def invariant_names() -> tuple[str, ...]:
    """The names a generated machine's failures may be attributed to."""
    return tuple(CHECKERS)
