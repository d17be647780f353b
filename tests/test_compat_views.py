"""Compat's per-request seams over a step's one immediate write: reading seams
serve per-request views built on read (``request_write_ids``, ``get_task`` of a
view id, ``RequestTasksView``); and a manager built while compat's seams are
installed (``install_upstream_seams``) registers one write per request while a
per-request seam is wrapped. A production manager (built without them) registers
one write per step whatever is patched."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omni_prefix_cache import compat
from omni_prefix_cache.compat.controller_seams import RequestWriteView, request_write_ids
from omni_prefix_cache.compat.manager_seams import RequestTasksView
from omni_prefix_cache.compat.registration import PerRequestWhileWrapped, task_seam_wrapped
from omni_prefix_cache.compat.write_task_seams import UpstreamTaskSeams
from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.steps import registration
from omni_prefix_cache.writes.write_task import TaskState, WriteTask
from test_manager import BS, NUM_BLOCKS, BlockView, Driver, Req, make

STEP = {"a": Req([0], 0, 3), "b": Req([1], 0, 1), "c": Req([2], 0, 2)}


def _manual() -> tuple[OmniPrefixCacheManager, Driver]:
    """A threaded-mode manager whose committer runs only when stepped."""
    view = BlockView()
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS)
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer="manual")
    return mgr, Driver(mgr, view)


@pytest.fixture
def seams() -> Iterator[None]:
    """Compat's upstream seams installed for the test."""
    assert not compat.upstream_seams_installed()
    with compat.upstream_seams():
        yield
    assert not compat.upstream_seams_installed()


def _step_units(mgr: OmniPrefixCacheManager, drv: Driver) -> list[tuple[str, ...]]:
    """Run ``STEP``; the requests of each of its immediate writes, in tid order."""
    sid, want = drv.run(STEP)
    ctrl = mgr.components.controller
    tasks = sorted(ctrl.parts.registry.tasks.values(), key=lambda t: t.tid)
    assert all(type(t) is WriteTask and t.state is TaskState.WRITTEN for t in tasks)
    assert mgr.components.ledger.previous_step_writes == [t.tid for t in tasks]
    drv.check(sid, want)
    return [t.req_ids for t in tasks]


def test_install_is_idempotent_and_chosen_when_a_manager_is_built(seams: None) -> None:
    assert compat.upstream_seams_installed() and not compat.install_upstream_seams()
    with compat.upstream_seams():  # nested: leaves them installed
        pass
    assert compat.upstream_seams_installed()
    mgr, _ = make(True)
    try:
        compat.uninstall_upstream_seams()
        # Chosen at construction: uninstalling later changes nothing for this manager.
        assert isinstance(mgr.components.ledger.units, PerRequestWhileWrapped)
        plain, _ = make(True)
        assert plain.components.ledger.units is registration.one_step_write
        plain.shutdown()
    finally:
        compat.install_upstream_seams()
        mgr.shutdown()


def test_a_class_level_method_patch_is_seen_until_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not task_seam_wrapped()
    original = WriteTask.mark_host_ready
    monkeypatch.setattr(WriteTask, "mark_host_ready", lambda task: original(task))
    assert task_seam_wrapped()
    monkeypatch.undo()
    assert not task_seam_wrapped() and WriteTask.mark_host_ready is original
    # A method the class inherits (its undo is a delattr), on WriteTask or on the mixin.
    monkeypatch.setattr(WriteTask, "claim_copy", lambda task: True)
    assert task_seam_wrapped()
    monkeypatch.undo()
    monkeypatch.setattr(UpstreamTaskSeams, "mark_done", lambda task: None)
    assert task_seam_wrapped()
    monkeypatch.undo()
    assert not task_seam_wrapped() and "claim_copy" not in vars(WriteTask)
    # Neither a plain class attribute (a field default), a dunder, nor a method off the
    # copy and pool-write path (a runtime mutant's patch) is a per-request seam.
    monkeypatch.setattr(WriteTask, "page", 3)
    monkeypatch.setattr(WriteTask, "__doc__", "x")
    monkeypatch.setattr(WriteTask, "taken_over_intersects", lambda task, chunk: False)
    assert not task_seam_wrapped()
    monkeypatch.undo()


@pytest.mark.parametrize("patched", [False, True], ids=["step-write", "per-request"])
def test_with_compat_a_patched_method_gives_each_request_its_own_step_write(
    monkeypatch: pytest.MonkeyPatch, seams: None, patched: bool
) -> None:
    mgr, drv = make(True)  # built before the patch, as upstream's tests do
    if patched:
        original = WriteTask.mark_host_ready
        monkeypatch.setattr(WriteTask, "mark_host_ready", lambda task: original(task))
    try:
        assert _step_units(mgr, drv) == ([(rid,) for rid in STEP] if patched else [tuple(STEP)])
    finally:
        mgr.shutdown()


def test_a_production_manager_registers_one_write_per_step_while_a_method_is_patched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Compat's wrapped ``_scatter`` / ``_run_eager`` are the seed suite's to exercise (it
    # fails without compat's seams installed); a production manager never looks.
    assert not compat.upstream_seams_installed()
    mgr, drv = make(True)
    try:
        original = WriteTask.mark_host_ready
        monkeypatch.setattr(WriteTask, "mark_host_ready", lambda task: original(task))
        assert task_seam_wrapped()
        assert mgr.components.ledger.units is registration.one_step_write
        assert _step_units(mgr, drv) == [tuple(STEP)]
    finally:
        mgr.shutdown()


def test_reading_seams_serve_one_view_per_request_of_a_step_write() -> None:
    mgr, drv = _manual()
    try:
        sid, want = drv.run(STEP)
        ctrl, ledger = mgr.components.controller, mgr.components.ledger
        (step_tid,) = ledger.previous_step_writes
        write = ctrl.parts.registry.tasks[step_tid]
        ids = request_write_ids(write)
        assert [rid for rid, _ in ids] == list(STEP)
        view_tids = [vid for _, vid in ids]
        assert len(set(view_tids)) == 3 and all(vid < 0 and vid not in ctrl.parts.registry.tasks for vid in view_tids)
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
        while ctrl.parts.committer.step() is not None:
            pass
        assert ctrl.get_task(view_tids[0]).state is TaskState.WRITTEN  # type: ignore[union-attr]
        drv.check(sid, want)
        drv.run({"a": Req([0], 3, 1)})  # drains the step's write
        assert step_tid not in ctrl.parts.registry.tasks and all(ctrl.get_task(vid) is None for vid in view_tids)
    finally:
        mgr.shutdown()


def test_a_one_request_write_is_named_by_its_own_tid() -> None:
    mgr, drv = _manual()
    try:
        drv.run({"a": Req([0], 0, 2)})
        (tid,) = mgr.components.ledger.previous_step_writes
        write = mgr.components.controller.parts.registry.tasks[tid]
        assert request_write_ids(write) == [("a", tid)]
        assert RequestTasksView(mgr.components.ledger).tasks == {"a": {tid: None}}
    finally:
        mgr.shutdown()
