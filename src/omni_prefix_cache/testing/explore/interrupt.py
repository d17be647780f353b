"""Explorer scenario ``copy-interrupt``: a BaseException (here a
KeyboardInterrupt) raised inside the committer's copy stage, mid-batch.

The committer thread's loop survives any exception, so a copy pass that
such an exception stops must fail every task of it whose copy stage did not
finish; a task left claimed is on no queue, no committer would copy it, and
each join on it would wait out ``staging_claim_timeout_s``. The scenario
races the committer's interrupted pass against the engine thread's joins,
then checks the named invariants of ``scenarios.Watch`` (at every sync point
and after quiescing) and three of its own:

- ``joins_terminate``: every join on the pass's tasks returns or raises the
  write-failed error, never the join timeout;
- ``failure_names_its_tasks``: the sticky failure names every failed task;
- ``interrupted_pass_released``: before shutdown, no task of the pass is
  unfinished, no budget byte is staged and none of them holds a staging
  page (step 1's immediate writes may still be in flight: not checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from omni_prefix_cache.device.copy_engine import CpuCopyEngine
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    Tid,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.explore.scenarios import BS, NUM_BLOCKS, Engine, Req, Scenario, View, Watch
from omni_prefix_cache.testing.explore.scheduler import Scheduler

_NOTHING = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(), num_scheduled_tokens={})


def _broken(name: str, detail: str) -> AssertionError:
    return AssertionError(f"invariant {name}: {detail}")


class InterruptingEngine(CpuCopyEngine):
    """Host copies; once ``arm(n)``-ed, the ``n``-th ``copy_into`` after it
    raises KeyboardInterrupt, once, on whichever thread runs the copy."""

    def __init__(self) -> None:
        self.countdown = 0
        self.raised = False

    def arm(self, nth: int) -> None:
        self.countdown = nth

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.countdown > 0:
            self.countdown -= 1
            if self.countdown == 0:
                self.raised = True
                raise KeyboardInterrupt("injected into the copy stage")
        super().copy_into(dst, src)


def _join_each(mgr: OmniPrefixCacheManager, tids: Sequence[Tid]) -> None:
    """Join each task: it is written (returns) or failed (the write-failed
    error); the join timeout means the pass stranded it."""
    ctrl = mgr.components.controller
    for tid in tids:
        try:
            ctrl.join([tid])
        except OmniPrefixCacheWriteFailedError:
            continue
        except OmniPrefixCacheUnmatchError as exc:
            raise _broken("joins_terminate", f"join of task {tid} after the interrupted copy pass: {exc}") from exc


def _check_released(mgr: OmniPrefixCacheManager, tids: Sequence[Tid]) -> None:
    ctrl = mgr.components.controller
    unfinished = {
        tid: task.state.name for tid in tids if (task := ctrl.parts.registry.tasks.get(tid)) and not task.is_terminal
    }
    if unfinished:
        raise _broken("interrupted_pass_released", f"tasks of the interrupted pass unfinished: {unfinished}")
    if ctrl.parts.budget.staged_bytes != 0:
        raise _broken("interrupted_pass_released", f"{ctrl.parts.budget.staged_bytes} budget bytes still staged")
    held = sorted(h.owner_id for h in ctrl.parts.staging_pool.holders() if h.kind == "task" and h.owner_id in tids)
    if held:
        raise _broken("interrupted_pass_released", f"tasks {held} still hold staging pages")


def _check_sticky_names(mgr: OmniPrefixCacheManager, failed: set[Tid]) -> None:
    try:
        mgr.new_step_starts(_NOTHING)
    except OmniPrefixCacheWriteFailedError as exc:
        missing = sorted(tid for tid in failed if f"task {tid} (" not in str(exc))
        if missing:
            raise _broken("failure_names_its_tasks", f"the sticky failure {exc} does not name tasks {missing}") from exc
        return
    raise _broken("failure_is_sticky", f"tasks {sorted(failed)} failed, yet new_step_starts returned")


def copy_interrupted_mid_batch(sched: Scheduler) -> None:
    """a and b finish together: their deferred writes are escalated in one
    critical section, one committer pass claims both, and the second copy of
    the pass raises KeyboardInterrupt while the engine thread joins them."""
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    copies = InterruptingEngine()
    view = View()
    mgr = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_depth=2),
        view,
        eager=False,
        committer="thread",
        engine=copies,
    )
    mgr.register_policy(policy)
    engine = Engine(mgr, view, (HIDDEN_KEY, "m", "d"))
    watch = Watch(sched, mgr)
    ctrl = mgr.components.controller
    engine.check(*engine.run({"a": Req([0, 1], 0, 3), "b": Req([2], 0, 2)}))
    deferred = sorted(tid for tid, task in ctrl.parts.registry.tasks.items() if task.schedule.value == "join_on_finish")
    if len(deferred) != 2:
        raise AssertionError(f"explore scenario: expected two deferred writes, got {deferred}")
    copies.arm(2)  # one copy per deferred write: the pass's second task raises
    # A list: the manager escalates (so queues, claims and fails) in this order, and a
    # set of str would iterate in PYTHONHASHSEED's order, a different schedule space per run.
    mgr.new_step_starts(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=["a", "b"], num_scheduled_tokens={}))
    engine.live.clear()
    _join_each(mgr, deferred)
    if not copies.raised:
        raise AssertionError("explore scenario: the interrupt never fired")
    failed = {tid for tid in deferred if ctrl.parts.registry.tasks[tid].state.name == "FAILED"}
    if not failed:
        raise _broken("interrupted_pass_released", f"the pass was interrupted, yet tasks {deferred} were written")
    _check_released(mgr, deferred)
    _check_sticky_names(mgr, failed)
    mgr.shutdown()
    watch.check_quiesced(dead=True)


INTERRUPT_SCENARIOS: dict[str, Scenario] = {
    "copy-interrupt": Scenario("copy-interrupt", copy_interrupted_mid_batch, copy_interrupted_mid_batch.__doc__ or ""),
}
