"""Controller tests beyond the seed suite: the threaded committer on CPU,
failure isolation, shutdown, test-driven committer steps, and eager
batching. Randomised tests take a seed and print it on failure."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import (
    BudgetTicket,
    OmniPrefixCacheController,
    StagingBufferHolder,
    TaskState,
    WriteChunk,
    WriteTask,
)
from omni_prefix_cache.device.copy_engine import CpuCopyEngine
from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError, PrefixCacheConfig, WriteSchedule
from omni_prefix_cache.specs.batch import guarded_each
from omni_prefix_cache.writes.committer import Committer

NUM_BLOCKS, BLOCK_SIZE, WIDTH = 16, 4, 3
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


class FlakyPool(PrefixBlockPool):
    """A pool whose write raises for any slot in ``poison``."""

    def __init__(self, config: PrefixCacheConfig):
        super().__init__(config)
        self.poison: set[int] = set()
        self.writes: list[tuple[str, list[int]]] = []

    def write(self, key, slots, host):
        self.writes.append((key, slots.tolist()))
        if self.poison & set(slots.tolist()):
            raise RuntimeError(f"injected pool write failure on {sorted(self.poison & set(slots.tolist()))}")
        super().write(key, slots, host)


class FlakyEngine(CpuCopyEngine):
    """A CPU copy engine whose device-to-host copy raises for rows equal to ``poison_value``."""

    def __init__(self) -> None:
        self.poison_value: float | None = None

    def copy_into(self, dst, src):
        if self.poison_value is not None and bool((src == self.poison_value).any()):
            raise RuntimeError("injected copy failure")
        super().copy_into(dst, src)


def make(eager=False, committer="thread", timeout=5.0, budget=1 << 30, engine=None):
    cfg = PrefixCacheConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        staging_claim_timeout_s=timeout,
        gpu_staging_bytes=budget,
        staging_depth=2,
        staging_capacity_tokens=NUM_SLOTS,
    )
    pool = FlakyPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
    ctrl = OmniPrefixCacheController(pool, cfg, eager=eager, committer=committer, engine=engine)
    return ctrl, pool


def rows_for(slots: list[int], salt: float = 0.0) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.float32)[:, None].expand(len(slots), WIDTH) + salt


def deferred_task(ctrl, tid, slots, salt=0.0, ticket=None):
    """A JOIN_ON_FINISH task whose 'device clone' is a CPU tensor."""
    clone = rows_for(slots, salt)
    ticket = ticket or BudgetTicket(nbytes=clone.numel() * clone.element_size())
    ctrl.reserve(ticket.nbytes)
    chunk = WriteChunk(slots_cpu=torch.tensor(slots), tensors={HIDDEN_KEY: clone}, budget=ticket)
    task = WriteTask(tid=tid, req_id=f"r{tid}", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[chunk])
    ctrl.parts.budget.pin(ticket, tid)
    return task


def staged_task(ctrl, tid, slots, page, salt=0.0):
    """A JOIN_NEXT_STEP task viewing rows already landed on a staging page."""
    host = rows_for(slots, salt)
    chunk = WriteChunk(slots_cpu=torch.tensor(slots), tensors={}, host={HIDDEN_KEY: host})
    task = WriteTask(
        tid=tid, req_id=f"r{tid}", write_n=1, schedule=WriteSchedule.JOIN_NEXT_STEP, chunks=[chunk], page=page
    )
    return task


def test_threaded_committer_writes_everything_while_another_thread_escalates_and_joins():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ctrl, pool = make()
    n_tasks = 60
    plan = [rng.sample(range(NUM_SLOTS), rng.randint(1, 4)) for _ in range(n_tasks)]
    # Each slot's final value is set by the last task writing it; keep slots
    # unique across tasks so the expected pool is order-independent.
    used: set[int] = set()
    for i, slots in enumerate(plan):
        plan[i] = [s for s in slots if s not in used] or []
        used.update(plan[i])
    plan = [p for p in plan if p]
    submitted: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    done_submitting = threading.Event()

    def producer() -> None:
        try:
            for tid, slots in enumerate(plan, start=1):
                task = deferred_task(ctrl, tid, slots, salt=0.5)
                ctrl.submit(task, queued=rng.random() < 0.5)
                with lock:
                    submitted.append(tid)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done_submitting.set()

    def racer() -> None:
        local = random.Random(seed + 1)
        try:
            while not done_submitting.is_set() or local.random() < 0.5:
                with lock:
                    pick = local.sample(submitted, min(3, len(submitted))) if submitted else []
                ctrl.escalate(pick)
                if pick and local.random() < 0.3:
                    ctrl.join(pick)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=producer), threading.Thread(target=racer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, f"seed={seed}: {errors!r}"
    ctrl.escalate(submitted)
    ctrl.join(submitted)
    try:
        states = {tid: ctrl.parts.registry.get(tid).state for tid in submitted if ctrl.parts.registry.get(tid)}
        assert all(s is TaskState.WRITTEN for s in states.values()), f"seed={seed}: {states}"
        for slots in plan:
            got = pool.rows(HIDDEN_KEY, torch.tensor(slots))
            assert torch.equal(got, rows_for(slots, 0.5)), f"seed={seed} slots={slots}"
        assert ctrl.parts.budget.staged_bytes == 0, f"seed={seed}"
        assert sorted(ctrl.parts.registry.take_completed()) == sorted(submitted), f"seed={seed}"
    finally:
        ctrl.shutdown()


def test_failing_copy_fails_only_its_task_and_committer_keeps_serving():
    engine = FlakyEngine()
    engine.poison_value = 999.0
    ctrl, pool = make(engine=engine)
    try:
        bad = deferred_task(ctrl, 1, [0, 1], salt=999.0 - 0.0)
        # rows_for([0, 1], 999) contains 999.0 in slot 0's row: the copy raises.
        good = deferred_task(ctrl, 2, [4, 5])
        ctrl.submit(bad, queued=True)
        ctrl.submit(good, queued=True)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="task 1 .*write failed"):
            ctrl.join([1])
        ctrl.join([2])
        assert bad.state is TaskState.FAILED and good.state is TaskState.WRITTEN
        assert ctrl.parts.registry.take_failed() == [1]
        assert ctrl.parts.budget.staged_bytes == 0
        later = deferred_task(ctrl, 3, [8])
        ctrl.submit(later)
        ctrl.join([3])
        assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([8])), rows_for([8]))
    finally:
        ctrl.shutdown()


def test_failing_pool_write_fails_only_its_task_and_releases_its_staging_hold():
    ctrl, pool = make()
    try:
        step = StagingBufferHolder.for_step(1)
        claim = ctrl.parts.staging_pool.stage_step({}, 0, None, step)
        bad = staged_task(ctrl, 1, [2, 3], claim.page)
        good = staged_task(ctrl, 2, [6, 7], claim.page)
        pool.poison = {3}
        for task in (bad, good):
            ctrl.register(task)  # binds its holder to the step's page
        ctrl.dispatch([bad, good])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
            ctrl.join([1])
        ctrl.join([2])
        assert bad.state is TaskState.FAILED and good.state is TaskState.WRITTEN
        # Both task holds are gone (written / failed); only the step still holds the page.
        assert ctrl.parts.staging_pool.page_holders(claim.page) == {step}
        ctrl.parts.staging_pool.release(claim.page, step)
        assert not ctrl.parts.staging_pool.holders()
        pool.poison = set()
        page = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(2)).page
        again = staged_task(ctrl, 3, [3], page)
        ctrl.submit(again)
        ctrl.join([3])
        assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([3])), rows_for([3]))
    finally:
        ctrl.shutdown()


def test_shutdown_with_queued_work_writes_it_and_does_not_hang():
    ctrl, pool = make(committer="manual")
    tasks = [deferred_task(ctrl, tid, [tid]) for tid in range(1, 6)]
    for task in tasks[:3]:
        ctrl.submit(task, queued=True)
    for task in tasks[3:]:
        ctrl.submit(task, queued=False)  # pending deferred writes: never queued
    ctrl.parts.committer.claim()
    ctrl.parts.committer.copy()
    ctrl.parts.committer.write()  # task 1 written before shutdown
    ctrl.shutdown()
    assert [t.state for t in tasks] == [TaskState.WRITTEN] * 3 + [TaskState.FAILED] * 2
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([1, 2, 3])), rows_for([1, 2, 3]))
    assert ctrl.parts.budget.staged_bytes == 0
    assert all(t.done.is_set() for t in tasks)


def test_threaded_shutdown_drains_queue_before_exit():
    gate = threading.Event()

    class SlowEngine(CpuCopyEngine):
        def copy_into(self, dst, src):
            gate.wait(5)
            super().copy_into(dst, src)

    ctrl, pool = make(engine=SlowEngine())
    tasks = [deferred_task(ctrl, tid, [tid]) for tid in range(1, 4)]
    for task in tasks:
        ctrl.submit(task)
    closer = threading.Thread(target=ctrl.shutdown)
    closer.start()
    gate.set()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert all(t.state is TaskState.WRITTEN for t in tasks)
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([1, 2, 3])), rows_for([1, 2, 3]))


def test_manual_committer_escalate_between_claim_and_copy_does_not_requeue():
    ctrl, pool = make(committer="manual")
    task = deferred_task(ctrl, 1, [0, 1])
    ctrl.submit(task, queued=True)
    assert ctrl.parts.committer.claim() == 1
    assert task.state is TaskState.COPYING
    ctrl.escalate([1])
    assert not ctrl.queues.high and not ctrl.queues.low
    assert ctrl.parts.committer.copy() == 1 and task.state is TaskState.HOST_READY
    assert ctrl.parts.committer.write() == [1]
    assert task.state is TaskState.WRITTEN
    assert ctrl.parts.committer.step() is None
    ctrl.shutdown()


def test_manual_committer_serves_high_priority_first():
    ctrl, _ = make(committer="manual")
    low = deferred_task(ctrl, 1, [0])
    ctrl.submit(low, queued=True)  # deferred -> low queue
    pending = deferred_task(ctrl, 2, [1])
    ctrl.submit(pending, queued=False)
    ctrl.escalate([2])
    assert ctrl.parts.committer.claim() == 2
    assert ctrl.parts.committer.claim() == 1
    ctrl.shutdown()


def test_fail_while_claimed_is_not_resurrected_by_the_copy_stage():
    ctrl, _ = make(committer="manual")
    task = deferred_task(ctrl, 1, [0])
    ctrl.submit(task)
    ctrl.parts.committer.claim()
    ctrl.fail_task(task, None)
    assert ctrl.parts.committer.copy() is None  # the failure dropped its claim
    assert task.state is TaskState.FAILED and ctrl.parts.budget.staged_bytes == 0
    ctrl.shutdown()


def test_eager_dispatch_writes_pool_once_per_key_for_a_batch():
    ctrl, pool = make(eager=True)
    step = StagingBufferHolder.for_step(1)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, step)
    tasks = [staged_task(ctrl, tid, [tid * 2, tid * 2 + 1], claim.page) for tid in range(1, 5)]
    for task in tasks:
        ctrl.register(task)  # binds its holder to the step's page
    ctrl.dispatch(tasks)
    assert len(pool.writes) == 1 and sorted(pool.writes[0][1]) == list(range(2, 10))
    assert all(t.state is TaskState.WRITTEN for t in tasks)
    assert ctrl.parts.staging_pool.page_holders(claim.page) == {step}
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.arange(2, 10)), rows_for(list(range(2, 10))))


def test_eager_batch_write_failure_is_attributed_to_the_failing_task_only():
    ctrl, pool = make(eager=True)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(1))
    tasks = [staged_task(ctrl, tid, [tid], claim.page) for tid in range(1, 4)]
    for task in tasks:
        ctrl.register(task)
    pool.poison = {2}
    with pytest.raises(RuntimeError, match="injected pool write failure"):
        ctrl.dispatch(tasks)
    assert [t.state for t in tasks] == [TaskState.WRITTEN, TaskState.FAILED, TaskState.WRITTEN]
    assert ctrl.parts.registry.take_failed() == [2]


def test_eager_batch_with_a_slot_written_twice_keeps_the_later_task():
    ctrl, pool = make(eager=True)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(1))
    first = staged_task(ctrl, 1, [5], claim.page, salt=1.0)
    second = staged_task(ctrl, 2, [5], claim.page, salt=2.0)
    for task in (first, second):
        ctrl.register(task)
    ctrl.dispatch([first, second])
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([5])), rows_for([5], 2.0))


def test_eager_dispatch_mixing_staged_and_deferred_tasks_copies_the_deferred_rows():
    # The copy stage is skipped for a batch of staging views only: one
    # deferred write anywhere in the dispatch still gets its rows copied.
    ctrl, pool = make(eager=True)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(1))
    first = staged_task(ctrl, 1, [1], claim.page)
    deferred = deferred_task(ctrl, 2, [2], salt=0.5)
    last = staged_task(ctrl, 3, [3], claim.page)
    for task in (first, deferred, last):
        ctrl.register(task)
    ctrl.dispatch([first, deferred, last])
    assert [t.state for t in (first, deferred, last)] == [TaskState.WRITTEN] * 3
    expected = torch.cat([rows_for([1]), rows_for([2], 0.5), rows_for([3])])
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([1, 2, 3])), expected)
    assert ctrl.parts.budget.staged_bytes == 0


class RecordingStages:
    """A copy stage and a pool-write stage that record each task they see,
    then run the controller's own stages."""

    def __init__(self, ctrl):
        self.copy_inner, self.write_inner = ctrl.parts.stages.copy, ctrl.parts.stages.pool_write
        self.copied: list[int] = []
        self.written: list[int] = []

    def copy_task(self, task):
        self.copied.append(task.tid)
        self.copy_inner.copy_task(task)

    def copy_batch(self, batch):
        guarded_each(batch, self.copy_task)

    def write(self, task):
        self.written.append(task.tid)
        self.write_inner.write(task)

    def write_batch(self, batch):
        guarded_each(batch, self.write)


def test_eager_dispatch_goes_through_installed_copy_and_pool_write_stages_for_every_task():
    # The batched copy_to_host / pool_write effects hand every task of the
    # dispatch to the installed stages (a harness's fakes see them all).
    ctrl, pool = make(eager=True)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(1))
    tasks = [staged_task(ctrl, tid, [tid], claim.page) for tid in range(1, 4)]
    for task in tasks:
        ctrl.register(task)
    stages = RecordingStages(ctrl)
    ctrl.parts.stages.use(copy=stages, pool_write=stages)
    ctrl.dispatch(tasks)
    assert stages.copied == stages.written == [1, 2, 3]
    assert all(t.state is TaskState.WRITTEN for t in tasks)
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([1, 2, 3])), rows_for([1, 2, 3]))


def test_staging_release_twice_raises_naming_the_holder():
    ctrl, _ = make(eager=True)
    step = StagingBufferHolder.for_step(7)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, step)
    ctrl.parts.staging_pool.release(claim.page, step)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="step 7 cannot consume"):
        ctrl.parts.staging_pool.release(claim.page, step)


def test_task_cannot_bind_to_a_free_page():
    ctrl, _ = make(eager=True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="task_holder.bind is not enabled"):
        ctrl.register(staged_task(ctrl, 3, [3], 0))


def test_stats_counts_tasks_holders_and_bytes():
    ctrl, _ = make(committer="manual")
    task = deferred_task(ctrl, 1, [0, 1])
    ctrl.submit(task, queued=False)
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(1))
    stats = ctrl.stats()
    assert stats["tasks_by_state"]["PENDING"] == 1
    assert stats["holders"] == {"step": 1, "task": 0}
    assert stats["staged_bytes"] == task.chunks[0].budget.nbytes
    ctrl.parts.staging_pool.release(claim.page, StagingBufferHolder.for_step(1))
    ctrl.shutdown()
    assert ctrl.stats()["tasks_by_state"]["FAILED"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_stages_and_copies_after_freeze_event():  # pragma: no cover - CUDA only
    cfg = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, staging_capacity_tokens=NUM_SLOTS)
    pool = PrefixBlockPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
    ctrl = OmniPrefixCacheController(pool, cfg, eager=False)
    try:
        assert ctrl.parts.host_rows.engine.name == "cuda" and ctrl.parts.staging_pool.pin_memory
        src = rows_for([0, 1, 2, 3]).cuda()
        freeze = torch.cuda.Event()
        freeze.record()
        step = StagingBufferHolder.for_step(1)
        claim = ctrl.parts.staging_pool.stage_step({HIDDEN_KEY: src}, 4, freeze, step)
        assert claim.event is not None
        claim.event.synchronize()
        assert claim.views[HIDDEN_KEY].is_pinned()
        assert torch.equal(claim.views[HIDDEN_KEY], src.cpu())
        ticket = BudgetTicket(nbytes=src.numel() * 4)
        ctrl.reserve(ticket.nbytes)
        clone = src.clone()
        chunk = WriteChunk(slots_cpu=torch.tensor([8, 9, 10, 11]), tensors={HIDDEN_KEY: clone}, budget=ticket)
        task = WriteTask(tid=1, req_id="r", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[chunk])
        task.freeze_event = torch.cuda.Event()
        task.freeze_event.record()
        ctrl.parts.budget.pin(ticket, 1)
        ctrl.submit(task, queued=False)
        got = ctrl.parts.host_rows.fetch(task, torch.tensor([10, 8]), HIDDEN_KEY)
        assert got.device.type == "cpu" and torch.equal(got, src.cpu()[[2, 0]])
        ctrl.escalate([1])
        ctrl.join([1])
        assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([8, 9, 10, 11])), src.cpu())
        assert ctrl.parts.budget.staged_bytes == 0
        ctrl.parts.staging_pool.release(claim.page, step)
    finally:
        ctrl.shutdown()


def test_on_demand_committer_runs_steps_when_joined_and_only_then():
    ctrl, pool = make(committer="on_demand", timeout=0.0)
    first = deferred_task(ctrl, 1, [0])
    second = deferred_task(ctrl, 2, [1])
    pending = deferred_task(ctrl, 3, [2])
    ctrl.submit(first)
    ctrl.submit(second)
    ctrl.submit(pending, queued=False)
    assert first.state is TaskState.QUEUED  # nothing runs until someone joins
    ctrl.join([1])
    assert first.state is TaskState.WRITTEN
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([0])), rows_for([0]))
    # A pending write is never queued, so an idle committer cannot finish it.
    with pytest.raises(OmniPrefixCacheUnmatchError, match="task 3 .*did not reach done.*state=PENDING"):
        ctrl.join([3])
    ctrl.shutdown()


def test_committer_step_finishes_a_claimed_copy_before_anything_else():
    # Found by the system race test: a join driving an on-demand committer
    # gave up on a task a test had claimed but not copied.
    ctrl, _ = make(committer="on_demand", timeout=0.0)
    task = deferred_task(ctrl, 1, [0])
    ctrl.submit(task)
    assert ctrl.parts.committer.claim() == 1
    ctrl.join([1])
    assert task.state is TaskState.WRITTEN
    ctrl.shutdown()


class PausingCopyStage:
    """The controller's copy stage, then a pause (the task is copied, not yet
    moved on) until ``let_go``."""

    def __init__(self, inner):
        self.inner = inner
        self.in_copy, self.let_go = threading.Event(), threading.Event()

    def copy_task(self, task):
        self.inner.copy_task(task)  # copied, not yet HOST_READY nor queued for its pool write
        self.in_copy.set()
        assert self.let_go.wait(10), "joiner B never ran"

    def copy_batch(self, batch):
        guarded_each(batch, self.copy_task)


def test_on_demand_join_writes_a_task_another_joiner_copied_while_it_looked(monkeypatch):
    # Found in the full suite (a device-engine simulation whose prefetch
    # thread joins too): joiner B found no committer work because joiner A
    # had claimed the task and was inside its copy; A then queued the write
    # and left, and B waited out the whole timeout for a write nobody ran.
    ctrl, pool = make(committer="on_demand", timeout=10.0)
    task = deferred_task(ctrl, 1, [0])
    ctrl.submit(task)
    paused = PausingCopyStage(ctrl.parts.stages.copy)
    ctrl.parts.stages.use(copy=paused)
    joiner_a = threading.Thread(target=ctrl.parts.committer.step)
    joiner_a.start()
    try:
        assert paused.in_copy.wait(10)
        errors: list[BaseException] = []

        def joiner_b() -> None:
            try:
                ctrl.join([1])
            except BaseException as exc:  # reported below
                errors.append(exc)

        b_idle = threading.Event()
        real_step = Committer.step

        def watched_step(committer):
            out = real_step(committer)
            if out is None and threading.current_thread() is b:
                b_idle.set()
            return out

        monkeypatch.setattr(Committer, "step", watched_step)
        b = threading.Thread(target=joiner_b)
        b.start()
        # B's first look finds nothing to do: the copy is still A's.
        assert b_idle.wait(10)
        paused.let_go.set()
        joiner_a.join(10)
        b.join(10)
        assert not b.is_alive() and not errors, errors
        assert task.state is TaskState.WRITTEN
        assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([0])), rows_for([0]))
    finally:
        paused.let_go.set()
        ctrl.shutdown()


def test_released_holder_is_released_not_unheld_and_cannot_hold_again():
    ctrl, _ = make(eager=True)
    pool = ctrl.parts.staging_pool
    step = StagingBufferHolder.for_step(4)
    assert pool.holder_state(step).name == "UNHELD"
    claim = ctrl.parts.staging_pool.stage_step({}, 0, None, step)
    assert pool.holder_state(step).name == "HELD"
    ctrl.parts.staging_pool.release(claim.page, step)
    assert pool.holder_state(step).name == "RELEASED"
    with pytest.raises(OmniPrefixCacheUnmatchError, match="step 4 cannot claim from RELEASED"):
        ctrl.parts.staging_pool.stage_step({}, 0, None, step)
    # An id below one that already held a page had its turn too.
    with pytest.raises(OmniPrefixCacheUnmatchError, match="step 2 cannot claim from RELEASED"):
        ctrl.parts.staging_pool.stage_step({}, 0, None, StagingBufferHolder.for_step(2))
    assert not pool.holders()


def test_set_host_tensor_on_an_illegal_move_installs_nothing():
    task = WriteTask(
        tid=9,
        req_id="r",
        write_n=1,
        schedule=WriteSchedule.JOIN_ON_FINISH,
        chunks=[WriteChunk(slots_cpu=torch.tensor([0]), tensors={HIDDEN_KEY: rows_for([0])})],
    )
    with pytest.raises(OmniPrefixCacheUnmatchError, match="task 9: illegal transition PENDING -> HOST_READY"):
        task.set_host_tensor([(task.chunks[0], HIDDEN_KEY, rows_for([0]))])
    assert task.chunks[0].host == {} and task.state is TaskState.PENDING


def test_joined_views_of_one_buffer_share_it_and_others_are_copied():
    from omni_prefix_cache.writes.pool_writer import joined

    page = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    parts = list(torch.split(page[1:7], [2, 1, 3]))
    merged = joined(parts)
    assert torch.equal(merged, page[1:7]) and merged.data_ptr() == page[1].data_ptr()
    gapped = [page[0:2], page[3:5]]
    assert torch.equal(joined(gapped), torch.cat(gapped)) and joined(gapped).data_ptr() != page.data_ptr()
    other = [page[0:2], page.clone()[2:4]]
    assert torch.equal(joined(other), page[0:4])


def test_a_committer_pass_takes_the_high_queue_whole_and_deferred_writes_one_at_a_time():
    # The committer thread claims and copies a pass as one batch. Immediate writes (high queue)
    # go together; a deferred copy (low queue) is long, so a pass takes one, and an immediate
    # write queued behind it is claimed before the next deferred one.
    ctrl, pool = make(committer="manual")
    lows = [deferred_task(ctrl, tid, [tid]) for tid in (1, 2)]
    for task in lows:
        ctrl.submit(task, queued=True)
    assert list(ctrl.queues.low) == [1, 2]
    assert ctrl.parts.committer.step() == "copy"
    assert list(ctrl.queues.low) == [2] and lows[0].state is TaskState.HOST_READY
    highs = [deferred_task(ctrl, tid, [tid]) for tid in (3, 4)]
    for task in highs:
        ctrl.submit(task, queued=False)
    ctrl.escalate([3, 4])
    assert list(ctrl.queues.high) == [4, 3]
    assert ctrl.parts.committer.step() == "write"  # the first pass's copy is written first
    assert ctrl.parts.committer.step() == "copy"
    assert not ctrl.queues.high and list(ctrl.queues.low) == [2]
    assert all(t.state is TaskState.HOST_READY for t in highs)
    while ctrl.parts.committer.step() is not None:
        pass
    for tid in (1, 2, 3, 4):
        assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([tid])), rows_for([tid]))
    ctrl.shutdown()


def test_the_committer_thread_calls_after_write_once_a_pass_wrote_with_no_lock_held():
    cfg = PrefixCacheConfig(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, staging_depth=2, staging_capacity_tokens=NUM_SLOTS
    )
    pool = FlakyPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
    seen: list[tuple[str, bool, list[TaskState]]] = []
    called = threading.Event()
    tasks: list[WriteTask] = []

    def free_elsewhere() -> bool:
        # The controller lock is free if another thread can take it now.
        took: list[bool] = []

        def take() -> None:
            took.append(ctrl.lock.acquire(timeout=2))
            if took[0]:
                ctrl.lock.release()

        other = threading.Thread(target=take)
        other.start()
        other.join()
        return took == [True]

    def after_write() -> None:
        # What the manager's drain would see: the pass's tasks written, their records public.
        seen.append((threading.current_thread().name, free_elsewhere(), [t.state for t in tasks]))
        called.set()

    ctrl = OmniPrefixCacheController(pool, cfg, eager=False, committer="thread", after_write=after_write)
    try:
        tasks.append(deferred_task(ctrl, 1, [1]))
        ctrl.submit(tasks[0])
        assert called.wait(10), "the committer never called after_write"
        name, free, states = seen[0]
        assert name == "omni-prefix-cache-committer" and free
        assert states == [TaskState.WRITTEN] and 1 in ctrl.parts.registry.completed
    finally:
        ctrl.shutdown()
