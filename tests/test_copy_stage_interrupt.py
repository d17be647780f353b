"""A BaseException in the committer's copy stage (issue 28, item 1).

A KeyboardInterrupt or SystemExit raised inside the engine's copy seam stops
the committer's copy pass where it was. Every task of that pass whose copy
stage did not finish must fail with it: no join waits out
``staging_claim_timeout_s``, the failure is sticky and names the tasks, and
the budget bytes and staging holds of the pass are released.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch

from omni_prefix_cache.device.copy_engine import CpuCopyEngine
from omni_prefix_cache.interface import ModelCachePolicy, OmniPrefixCacheWriteFailedError, PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from test_manager import BS, NUM_BLOCKS, BlockView, Driver, Req

# Long enough that a join which waited it out is told apart from one the
# failure woke (the failure publishes in milliseconds).
TIMEOUT_S = 20.0
DEFERRED = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))


class InterruptingEngine(CpuCopyEngine):
    """Host copies; once ``arm``-ed, the next ``copy_into`` raises ``error``
    (on whichever thread runs the copy stage) and the engine disarms."""

    def __init__(self) -> None:
        self.error: Callable[[], BaseException] | None = None
        self.raised = 0

    def arm(self, error: Callable[[], BaseException]) -> None:
        self.error = error

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        error, self.error = self.error, None
        if error is not None:
            self.raised += 1
            raise error()
        super().copy_into(dst, src)


def _make(
    committer: Literal["thread", "on_demand"], managers: list[Any]
) -> tuple[OmniPrefixCacheManager, Driver, InterruptingEngine]:
    engine = InterruptingEngine()
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_claim_timeout_s=TIMEOUT_S)
    view = BlockView()
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer=committer, engine=engine)
    managers.append(mgr)
    mgr.register_policy(DEFERRED)
    return mgr, Driver(mgr, view, keys=("__hidden_states__", "m", "d")), engine


def drv_sched(*, finished: set[str]) -> Any:
    """A scheduler output that only finishes ``finished``."""
    return SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(finished), num_scheduled_tokens={})


def _deferred_tids(mgr: OmniPrefixCacheManager) -> list[int]:
    return sorted(
        tid
        for tid, task in mgr.components.controller.parts.registry.tasks.items()
        if task.schedule.value == "join_on_finish"
    )


def _join_each_fails(mgr: OmniPrefixCacheManager, tids: list[int]) -> None:
    """Each join raises the write-failed error well before the join timeout
    (one join per task: a join raises at the first failed one)."""
    deadline = time.monotonic() + TIMEOUT_S
    for tid in tids:
        with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
            mgr.components.controller.join([tid])
        # A join the failure did not wake would have raised the join
        # timeout (another type) at the deadline; this one came before it.
        assert "did not reach" not in str(info.value)
    assert time.monotonic() < deadline


def _assert_released(mgr: OmniPrefixCacheManager, tids: list[int]) -> None:
    ctrl = mgr.components.controller
    states = {tid: ctrl.parts.registry.tasks[tid].state.name for tid in tids}
    assert set(states.values()) == {"FAILED"}, states
    assert ctrl.stats()["tasks_by_state"]["COPYING"] == 0
    assert ctrl.parts.budget.staged_bytes == 0
    assert [h for h in ctrl.parts.staging_pool.holders() if h.kind == "task" and h.owner_id in tids] == []


def _assert_sticky_naming(mgr: OmniPrefixCacheManager, drv: Driver, tids: list[int]) -> None:
    for _ in range(2):
        with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
            drv.run({"c": Req([9], 0, 2)})
        for tid in tids:
            assert f"task {tid} " in str(info.value), (tid, str(info.value))
    assert mgr.stats()["sticky_failure"] is True


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_threaded_copy_pass_interrupted_fails_its_tasks_without_waiting_out_the_timeout(
    error: Callable[[], BaseException], managers: list[Any]
) -> None:
    mgr, drv, engine = _make("thread", managers)
    ctrl = mgr.components.controller
    drv.check(*drv.run({"a": Req([0, 1], 0, 4), "b": Req([2, 3], 0, 4)}))
    tids = _deferred_tids(mgr)
    assert len(tids) == 2 and ctrl.parts.budget.staged_bytes > 0
    engine.arm(error)
    # Both finish: their deferred writes are escalated together, so one
    # committer pass claims both and the first copy raises.
    mgr.new_step_starts(drv_sched(finished={"a", "b"}))
    _join_each_fails(mgr, tids)
    assert engine.raised == 1
    _assert_released(mgr, tids)
    _assert_sticky_naming(mgr, drv, tids)


def test_on_demand_copy_pass_interrupted_reraises_to_the_joiner_after_failing_its_tasks(managers: list[Any]) -> None:
    mgr, drv, engine = _make("on_demand", managers)
    ctrl = mgr.components.controller
    drv.check(*drv.run({"a": Req([0, 1], 0, 4), "b": Req([2, 3], 0, 4)}))
    tids = _deferred_tids(mgr)
    engine.arm(KeyboardInterrupt)
    mgr.new_step_starts(drv_sched(finished={"a", "b"}))
    # The joining thread runs the copy stage itself: the interrupt is its
    # own and reaches it, but only after the pass failed its tasks.
    with pytest.raises(KeyboardInterrupt):
        ctrl.join(tids)
    _assert_released(mgr, tids)
    _join_each_fails(mgr, tids)
    _assert_sticky_naming(mgr, drv, tids)
