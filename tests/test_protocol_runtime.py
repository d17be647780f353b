"""The controller runs the composition (spec/protocol.yaml) it compiled:
listed moves that are not enabled raise, unlisted ones cannot be fired, and
a mutated composition changes what the controller does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import (
    OmniPrefixCacheController,
    StagingBufferHolder,
    TaskState,
    WriteChunk,
    WriteTask,
)
from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError, PrefixCacheConfig, WriteSchedule
from omni_prefix_cache.specs.composition import ProtocolViolation, load_protocol
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.specs.types.copy_queue import QueuePosition
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.operations import use_protocol


def _controller(**kw: Any) -> OmniPrefixCacheController:
    cfg = PrefixCacheConfig(num_blocks=8, block_size=4, staging_depth=2, staging_capacity_tokens=32)
    pool = PrefixBlockPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, 2)
    return OmniPrefixCacheController(pool, cfg, **kw)


def _deferred(tid: int) -> WriteTask:
    chunk = WriteChunk(slots_cpu=torch.tensor([tid]), tensors={HIDDEN_KEY: torch.full((1, 2), float(tid))})
    return WriteTask(tid=tid, req_id=f"r{tid}", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[chunk])


def test_positions_follow_the_committer_stages() -> None:
    ctrl = _controller(eager=False, committer="manual")
    task = _deferred(1)
    ctrl.submit(task, queued=True)
    assert task.position is QueuePosition.LOW and list(ctrl.queues.low) == [1]
    ctrl.escalate([1])
    assert task.position is QueuePosition.HIGH and list(ctrl.queues.high) == [1]
    assert ctrl.parts.committer.claim() == 1 and task.position is QueuePosition.CLAIMED
    assert ctrl.parts.committer.copy() == 1 and task.position is QueuePosition.BLOCKED
    assert ctrl.parts.committer.write() == [1]
    assert task.position is QueuePosition.DONE and task.state is TaskState.WRITTEN
    ctrl.shutdown()


def test_a_failed_queued_task_leaves_a_stale_entry_the_claim_drops() -> None:
    ctrl = _controller(eager=False, committer="manual")
    task = _deferred(1)
    ctrl.submit(task, queued=True)
    ctrl.fail_task(task, None)
    assert task.position is QueuePosition.STALE and list(ctrl.queues.low) == [1]
    assert ctrl.parts.committer.claim() is None
    assert task.position is QueuePosition.DONE and not ctrl.queues.has_work()
    ctrl.shutdown()


def test_a_listed_move_that_is_not_enabled_raises_a_protocol_violation() -> None:
    ctrl = _controller(eager=False, committer="manual")
    task = _deferred(1)
    ctrl.submit(task, queued=True)
    # save's dispatch pushes a deferred write queued at submit: a second
    # dispatch finds its position already LOW.
    with pytest.raises(ProtocolViolation, match=r"save \(dispatch\): position.push_low is not enabled .*LOW"):
        ctrl.dispatch([task])
    ctrl.shutdown()


def test_an_immediate_write_on_a_free_page_cannot_register() -> None:
    ctrl = _controller(eager=True)
    chunk = WriteChunk(slots_cpu=torch.tensor([0]), tensors={}, host={HIDDEN_KEY: torch.zeros(1, 2)})
    task = WriteTask(tid=1, req_id="r", write_n=1, schedule=WriteSchedule.JOIN_NEXT_STEP, chunks=[chunk], page=0)
    with pytest.raises(ProtocolViolation, match=r"save \(register\): task_holder.bind is not enabled"):
        ctrl.register(task)


def test_the_controller_binds_only_its_own_roles() -> None:
    ctrl = _controller(eager=True)
    with pytest.raises(SpecError, match="the controller fires no slot.take_tenancy"):
        ctrl.binding.move("slot", "take_tenancy")
    with pytest.raises(ProtocolViolation, match="has no move 'claim'"):
        CopyQueues().fire(_deferred(1), "claim")  # UNQUEUED cannot be claimed


@pytest.mark.parametrize("trigger", [StagingHolderTrigger.CONSUME, StagingHolderTrigger.ABANDON])
def test_task_holders_are_released_only_by_their_write_or_failure(trigger: StagingHolderTrigger) -> None:
    pool = _controller(eager=True).parts.staging_pool
    step, task = StagingBufferHolder.for_step(1), StagingBufferHolder.for_task(1)
    page = pool.claim(step, 0)
    pool.bind(page, task)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"{trigger} does not release a task holder"):
        pool.release(page, task, trigger)
    assert pool.holds(task)
    pool.release(page, step, trigger)  # a step holder it releases
    assert not pool.holds(step) and pool.holds(task)


def test_a_mutated_composition_changes_what_the_controller_does() -> None:
    def no_low_queue(data: dict[str, Any]) -> None:
        save = next(op for op in data["operations"] if op["name"] == "save")
        dispatch = next(seg for seg in save["segments"] if seg["name"] == "dispatch")
        text = repr(dispatch["steps"]).replace("position.push_low", "position.push")
        dispatch["steps"] = eval(text)  # noqa: S307 - a literal of our own

    with use_protocol(load_protocol().mutated(no_low_queue, check_coverage=False)):
        ctrl = _controller(eager=False, committer="manual")
    task = _deferred(1)
    ctrl.submit(task, queued=True)
    assert task.position is QueuePosition.HIGH and list(ctrl.queues.high) == [1]
    ctrl.shutdown()
    assert _controller(eager=False, committer="manual").ops is not ctrl.ops


def test_projection_keeps_the_controller_steps_in_order() -> None:
    save = load_protocol().ops["save"]
    labels = save.only("register").projected(frozenset({"task", "task_holder"}), frozenset({"register_task"}))
    assert labels.order_labels() == ["register_task", "task.enqueue", "task_holder.bind", "task.enqueue"]
