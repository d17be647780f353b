"""The controller keeps one failure record per failure cause, not one per
failed task (issue 28, item 4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_prefix_cache.interface import OmniPrefixCacheWriteFailedError, PrefixCacheConfig, WriteSchedule
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.writes.chunks import WriteChunk
from omni_prefix_cache.writes.write_errors import write_error
from omni_prefix_cache.writes.write_task import WriteTask
from test_manager import BS, MODES, NUM_BLOCKS, BlockView, Driver, Req, make, quiesce


@pytest.mark.parametrize("eager", MODES)
def test_one_fault_failing_several_writes_leaves_one_record_naming_them_all(eager: bool, managers: list[Any]) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    ctrl = mgr.components.controller
    drv.check(*drv.run({"a": Req([0], 0, 4)}))
    quiesce(mgr)
    pool = mgr.components.pool
    real_write = pool.write
    fault = RuntimeError("injected pool fault")  # one fault, every write it reaches fails

    def failing_write(key: str, slots: torch.Tensor, host: torch.Tensor) -> None:
        if key == "m":
            raise fault
        real_write(key, slots, host)

    pool.write = failing_write  # type: ignore[method-assign]
    reqs = {"b": Req([1], 0, 4), "c": Req([2], 0, 4), "d": Req([3], 0, 4)}
    try:
        sid, _ = drv.run(reqs)
    except OmniPrefixCacheWriteFailedError:
        assert eager  # eager: the dispatch itself raises, and releases the step
    else:
        mgr.discard_step(sid)
        # One join per write: a join raises at the first failed one.
        for tid in [t.tid for t in list(ctrl.parts.registry.tasks.values()) if set(t.req_ids) & reqs.keys()]:
            with pytest.raises(OmniPrefixCacheWriteFailedError):
                ctrl.join([tid])
    pool.write = real_write  # type: ignore[method-assign]
    failed = {tid for tid, t in ctrl.parts.registry.tasks.items() if t.state.name == "FAILED"}
    # The step's rows are one write: it holds every request of the step.
    assert [rid for tid in sorted(failed) for rid in ctrl.parts.registry.tasks[tid].req_ids] == list(reqs)
    assert len(ctrl.parts.registry.failures()) == 1, "one fault, one record"
    records = ctrl.parts.registry.failures()
    assert len(records) == 1
    (record,) = records
    assert record.tids == failed and record.error.__cause__ is fault
    assert all(ctrl.parts.registry.failure_of(tid) is record.error for tid in failed)
    # A joiner of any of them is told about its own write, with the shared cause,
    # naming every request it holds and each one's slot range.
    for tid in sorted(failed):
        task = ctrl.parts.registry.tasks[tid]
        with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
            ctrl.join([tid])
        assert info.value.tid == tid and info.value.req_ids == task.req_ids == tuple(reqs)
        step_slots = [s for rid in reqs for s in drv.view.slot_ids(rid, 0, 4)]
        assert info.value.slots == tuple(step_slots) and "m" in info.value.keys
        for rid in reqs:
            ids = drv.view.slot_ids(rid, 0, 4)
            assert f"req {rid!r} rows" in str(info.value) and f"slots {min(ids)}..{max(ids)}" in str(info.value)
        assert info.value.__cause__ is fault
    with pytest.raises(OmniPrefixCacheWriteFailedError, match="injected pool fault"):
        drv.run({"e": Req([4], 0, 4)})


def test_distinct_causes_keep_distinct_records(managers: list[Any]) -> None:
    view = BlockView()
    mgr = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS), view, eager=False, committer="manual"
    )
    managers.append(mgr)
    drv = Driver(mgr, view)
    ctrl = mgr.components.controller
    drv.run({"a": Req([0], 0, 4), "b": Req([1], 0, 4)})
    # The step's write and a second, hand-made write: two tasks, two causes.
    chunk = WriteChunk(slots_cpu=torch.tensor([60, 61]), tensors={}, host={"m": torch.zeros(2, 1)})
    side = WriteTask(tid=999, req_id="z", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[chunk])
    ctrl.register(side, queued=False)
    tasks = sorted(ctrl.parts.registry.tasks.values(), key=lambda t: t.tid)
    assert len(tasks) == 2
    first, second = RuntimeError("first"), RuntimeError("second")
    ctrl.fail_task(tasks[0], write_error(tasks[0], first, "copy"))
    ctrl.fail_task(tasks[1], write_error(tasks[1], second, "copy"))
    records = ctrl.parts.registry.failures()
    assert [r.error.__cause__ for r in records] == [first, second]
    assert [r.tids for r in records] == [{tasks[0].tid}, {tasks[1].tid}]
    assert all(r.error.tid == next(iter(r.tids)) for r in records)
