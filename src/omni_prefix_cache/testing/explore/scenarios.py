"""Scenarios the explorer runs: the real manager (threaded committer, prefetch
executor) driven from several controlled threads through facade calls.

Each scenario's main runs on the engine thread; it builds a manager, starts
its other threads, joins them, quiesces and checks. Checks raise
AssertionError with a message starting ``row oracle:`` (a materialized row
differs from what the engine computed) or ``invariant <name>:`` (a named
invariant broke). Invariants that must hold whenever their lock is free are
also checked at every sync point (:class:`Watch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from omni_prefix_cache.controller import TaskState
from omni_prefix_cache.device import sync
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.specs.loader import load_spec
from omni_prefix_cache.steps.slot_occupancy import SlotState
from omni_prefix_cache.testing.explore.scheduler import Scheduler
from omni_prefix_cache.testing.specfacts import states_after
from omni_prefix_cache.testing.write_fakes import install_failing_stages, probe_joins
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool

BS = 2
NUM_BLOCKS = 6
WIDTHS = {HIDDEN_KEY: 2, "m": 1, "d": 1}


def _pages(pool: StagingBufferPool) -> list[frozenset[StagingBufferHolder]]:
    """Each staging page's holders, by page."""
    return [pool.page_holders(page) for page in range(pool.depth)]


def _fail(name: str, detail: str) -> AssertionError:
    return AssertionError(f"invariant {name}: {detail}")


def _refused(what: str, exc: BaseException) -> AssertionError:
    """The failure a refusal the scenario did not expect counts as. A join
    that timed out means no thread could make progress (the scheduler lets a
    timed wait expire only then): a stuck write, not a wrong row."""
    if "did not reach" in str(exc):
        return _fail("joins_terminate", f"{what}: {exc}")
    return AssertionError(f"row oracle: {what}: {exc}")


# ---------------------------------------------------------------- engine driver


class View:
    """The group view: per request its block ids and tokens computed before this step."""

    block_size = BS

    def __init__(self) -> None:
        self.order: list[str] = []
        self.blocks: dict[str, list[int]] = {}
        self.start: dict[str, int] = {}

    def batch_req_ids(self) -> list[str]:
        return list(self.order)

    def token_range(self, req: str, count: int) -> tuple[int, int]:
        return self.start[req], self.start[req] + count

    def slot_ids(self, req: str, lo: int, hi: int) -> list[int]:
        return [self.blocks[req][p // BS] * BS + p % BS for p in range(lo, hi)]

    def step_slots_cpu(self, req_ids: Iterable[str], num_scheduled: Mapping[str, int]) -> torch.Tensor:
        out: list[int] = []
        for req in req_ids:
            k = int(num_scheduled.get(req, 0))
            if k > 0:
                out.extend(self.slot_ids(req, self.start[req], self.start[req] + k))
        return torch.tensor(out, dtype=torch.int64)


@dataclass
class Req:
    blocks: list[int]
    start: int  # tokens computed before this step
    count: int  # tokens scheduled this step
    hit: int = 0  # num_computed_tokens reported as a prefix hit (new requests only)


Expected = dict[str, dict[str, torch.Tensor]]


@dataclass
class Engine:
    """Drives the manager like an engine and predicts every materialized row."""

    mgr: OmniPrefixCacheManager
    view: View
    keys: tuple[str, ...]
    step: int = 0
    truth: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in WIDTHS})
    live: set[str] = field(default_factory=set)
    previous_immediate: list[int] = field(default_factory=list)

    @staticmethod
    def rows(key: str, values: list[float]) -> torch.Tensor:
        scale = {HIDDEN_KEY: 1.0, "m": 2.0, "d": 3.0}[key]
        return (torch.tensor(values, dtype=torch.float32) * scale).unsqueeze(1).repeat(1, WIDTHS[key])

    def run(self, reqs: dict[str, Req], *, finished: Iterable[str] = (), new: Iterable[str] | None = None) -> Any:
        """One step (new_step_starts, forward, save_outputs): ``(step id, expected rows)``."""
        self.step += 1
        view = self.view
        view.order = list(reqs)
        for rid, r in reqs.items():
            view.blocks[rid] = r.blocks
            view.start[rid] = r.start
        new_ids = list(reqs) if new is None else list(new)
        self.live -= set(finished)
        hits = {rid for rid in new_ids if reqs[rid].hit > 0 and rid not in self.live}
        self.live |= set(new_ids)
        sched = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=rid, num_computed_tokens=reqs[rid].hit, block_ids=(list(reqs[rid].blocks),))
                for rid in new_ids
            ],
            # In the caller's order, not a set's: the manager escalates finished requests in
            # this order, and a set of str iterates in PYTHONHASHSEED's order.
            finished_req_ids=list(finished),
            num_scheduled_tokens={rid: r.count for rid, r in reqs.items()},
        )
        self.mgr.new_step_starts(sched)
        values: list[float] = []
        for rid, r in reqs.items():
            values.extend(float(self.step * 1000 + s) for s in view.slot_ids(rid, r.start, r.start + r.count))
        n = len(values)
        outs = {key: self.rows(key, values) for key in self.keys}
        hidden = outs.pop(HIDDEN_KEY)
        for rid, r in reqs.items():
            for s in view.slot_ids(rid, r.start, r.start + r.count):
                for key in self.keys:
                    self.truth[key][s] = float(self.step * 1000 + s)
        expected: Expected = {}
        for rid, r in reqs.items():
            lo = 0 if rid in hits else r.start
            slots = view.slot_ids(rid, lo, r.start + r.count)
            expected[rid] = {key: self.rows(key, [self.truth[key].get(s, 0.0) for s in slots]) for key in self.keys}
        sid = self.mgr.save_outputs(hidden, outs, num_tokens_unpadded=n, num_tokens_padded=n)
        self._check_save_barrier(sid)
        return sid, expected

    def _check_save_barrier(self, sid: int) -> None:
        ctrl = self.mgr.components.controller
        for tid in self.previous_immediate:
            task = ctrl.parts.registry.get(tid)
            if task is not None and not task.is_terminal:
                raise _fail(
                    "no_join_under_state_lock_and_save_waits_previous_writes",
                    f"step {sid} saved before task {tid} of the previous step was written",
                )
        self.previous_immediate = list(self.mgr.components.ledger.previous_step_writes)

    def check(self, sid: int, expected: Expected) -> None:
        """materialize(sid) and compare every row with the engine's."""
        got = self.mgr.materialize(sid, list(expected))
        for rid, per_key in expected.items():
            for key, want in per_key.items():
                have = (got.hidden_states or {})[rid] if key == HIDDEN_KEY else got.mm_outputs[key][rid]
                if have.shape != want.shape or not torch.equal(have, want):
                    raise AssertionError(
                        f"row oracle: step {sid} request {rid} key {key}: got {have[:, 0].tolist()}, "
                        f"want {want[:, 0].tolist()}"
                    )


# ---------------------------------------------------------------- probes and invariants


# The states every path reaches through a copy claim (spec write_task:
# COPYING onward, failure aside), as the model check's facts read them.
_PAST_QUEUED = frozenset(
    TaskState[name] for name in states_after(load_spec("write_task"), lambda m: m.trigger == "claim_copy")[0]
)


class Watch:
    """Probes on one manager and the invariants checked at every sync point
    (each only while the lock that protects its data is free)."""

    def __init__(self, sched: Scheduler, mgr: OmniPrefixCacheManager) -> None:
        self.sched, self.mgr = sched, mgr
        ctrl = self.ctrl = mgr.components.controller
        self.ever_failed: set[int] = set()
        self.poison: dict[str, Callable[[Any], bool]] = {}
        self.violations: list[str] = []
        self.claimed: set[int] = set()  # tasks seen past QUEUED (their copy claimed)
        take_failed = ctrl.parts.registry.take_failed

        def drained() -> list[int]:
            out = take_failed()
            self.ever_failed.update(out)
            return out

        def joining(tids: list[int], event: Any) -> None:
            # Recorded, not raised: the manager would wrap an error raised inside its call.
            if getattr(mgr.components.state_lock, "owner", None) is sched.current():
                self.violations.append(f"join({event}) of tasks {list(tids)} under the state lock")

        def poisoned(stage: str) -> Callable[[Any], bool]:
            return lambda task: stage in self.poison and self.poison[stage](task)

        ctrl.parts.registry.take_failed = drained  # type: ignore[method-assign]
        probe_joins(ctrl, joining)
        copy_stage, _ = install_failing_stages(ctrl, copy=poisoned("copy"), write=poisoned("write"))
        self.copying = copy_stage.copying
        sched.check = self.check
        sched.fingerprint = self.fingerprint

    def check(self) -> None:
        ctrl = self.ctrl
        if self.violations:
            raise _fail("no_join_under_state_lock_and_save_waits_previous_writes", self.violations[0])
        # The strict chain QUEUED -> COPYING -> HOST_READY -> WRITTEN (spec
        # write_task): a task seen past QUEUED is never QUEUED again. A
        # task's state is under its own lock, so this is read whenever that
        # lock is free, whoever holds the controller's (where an escalate
        # requeues).
        for tid, seen in list(ctrl.parts.registry.tasks.items()):
            if seen.lock.locked():
                continue
            if seen.state in _PAST_QUEUED:
                self.claimed.add(tid)
            elif seen.state is TaskState.QUEUED and tid in self.claimed:
                raise _fail("write_task.single_copy_claim", f"task {tid} is queued again after its copy was claimed")
        if ctrl.lock.locked():
            return
        queued = [*ctrl.queues.high, *ctrl.queues.low]
        if len(set(queued)) != len(queued):
            raise _fail(
                "composed.one_queue_entry",
                f"a task is queued twice: hi={list(ctrl.queues.high)} lo={list(ctrl.queues.low)}",
            )
        for tid in queued:
            task = ctrl.parts.registry.tasks.get(tid)
            if task is not None and task.state not in (TaskState.QUEUED, TaskState.FAILED):
                raise _fail("composed.queued_not_claimed", f"task {tid} is on a copy queue while {task.state.name}")
        # Claimed (popped, copy stage not taken yet) or copying: one claim only.
        for tid in self.copying | set(ctrl.queues.claimed):
            task = ctrl.parts.registry.tasks.get(tid)
            if task is not None and (task.state is TaskState.QUEUED or tid in queued):
                raise _fail("write_task.single_copy_claim", f"task {tid} is queued again while its copy runs")
        for tid, task in list(ctrl.parts.registry.tasks.items()):
            if (
                task.done.is_set()
                and tid not in ctrl.parts.registry.completed
                and tid not in ctrl.parts.registry.failed
            ):
                if tid not in self.ever_failed:
                    raise _fail(
                        "composed.done_after_record",
                        f"task {tid} is done ({task.state.name}) but no completion/failure record is public",
                    )

    def fingerprint(self) -> Any:
        ctrl, mgr = self.ctrl, self.mgr
        return (
            tuple(sorted((tid, t.state.name, t.done.is_set()) for tid, t in ctrl.parts.registry.tasks.items())),
            tuple(ctrl.queues.high),
            tuple(ctrl.queues.low),
            tuple(ctrl.queues.claimed),
            tuple(ctrl.queues.blocked),
            tuple(ctrl.parts.registry.completed),
            tuple(ctrl.parts.registry.failed),
            tuple(sorted((sid, str(ctx.state)) for sid, ctx in mgr.components.steps.items())),
            len(mgr.components.reads.pending),
            tuple(tuple(sorted((h.kind, h.owner_id) for h in page)) for page in _pages(ctrl.parts.staging_pool)),
        )

    # ------------------------------------------------------------ at the end of a schedule

    def any_failed(self) -> bool:
        return any(t.state is TaskState.FAILED for t in list(self.ctrl.parts.registry.tasks.values()))

    def check_quiesced(self, dead: bool) -> None:
        """After every request ended and every step was consumed: the racing
        tests' invariants, then nothing leaked."""
        mgr, ctrl = self.mgr, self.ctrl
        if not dead:
            held = {h for page in _pages(ctrl.parts.staging_pool) for h in page}
            steps = {h.owner_id for h in held if h.kind == "step"}
            if steps != set(mgr.components.steps):
                raise _fail("holders_match_live_steps_and_unwritten_tasks", f"{steps} != {set(mgr.components.steps)}")
            tickets = {id(c.budget): c.budget for t in ctrl.parts.registry.tasks.values() for c in t.chunks if c.budget}
            if ctrl.parts.budget.staged_bytes != sum(t.nbytes for t in tickets.values() if not t.freed):
                raise _fail("staged_bytes_equal_live_tickets", f"staged {ctrl.parts.budget.staged_bytes}")
            for key in list(mgr.components.occupancy.state):
                status = mgr.components.occupancy.get_slot_status(key)
                in_transit = status.state == int(SlotState.IN_TRANSIT)
                if not torch.equal(in_transit, status.tids >= 0):
                    raise _fail("occupancy_matches_tasks", f"{key}: owner set iff IN_TRANSIT")
        left = {t: task.state.name for t, task in ctrl.parts.registry.tasks.items() if not task.is_terminal}
        if left:
            raise _fail("nothing_leaked", f"unfinished tasks after quiescing: {left}")
        pages = [set(page) for page in _pages(ctrl.parts.staging_pool)]
        if any(pages):
            raise _fail("nothing_leaked", f"staging pages still held: {pages}")
        if ctrl.parts.budget.staged_bytes != 0:
            raise _fail("nothing_leaked", f"{ctrl.parts.budget.staged_bytes} staged budget bytes left")
        if mgr.components.steps:
            raise _fail("nothing_leaked", f"step contexts left: {sorted(mgr.components.steps)}")
        if mgr.components.reads.pending and not dead:
            # After shutdown a read whose prefetch finished but was never served may stay
            # registered (the manager is going away); before it, none may.
            raise _fail("nothing_leaked", f"{len(mgr.components.reads.pending)} planned reads left")

    def check_sticky(self) -> None:
        try:
            self.mgr.new_step_starts(_EMPTY)
        except OmniPrefixCacheUnmatchError as exc:
            if "write failed" not in str(exc):
                raise _fail("failure_is_sticky", f"after a failed write the facade raised {exc!r}") from exc
            return
        raise _fail("failure_is_sticky", "a write failed, yet new_step_starts returned")


_EMPTY = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(), num_scheduled_tokens={})


# ---------------------------------------------------------------- building blocks


class Channel:
    """A closable FIFO between controlled threads (built on the seam)."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._closed = False
        self._cond = sync.Condition()

    def put(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self) -> Any:
        """The next item, or None once closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            return self._items.popleft() if self._items else None


def _build(
    sched: Scheduler, policy: ModelCachePolicy | None = None, **cfg: Any
) -> tuple[OmniPrefixCacheManager, Engine, Watch]:
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, **cfg)
    view = View()
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer="thread")
    keys: tuple[str, ...] = (HIDDEN_KEY, "m")
    if policy is not None:
        mgr.register_policy(policy)
        keys = (HIDDEN_KEY, "m", *sorted(policy.deferred_keys))
    return mgr, Engine(mgr, view, keys), Watch(sched, mgr)


def _consumer(engine: Engine, jobs: Channel, errors: list[BaseException], *, refusals_ok: bool) -> Callable[[], None]:
    """A thread that materializes each step the engine hands over (lagging)."""

    def run() -> None:
        while (job := jobs.get()) is not None:
            sid, expected = job
            try:
                engine.check(sid, expected)
            except OmniPrefixCacheUnmatchError as exc:
                if not refusals_ok:
                    raise _refused(f"materialize(step {sid}) refused servable rows", exc) from exc
                errors.append(exc)  # materialize consumed the step even though it refused

    return run


def _quiesce(engine: Engine, watch: Watch, *, dead: bool) -> None:
    """End every request, let the committer finish, drain, check, shut down."""
    mgr, ctrl = engine.mgr, watch.ctrl
    if not dead:
        # Sorted: escalation follows this order (see Engine.run), a set's is PYTHONHASHSEED's.
        ended = sorted(engine.live)
        finished = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=ended, num_scheduled_tokens={})
        mgr.new_step_starts(finished)
        engine.live.clear()
        ctrl.join([tid for tid, t in list(ctrl.parts.registry.tasks.items()) if not t.is_terminal])
        mgr.new_step_starts(_EMPTY)
        watch.check_quiesced(dead=False)
    mgr.shutdown()
    if dead:
        watch.check_quiesced(dead=True)


# ---------------------------------------------------------------- scenarios


def reuse_while_read_in_flight(sched: Scheduler) -> None:
    """Save + lagged materialize on another thread + slot reuse while a
    planned read is in flight: b hits a's blocks; before b's step is
    materialized, a and b finish and c reuses block 0."""
    mgr, engine, watch = _build(sched, staging_depth=3)
    jobs, errors = Channel(), list[BaseException]()
    consumer = sync.Thread(target=_consumer(engine, jobs, errors, refusals_ok=False), name="materialize")
    consumer.start()
    jobs.put(engine.run({"a": Req([0, 1], 0, 4)}))
    jobs.put(engine.run({"b": Req([0, 1, 2], 4, 1, hit=4)}))
    jobs.put(engine.run({"c": Req([0], 0, 2)}, finished=("a", "b")))
    jobs.close()
    consumer.join()
    _quiesce(engine, watch, dead=False)


def deferred_flush_escalate(sched: Scheduler) -> None:
    """Deferred writes + a budget flush + escalate from finish + the save
    barrier's join, while another thread materializes lagging and c's hit
    reads a's deferred rows."""
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, engine, watch = _build(sched, policy, staging_depth=3, gpu_staging_bytes=5 * WIDTHS["d"] * 4)
    jobs, errors = Channel(), list[BaseException]()
    consumer = sync.Thread(target=_consumer(engine, jobs, errors, refusals_ok=False), name="materialize")
    consumer.start()
    jobs.put(engine.run({"a": Req([0, 1], 0, 4)}))
    jobs.put(engine.run({"a": Req([0, 1, 2], 4, 1), "b": Req([3], 0, 2)}))  # over budget: flush a's
    jobs.put(engine.run({"a": Req([0, 1, 2], 5, 1)}, finished=("b",), new=()))  # escalate b's
    jobs.put(engine.run({"c": Req([0, 1, 4], 4, 1, hit=4)}, finished=("a",)))  # hit on a's deferred rows
    jobs.close()
    consumer.join()
    _quiesce(engine, watch, dead=False)


def escalate_while_copying(sched: Scheduler) -> None:
    """A deferred write the budget flushed is being copied by the committer
    when its request finishes and escalates it (one claim, one copy)."""
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, engine, watch = _build(sched, policy, staging_depth=2, gpu_staging_bytes=3 * WIDTHS["d"] * 4)
    engine.check(*engine.run({"a": Req([0, 1], 0, 4)}))  # four deferred rows: over budget, flushed
    engine.check(*engine.run({"a": Req([0, 1, 2], 4, 1)}, new=()))
    # A save queues a's new deferred write without a wake; a joiner's kick (a prefetch, a budget flush
    # on another path) may come at any time, so the committer may be copying it when a finishes.
    mgr.components.controller.kick()
    engine.check(*engine.run({"b": Req([3], 0, 2)}, finished=("a",)))  # a finishes: escalate its writes
    _quiesce(engine, watch, dead=False)


def _failure_while_joining(sched: Scheduler, stage: str) -> None:
    """a's write fails (copy or pool write) while the engine's save barrier
    and the materialize thread (b's hit on a's rows) join it."""
    mgr, engine, watch = _build(sched, staging_depth=3)
    poisoned: set[int] = set()

    def is_a(task: Any) -> bool:
        if "a" in task.req_ids:  # a's step write (a step's write holds all its requests)
            poisoned.add(task.tid)
            return True
        return False

    watch.poison[stage] = is_a
    jobs, errors = Channel(), list[BaseException]()
    consumer = sync.Thread(target=_consumer(engine, jobs, errors, refusals_ok=True), name="materialize")
    consumer.start()
    dead = False
    try:
        jobs.put(engine.run({"a": Req([0, 1], 0, 4)}))
        jobs.put(engine.run({"b": Req([0, 1, 2], 4, 1, hit=4)}))
        jobs.put(engine.run({"b": Req([0, 1, 2], 5, 1)}, new=()))
    except OmniPrefixCacheUnmatchError as exc:
        if "write failed" not in str(exc) and "injected" not in str(exc):
            raise _refused("the engine got an unexpected refusal", exc) from exc
        dead = True
    jobs.close()
    consumer.join()
    for refusal in errors:
        if "write failed" not in str(refusal) and "injected" not in str(refusal):
            raise _refused("materialize refused for another reason than a's failure", refusal)
    if not dead:
        # Every write a's rows went into failed: joining it must say so.
        try:
            mgr.components.controller.join(sorted(poisoned))
        except OmniPrefixCacheUnmatchError:
            dead = True
    if not poisoned:
        raise AssertionError("explore scenario: the poisoned write never ran")
    failed = {tid for tid, t in list(watch.ctrl.parts.registry.tasks.items()) if t.state is TaskState.FAILED}
    if failed - poisoned:
        raise _fail(
            "failure_attributed_to_its_task", f"tasks {sorted(failed - poisoned)} failed; only {poisoned} were poisoned"
        )
    if not (failed & poisoned) and poisoned & set(watch.ctrl.parts.registry.tasks):
        raise _fail("failure_attributed_to_its_task", f"poisoned tasks {sorted(poisoned)} did not fail")
    watch.check_sticky()
    _quiesce(engine, watch, dead=True)


def copy_failure_while_joining(sched: Scheduler) -> None:
    """An injected copy failure of a's write while other threads join it."""
    _failure_while_joining(sched, "copy")


def pool_write_failure_while_joining(sched: Scheduler) -> None:
    """An injected pool-write failure of a's write while other threads join it."""
    _failure_while_joining(sched, "write")


def shutdown_while_blocked(sched: Scheduler) -> None:
    """Shutdown from an operator thread while the engine's save waits for a
    staging page (depth 1) and the materialize thread waits on a hit read."""
    mgr, engine, watch = _build(sched, staging_depth=1)
    jobs, errors = Channel(), list[BaseException]()
    consumer = sync.Thread(target=_consumer(engine, jobs, errors, refusals_ok=True), name="materialize")
    operator = sync.Thread(target=mgr.shutdown, name="operator")
    consumer.start()
    try:
        jobs.put(engine.run({"a": Req([0, 1], 0, 4)}))
        operator.start()
        jobs.put(engine.run({"b": Req([0, 1, 2], 4, 1, hit=4)}))
    except OmniPrefixCacheUnmatchError as exc:
        if not isinstance(exc, OmniPrefixCacheShutdownError):
            raise _refused("a save refused for another reason than shutdown", exc) from exc
    jobs.close()
    consumer.join()
    operator.join()
    for refusal in errors:
        if not isinstance(refusal, OmniPrefixCacheShutdownError):
            raise _refused("materialize refused for another reason than shutdown", refusal)
    watch.check_quiesced(dead=True)
    _check_refuses_after_shutdown(mgr)


def _check_refuses_after_shutdown(mgr: OmniPrefixCacheManager) -> None:
    """After shutdown every facade call raises the shutdown error naming the call."""
    calls: dict[str, Callable[[], Any]] = {
        "new_step_starts": lambda: mgr.new_step_starts(_EMPTY),
        "save_outputs": lambda: mgr.save_outputs(None, {}, num_tokens_unpadded=0, num_tokens_padded=0),
        "materialize(step 1)": lambda: mgr.materialize(1, []),
        "discard_step(step 2)": lambda: mgr.discard_step(2),
    }
    for name, call in calls.items():
        try:
            call()
        except OmniPrefixCacheShutdownError as exc:
            if name not in str(exc):
                raise _fail("shutdown_refuses", f"{name} after shutdown: {exc!r} does not name the call") from exc
            continue
        except Exception as exc:
            raise _fail("shutdown_refuses", f"{name} after shutdown raised {exc!r}, not the shutdown error") from exc
        raise _fail("shutdown_refuses", f"{name} after shutdown returned")


@dataclass(frozen=True)
class Scenario:
    name: str
    main: Callable[[Scheduler], None]
    doc: str


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("reuse-read", reuse_while_read_in_flight, reuse_while_read_in_flight.__doc__ or ""),
        Scenario("deferred-flush", deferred_flush_escalate, deferred_flush_escalate.__doc__ or ""),
        Scenario("escalate-copying", escalate_while_copying, escalate_while_copying.__doc__ or ""),
        Scenario("copy-failure", copy_failure_while_joining, copy_failure_while_joining.__doc__ or ""),
        Scenario("write-failure", pool_write_failure_while_joining, pool_write_failure_while_joining.__doc__ or ""),
        Scenario("shutdown", shutdown_while_blocked, shutdown_while_blocked.__doc__ or ""),
    )
}
