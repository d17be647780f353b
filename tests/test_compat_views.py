"""Compat's per-request seams over a step's one immediate write: reading seams
serve per-request views built on read (``request_write_ids``, ``get_task`` of a
view id, ``RequestTasksView``), and a WriteTask method patched on the class
switches the ledger to one write per request while the patch lasts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_prefix_cache.compat.controller_seams import RequestWriteView, request_write_ids
from omni_prefix_cache.compat.manager_seams import RequestTasksView
from omni_prefix_cache.compat.write_task_seams import UpstreamTaskSeams
from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.writes.write_task import TaskState, WriteTask
from test_manager import BS, NUM_BLOCKS, BlockView, Driver, Req, make

STEP = {"a": Req([0], 0, 3), "b": Req([1], 0, 1), "c": Req([2], 0, 2)}


def _manual() -> tuple[OmniPrefixCacheManager, Driver]:
    """A threaded-mode manager whose committer runs only when stepped."""
    view = BlockView()
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS)
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer="manual")
    return mgr, Driver(mgr, view)


def test_a_class_level_method_patch_is_noticed_until_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not WriteTask.seams_wrapped
    original = WriteTask.mark_host_ready
    monkeypatch.setattr(WriteTask, "mark_host_ready", lambda task: original(task))
    assert WriteTask.seams_wrapped
    monkeypatch.undo()
    assert not WriteTask.seams_wrapped and WriteTask.mark_host_ready is original
    # A method the class inherits (its undo is a delattr), on WriteTask or on the mixin.
    monkeypatch.setattr(WriteTask, "claim_copy", lambda task: True)
    monkeypatch.setattr(UpstreamTaskSeams, "mark_done", lambda task: None)
    assert WriteTask.seams_wrapped
    monkeypatch.undo()
    assert not WriteTask.seams_wrapped and "claim_copy" not in vars(WriteTask)
    # Neither a plain class attribute (a field default), a dunder, nor a method off the
    # copy and pool-write path (a runtime mutant's patch) is a per-request seam.
    monkeypatch.setattr(WriteTask, "staging_slot", 3)
    monkeypatch.setattr(WriteTask, "__doc__", "x")
    monkeypatch.setattr(WriteTask, "taken_over_intersects", lambda task, chunk: False)
    assert not WriteTask.seams_wrapped
    monkeypatch.undo()


@pytest.mark.parametrize("patched", [False, True], ids=["step-write", "per-request"])
def test_a_patched_method_gives_each_request_its_own_step_write(monkeypatch: pytest.MonkeyPatch, patched: bool) -> None:
    if patched:
        original = WriteTask.mark_host_ready
        monkeypatch.setattr(WriteTask, "mark_host_ready", lambda task: original(task))
    mgr, drv = make(True)
    try:
        sid, want = drv.run(STEP)
        tasks = sorted(mgr.components.controller.tasks.values(), key=lambda t: t.tid)
        want_units = [(rid,) for rid in STEP] if patched else [tuple(STEP)]
        assert [t.req_ids for t in tasks] == want_units
        assert all(type(t) is WriteTask and t.state is TaskState.WRITTEN for t in tasks)
        assert mgr.components.ledger.previous_step_writes == [t.tid for t in tasks]
        drv.check(sid, want)
    finally:
        mgr.shutdown()


def test_reading_seams_serve_one_view_per_request_of_a_step_write() -> None:
    mgr, drv = _manual()
    try:
        sid, want = drv.run(STEP)
        ctrl, ledger = mgr.components.controller, mgr.components.ledger
        (step_tid,) = ledger.previous_step_writes
        write = ctrl.tasks[step_tid]
        ids = request_write_ids(write)
        assert [rid for rid, _ in ids] == list(STEP)
        view_tids = [vid for _, vid in ids]
        assert len(set(view_tids)) == 3 and all(vid < 0 and vid not in ctrl.tasks for vid in view_tids)
        table = RequestTasksView(ledger).tasks
        assert {rid: list(tids) for rid, tids in table.items()} == {rid: [vid] for rid, vid in ids}
        slots = write.chunks[0].slots_cpu
        start = 0
        for (rid, vid), req in zip(ids, STEP.values(), strict=True):
            view: Any = ctrl.get_task(vid)
            assert isinstance(view, RequestWriteView) and view.task is write
            assert (view.tid, view.req_id, view.rows) == (vid, rid, (start, start + req.count))
            assert torch.equal(view.slots, slots[start : start + req.count])
            assert view.state is write.state is TaskState.QUEUED  # read live from the step's write
            start += req.count
        # No view id: a tid, an owner array's -1, an index past the step's requests.
        assert ctrl.get_task(-1) is None and ctrl.get_task(min(view_tids) - 1) is None
        assert ctrl.get_task(step_tid) is write
        while ctrl.committer_step() is not None:
            pass
        assert ctrl.get_task(view_tids[0]).state is TaskState.WRITTEN  # type: ignore[union-attr]
        drv.check(sid, want)
        drv.run({"a": Req([0], 3, 1)})  # drains the step's write
        assert step_tid not in ctrl.tasks and all(ctrl.get_task(vid) is None for vid in view_tids)
    finally:
        mgr.shutdown()


def test_a_one_request_write_is_named_by_its_own_tid() -> None:
    mgr, drv = _manual()
    try:
        drv.run({"a": Req([0], 0, 2)})
        (tid,) = mgr.components.ledger.previous_step_writes
        write = mgr.components.controller.tasks[tid]
        assert request_write_ids(write) == [("a", tid)]
        assert RequestTasksView(mgr.components.ledger).tasks == {"a": {tid: None}}
    finally:
        mgr.shutdown()
