"""The CUDA path, checked on CPU through the copy-engine seam.

``FakeDeviceEngine`` is the real ``CudaCopyEngine`` over a runtime that logs
every stream and event call and treats CPU tensors as device tensors, so the
ordering rules (freeze before copy, sources held on the reading lane, host
wait before the host reads) and the memory rules (no pinned pool, no device
temporaries on the copy and read lanes, one budget on every engine) fail
here when broken. The ``cuda``-marked tests at the end run only on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

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
from omni_prefix_cache.device.copy_engine import CpuCopyEngine, CudaCopyEngine, CudaRuntime, DeviceEvents
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    WriteSchedule,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.fake_device import Call, FakeDeviceEngine, storage_ptr

WIDTH = 4
BS = 4
NUM_BLOCKS = 16
NUM_SLOTS = NUM_BLOCKS * BS


def config(**kw: Any) -> PrefixCacheConfig:
    base = dict(num_blocks=NUM_BLOCKS, block_size=BS, staging_depth=2, staging_capacity_tokens=NUM_SLOTS)
    base.update(kw)
    return PrefixCacheConfig(**base)


class LoggedPool(PrefixBlockPool):
    """Logs each pool write into the fake runtime's call list."""

    def __init__(self, cfg: PrefixCacheConfig, engine: FakeDeviceEngine) -> None:
        super().__init__(cfg)
        self.fake_engine = engine

    def write(self, key: str, slots: torch.Tensor, host: torch.Tensor) -> None:
        self.fake_engine.rt.log(Call("pool_write", ptr=storage_ptr(host)))
        super().write(key, slots, host)


@pytest.fixture
def fake() -> Iterator[tuple[OmniPrefixCacheController, LoggedPool, FakeDeviceEngine]]:
    engine = FakeDeviceEngine()
    cfg = config()
    pool = LoggedPool(cfg, engine)
    pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
    ctrl = OmniPrefixCacheController(pool, cfg, eager=False, committer="manual", engine=engine)
    yield ctrl, pool, engine
    ctrl.shutdown()


def rows_for(slots: list[int], salt: float = 0.0) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.float32)[:, None].repeat(1, WIDTH) + salt


def index(calls: list[Call], match: Any) -> int:
    """Position of the first call for which ``match(call)`` holds."""
    for i, call in enumerate(calls):
        if match(call):
            return i
    raise AssertionError(f"no matching call in {calls}")


def deferred_task(ctrl: OmniPrefixCacheController, engine: FakeDeviceEngine, tid: int, parts: list[list[int]]):
    """A JOIN_ON_FINISH task with one chunk (clone + freeze event) per part."""
    task: WriteTask | None = None
    clones = []
    for slots in parts:
        clone = rows_for(slots, salt=0.5)
        clones.append(clone)
        ticket = BudgetTicket(nbytes=clone.numel() * clone.element_size())
        ctrl.reserve(ticket.nbytes)
        chunk = WriteChunk(slots_cpu=torch.tensor(slots), tensors={HIDDEN_KEY: clone}, budget=ticket)
        freeze = ctrl.parts.host_rows.engine.freeze([clone])
        if task is None:
            task = WriteTask(
                tid=tid,
                req_id=f"r{tid}",
                write_n=1,
                schedule=WriteSchedule.JOIN_ON_FINISH,
                chunks=[chunk],
                freeze_event=freeze,
            )
            ctrl.parts.budget.pin(ticket, tid)
            ctrl.submit(task, queued=False)
        else:
            assert task.append_chunk(chunk, freeze) is None
            ctrl.parts.budget.pin(ticket, tid)
    assert task is not None
    return task, clones


# ================================================================ item 1: host memory


def test_pool_slabs_are_never_pinned_even_where_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is written and read by the host only: no slab asks for pinned memory."""
    asked: list[Any] = []
    real_empty = torch.empty

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        asked.append(kw.get("pin_memory"))
        kw.pop("pin_memory", None)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", spy)
    pool = PrefixBlockPool(config())
    slab = pool.ensure_key(HIDDEN_KEY, torch.bfloat16, WIDTH)
    pool.ensure_key("m", torch.float32, 3)
    assert True not in asked
    assert slab.shape == (NUM_SLOTS, WIDTH) and slab.dtype == torch.bfloat16
    assert not bool(slab.any()), "a new slab reads as zeros (the baseline of never-written mm rows)"
    assert pool.host_bytes() == NUM_SLOTS * (WIDTH * 2 + 3 * 4)


def test_new_slab_is_aligned_writable_and_owned() -> None:
    pool = PrefixBlockPool(config())
    slab = pool.new_slab(torch.float16, 5)
    assert slab.data_ptr() % 64 == 0 and slab.is_contiguous()
    pool.install_key("k", slab)
    pool.write("k", torch.tensor([3, 1]), torch.ones(2, 5, dtype=torch.float16))
    assert pool.rows("k", torch.tensor([1, 2, 3])).sum().item() == 10.0


def test_pinned_memory_only_where_a_device_copy_lands(fake: Any) -> None:
    """Staging pages (and deferred landing buffers) go through the engine's
    pinned allocator; the block pool never does."""
    ctrl, pool, engine = fake
    step = StagingBufferHolder.for_step(1)
    src = rows_for([0, 1, 2])
    claim = ctrl.parts.staging_pool.stage_step({HIDDEN_KEY: src}, 3, ctrl.parts.host_rows.engine.freeze([src]), step)
    page_bytes = 2 * NUM_SLOTS * WIDTH * 4
    assert engine.rt.pinned_bytes == page_bytes
    assert ctrl.stats()["staging_host_bytes"] == page_bytes
    assert pool.host_bytes() == NUM_SLOTS * WIDTH * 4
    ctrl.parts.staging_pool.release(claim.page, step)


def test_manager_stats_report_pool_host_bytes() -> None:
    view = SimpleNamespace(block_size=BS)
    mgr = OmniPrefixCacheManager(config(), view, eager=True)
    try:
        assert mgr.stats()["pool_host_bytes"] == 0
        mgr._pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
        assert mgr.stats()["pool_host_bytes"] == NUM_SLOTS * WIDTH * 4
    finally:
        mgr.shutdown()


# ================================================================ items 2-5: lanes, order, temporaries


def test_staging_copy_waits_the_freeze_records_the_clone_and_lands_before_the_pool_write(fake: Any) -> None:
    ctrl, pool, engine = fake
    src = rows_for([4, 5, 6])
    freeze = ctrl.parts.host_rows.engine.freeze([src])
    step = StagingBufferHolder.for_step(1)
    claim = ctrl.parts.staging_pool.stage_step({HIDDEN_KEY: src}, 3, freeze, step)
    task = WriteTask(
        tid=1,
        req_id="r",
        write_n=1,
        schedule=WriteSchedule.JOIN_NEXT_STEP,
        chunks=[
            WriteChunk(
                slots_cpu=torch.tensor([4, 5, 6]), tensors={HIDDEN_KEY: src}, host={HIDDEN_KEY: claim.views[HIDDEN_KEY]}
            )
        ],
        freeze_event=freeze,
        page=claim.page,
        step_d2h_event=claim.event,
    )
    ctrl.register(task)  # binds its holder to the step's page
    ctrl.dispatch([task])
    while ctrl.parts.committer.step() is not None:
        pass
    calls = engine.rt.ops()
    (freeze_ev,) = freeze.events.values()
    frozen = index(calls, lambda c: c.op == "record" and c.event == freeze_ev.id)
    assert calls[frozen].stream == "compute0"
    waited = index(calls, lambda c: c.op == "wait" and c.event == freeze_ev.id)
    copied = index(calls, lambda c: c.op == "copy")
    done = index(calls, lambda c: c.op == "record" and c.event == claim.event.id)
    held = index(calls, lambda c: c.op == "hold" and c.ptr == storage_ptr(src) and c.event == claim.event.id)
    synced = index(calls, lambda c: c.op == "sync" and c.event == claim.event.id)
    written = index(calls, lambda c: c.op == "pool_write")
    assert frozen < waited < copied < done < held < synced < written, calls
    assert {calls[i].stream for i in (waited, copied, done, held)} == {"copy0"}
    assert task.state is TaskState.WRITTEN
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([4, 5, 6])), src)
    ctrl.parts.staging_pool.release(claim.page, step)


def test_deferred_copy_has_no_device_cat_and_lands_in_one_host_tensor(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctrl, pool, engine = fake
    task, clones = deferred_task(ctrl, engine, 1, [[0, 1], [2, 3, 4], [9]])
    device_ptrs = {storage_ptr(c) for c in clones}
    cat_inputs: list[int] = []
    real_cat = torch.cat

    def spy_cat(tensors: Any, *args: Any, **kw: Any) -> torch.Tensor:
        cat_inputs.extend(storage_ptr(t) for t in tensors)
        return real_cat(tensors, *args, **kw)

    monkeypatch.setattr(torch, "cat", spy_cat)
    ctrl.escalate([1])
    while ctrl.parts.committer.step() is not None:
        pass
    assert task.state is TaskState.WRITTEN
    assert not device_ptrs & set(cat_inputs), "a device chunk was concatenated on the copy path"
    calls = engine.rt.ops()
    copies = [c for c in calls if c.op == "copy"]
    assert [c.ptr for c in copies] == [storage_ptr(c) for c in clones]
    assert {c.stream for c in copies} == {"copy0"}
    # Every clone is held on the lane that reads it, until the event recorded after its copy.
    for ptr in (storage_ptr(clone) for clone in clones):
        held = [i for i, c in enumerate(calls) if c.op == "hold" and c.ptr == ptr]
        copied = [i for i, c in enumerate(calls) if c.op == "copy" and c.ptr == ptr]
        assert held and copied and calls[held[0]].stream == "copy0" and copied[0] < held[0]
    # The last freeze (newest chunk) is waited before the first copy.
    first_copy = index(calls, lambda c: c.op == "copy")
    waits = [i for i, c in enumerate(calls) if c.op == "wait" and c.stream == "copy0"]
    assert waits and max(waits) < first_copy
    # Host rows of all chunks are slices of one landing tensor, waited before the pool write.
    landing = {storage_ptr(chunk.host[HIDDEN_KEY]) for chunk in task.chunks}
    assert len(landing) == 1
    synced = index(calls, lambda c: c.op == "sync" and c.stream == "copy0")
    assert synced < index(calls, lambda c: c.op == "pool_write")
    assert torch.equal(pool.rows(HIDDEN_KEY, torch.tensor([0, 1, 2, 3, 4, 9])), rows_for([0, 1, 2, 3, 4, 9], 0.5))
    assert ctrl.stats()["staged_bytes"] == 0


def test_read_of_a_device_clone_allocates_nothing_on_the_device(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl, _, engine = fake
    task, clones = deferred_task(ctrl, engine, 1, [[0, 1, 2, 3], [8, 9, 10]])
    device_ptrs = {storage_ptr(c) for c in clones}
    touched: list[int] = []
    real_select, real_cat = torch.Tensor.index_select, torch.cat

    def spy_select(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        touched.append(storage_ptr(self))
        return real_select(self, *args, **kw)

    def spy_cat(tensors: Any, *args: Any, **kw: Any) -> torch.Tensor:
        touched.extend(storage_ptr(t) for t in tensors)
        return real_cat(tensors, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "index_select", spy_select)
    monkeypatch.setattr(torch, "cat", spy_cat)
    slots = torch.tensor([10, 0, 1, 3, 8, 2])
    got = ctrl.parts.host_rows.fetch(task, slots, HIDDEN_KEY)
    assert torch.equal(got, rows_for(slots.tolist(), 0.5))
    assert not device_ptrs & set(touched), "a gather or cat ran on a device clone"
    calls = engine.rt.ops()
    reads = [i for i, c in enumerate(calls) if c.stream == "read0"]
    assert reads, "the read lane was not used"
    read_calls = [calls[i] for i in reads]
    ops = [c.op for c in read_calls]
    assert ops.index("wait") < ops.index("copy") and [op for op in ops if op != "hold"][-2:] == ["record", "sync"]
    # Runs of consecutive rows are one copy each: [10], [0,1], [3], [8], [2].
    assert ops.count("copy") == 5
    assert engine.lane_uses["read"] == 2


def test_lanes_and_freeze_events_follow_the_tensors_device(fake: Any) -> None:
    ctrl, _, engine = fake
    on1 = engine.rt.place(rows_for([0, 1]), 1)
    on0 = rows_for([2, 3])
    freeze = ctrl.parts.host_rows.engine.freeze([on1, on0])
    assert isinstance(freeze, DeviceEvents) and set(freeze.events) == {0, 1}
    assert {freeze.events[d].stream for d in (0, 1)} == {"compute0", "compute1"}
    a, b = torch.empty(2, WIDTH), torch.empty(2, WIDTH)
    done = engine.launch(freeze, [(a, on1), (b, on0)])
    assert isinstance(done, DeviceEvents) and {done.events[d].stream for d in (0, 1)} == {"copy0", "copy1"}
    calls = engine.rt.ops("copy", "hold")
    assert {c.stream for c in calls if c.ptr == storage_ptr(on1)} == {"copy1"}
    assert {c.stream for c in calls if c.ptr == storage_ptr(on0)} == {"copy0"}
    done.synchronize()
    assert torch.equal(a, on1) and torch.equal(b, on0)
    # A newer single-device freeze keeps the older event of the other device.
    merged = DeviceEvents.merged(freeze, ctrl.parts.host_rows.engine.freeze([on0]))
    assert set(merged.events) == {0, 1} and merged.events[1] is freeze.events[1]


def test_failed_copy_holds_clones_on_the_lane_fails_the_task_and_frees_the_budget(fake: Any) -> None:
    ctrl, _, engine = fake
    task, clones = deferred_task(ctrl, engine, 1, [[0, 1], [2, 3]])
    poisoned = storage_ptr(clones[1])

    class Boom(RuntimeError):
        pass

    real = engine.copy_into

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        if storage_ptr(src) == poisoned:
            raise Boom("injected copy failure")
        real(dst, src)

    engine.copy_into = failing  # type: ignore[method-assign]
    ctrl.escalate([1])
    while ctrl.parts.committer.step() is not None:
        pass
    assert task.state is TaskState.FAILED
    assert all(not chunk.tensors for chunk in task.chunks), "the clone is dropped on failure"
    held = {c.ptr for c in engine.rt.ops("hold") if c.stream == "copy0"}
    assert storage_ptr(clones[0]) in held, "a clone a queued copy reads was dropped without a hold"
    assert ctrl.stats()["staged_bytes"] == 0
    with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
        ctrl.join([1])


def test_a_lane_holds_its_sources_until_its_event_is_done_and_for_good_after_a_fault(fake: Any) -> None:
    _, _, engine = fake
    first, second, third = rows_for([0, 1]), rows_for([2, 3]), rows_for([4, 5])
    done = engine.launch(None, [(torch.empty(2, WIDTH), first)])
    engine.rt.busy_events.add(done.id)  # the lane has not reached the event yet
    engine.launch(None, [(torch.empty(2, WIDTH), second)])
    held = {storage_ptr(t) for t in engine.held_sources()}
    assert held == {storage_ptr(first), storage_ptr(second)}, "a source was released before its copy was done"
    engine.rt.busy_events.clear()
    engine.launch(None, [(torch.empty(2, WIDTH), third)])
    assert {storage_ptr(t) for t in engine.held_sources()} == {storage_ptr(third)}
    # A dead context: the query raises, and nothing is released again (freeing device memory
    # after a fault can abort the process inside torch's allocator).
    engine.rt.fault = "CUDA error: an illegal memory access was encountered (injected)"
    engine.launch(None, [(torch.empty(2, WIDTH), first)])
    engine.rt.fault = None
    engine.launch(None, [(torch.empty(2, WIDTH), second)])
    assert {storage_ptr(t) for t in engine.held_sources()} == {storage_ptr(t) for t in (third, first, second)}


def test_cuda_runtime_events_block_and_streams_bind_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(("event", kw)) or SimpleNamespace(**kw))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: made.append(("stream", kw)) or SimpleNamespace(**kw))
    rt = CudaRuntime()
    assert rt.new_event().blocking is True
    rt.new_stream(3, "copy")
    assert made == [("event", {"blocking": True}), ("stream", {"device": 3})]


def test_cpu_engine_copies_on_return_with_no_event() -> None:
    engine = CpuCopyEngine()
    dst = torch.empty(2, WIDTH)
    assert engine.launch(None, [(dst, rows_for([1, 2]))]) is None
    assert torch.equal(dst, rows_for([1, 2]))
    assert engine.freeze([rows_for([1])]) is None and not engine.is_device(dst)


# ================================================================ item 6: one budget on every engine


class _Recorder:
    """Wraps a manager: the staged bytes after every save."""

    def __init__(self, mgr: OmniPrefixCacheManager) -> None:
        self.mgr = mgr
        self.staged: list[int] = []

    def save_outputs(self, *args: Any, **kw: Any) -> int:
        sid = self.mgr.save_outputs(*args, **kw)
        self.staged.append(int(self.mgr.stats()["staged_bytes"]))
        return sid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mgr, name)


def _budget_run(engine: Any, caplog: pytest.LogCaptureFixture) -> tuple[list[int], int, Any]:
    from omni_prefix_cache.tools.simulate.engine import SimConfig, run_simulation

    made: list[_Recorder] = []

    def factory(cfg: PrefixCacheConfig, view: Any, eager: bool) -> Any:
        mgr = OmniPrefixCacheManager(cfg, view, eager=False, committer="on_demand", engine=engine)
        made.append(_Recorder(mgr))
        return made[-1]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="omni_prefix_cache"):
        res = run_simulation(SimConfig(seed=3, steps=50, eager=False, lag=False), manager_factory=factory)
    flushes = int(made[0].mgr.stats()["budget_flushes_total"])
    return made[0].staged, flushes, res


def test_budget_accounting_is_identical_on_host_and_device_engines(caplog: pytest.LogCaptureFixture) -> None:
    """Same trace, same budget after every save and the same flushes: the
    budget charges the deferred clone only, whatever engine runs it."""
    device = FakeDeviceEngine()
    host_trace, host_flushes, host_res = _budget_run(CpuCopyEngine(), caplog)
    dev_trace, dev_flushes, dev_res = _budget_run(device, caplog)
    assert host_res.error is None and dev_res.error is None
    assert host_res.mismatches == 0 and dev_res.mismatches == 0 and dev_res.rows_checked > 0
    assert device.lane_uses["copy"] > 0, "the device run did not take the device branches"
    assert dev_flushes > 0, "the run never filled the budget; the comparison proves nothing"
    assert (dev_trace, dev_flushes) == (host_trace, host_flushes)


def test_a_steps_device_clones_are_freed_once_its_rows_are_on_the_host() -> None:
    # A save's immediate rows are one write over one StepRows; its device clones back none
    # of it once the step's staging copy landed, so its copy stage frees them, not its drain.
    from tests.test_manager import BlockView, Driver, Req

    engine = FakeDeviceEngine()
    view = BlockView()
    mgr = OmniPrefixCacheManager(config(), view, eager=False, committer="manual", engine=engine)
    try:
        drv = Driver(mgr, view, keys=(HIDDEN_KEY, "m"))
        sid, want = drv.run({"a": Req([0, 1], 0, 5), "b": Req([2, 3], 0, 3)})
        records = list(mgr._ledger.records.values())
        steps = {id(chunk.step): chunk.step for rec in records for _, chunk in rec.parts}
        assert len(records) == 1 and len(steps) == 1
        assert records[0].task.req_ids == ("a", "b")
        (step,) = steps.values()
        assert set(step.tensors) == {HIDDEN_KEY, "m"}, "the fake device engine treats the outputs as device tensors"
        ctrl = mgr._controller
        assert ctrl.parts.committer.claim() is not None and ctrl.parts.committer.copy() is not None
        assert step.tensors == {}
        while ctrl.parts.committer.step() is not None:
            pass
        drv.check(sid, want)
    finally:
        mgr.shutdown()


# ================================================================ device faults


def test_device_fault_in_materialize_raises_then_sticks() -> None:
    from tests.test_manager import BlockView, Driver, Req

    engine = FakeDeviceEngine()
    view = BlockView()
    mgr = OmniPrefixCacheManager(config(staging_claim_timeout_s=5.0), view, eager=False, engine=engine)
    try:
        mgr.register_policy(ModelCachePolicy(deferred_keys=frozenset({"d"})))
        drv = Driver(mgr, view, keys=(HIDDEN_KEY, "m", "d"))
        sid, want = drv.run({"a": Req([0, 1], 0, 6)})
        drv.check(sid, want)
        sid, _ = drv.run({"a": Req([0, 1], 6, 1)}, new=[])
        engine.rt.fault = "CUDA error: an illegal memory access was encountered (injected)"
        with pytest.raises(OmniPrefixCacheUnmatchError, match=f"step {sid}: device fault"):
            mgr.materialize(sid, ["a"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="device fault"):
            mgr.new_step_starts(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"a"}))
    finally:
        mgr.shutdown()
    assert all(t.is_terminal for t in mgr._controller.parts.registry.tasks.values())


# ================================================================ CUDA only


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lanes_pin_only_landing_memory_and_order_after_a_slow_forward() -> None:  # pragma: no cover
    """A slow kernel writes the source after save; the copy must still see it."""
    cfg = config()
    pool = PrefixBlockPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, WIDTH)
    engine = CudaCopyEngine()
    ctrl = OmniPrefixCacheController(pool, cfg, eager=False, committer="manual", engine=engine)
    try:
        live = torch.zeros(8, WIDTH, device="cuda")
        rows = rows_for(list(range(8))).cuda()
        torch.cuda._sleep(50_000_000)  # the forward is still running when the host saves
        live.copy_(rows)
        clone = live.clone()
        freeze = ctrl.parts.host_rows.engine.freeze([clone])
        live.fill_(-1.0)  # the next "forward" overwrites the static buffer
        step = StagingBufferHolder.for_step(1)
        claim = ctrl.parts.staging_pool.stage_step({HIDDEN_KEY: clone}, 8, freeze, step)
        del clone
        garbage = torch.full((8, WIDTH), float("nan"), device="cuda")  # may recycle the clone's block
        claim.event.synchronize()
        assert claim.views[HIDDEN_KEY].is_pinned() and not pool._slab(HIDDEN_KEY).is_pinned()
        assert torch.equal(claim.views[HIDDEN_KEY], rows_for(list(range(8))))
        assert engine.lane_uses["copy"] == 1
        del garbage
        ctrl.parts.staging_pool.release(claim.page, step)
    finally:
        ctrl.shutdown()
