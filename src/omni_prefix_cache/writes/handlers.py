"""The controller's handlers of the composition's effects and guards
(spec/protocol.yaml ``effects`` / ``guards``, the controller's share):
what ``compile_ops`` binds each name to, per task and for whole batches.

The copy and pool-write effects call the current ``WriteStages``: the
controller's ``HostRows`` and ``PoolWriter``, unless ``use`` put a wrapping
stage in their place (a harness's fake)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_prefix_cache.interface import Tid, WriteSchedule
from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.host_rows import CopyStage
from omni_prefix_cache.writes.mode import WriteMode
from omni_prefix_cache.writes.operations import task_failed
from omni_prefix_cache.writes.pool_writer import PoolWriteStage
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_task import WriteTask

Join = Callable[[list[Tid]], None]
Effects = dict[str, Callable[[Any], None]]
Guards = dict[str, Callable[[Any], bool]]
BatchEffects = dict[str, Callable[[Batch], None]]
BatchGuards = dict[str, Callable[[list[Any]], list[bool]]]


class WriteStages:
    """What effects ``copy_to_host`` and ``pool_write`` call now."""

    copy: CopyStage
    pool_write: PoolWriteStage  # the controller's pool writer, once it exists

    def __init__(self, copy: CopyStage) -> None:
        self.copy = copy

    def use(self, *, copy: CopyStage | None = None, pool_write: PoolWriteStage | None = None) -> None:
        """Run effect ``copy_to_host`` through ``copy`` and effect
        ``pool_write`` through ``pool_write`` from now on (each given one
        replaces the current stage): usually a stage wrapping the current
        one, as a harness's fault-injecting or probing fake does. Call it
        between operations, never while a write is in flight."""
        if copy is not None:
            self.copy = copy
        if pool_write is not None:
            self.pool_write = pool_write


class WriteHandlers:
    """Effect and guard handlers over the controller's parts. The budget
    flush escalates and joins through ``escalate`` / ``join`` (the
    controller's operations, looked up at each flush);
    ``drain`` is the committer's ``drain_queues``; ``close_staging`` closes
    the staging pool. ``inline`` collects a dispatch's ``dispatch_inline``
    tasks; ``registering_queued`` is the ``queued`` flag of the registration
    running now. Effects run under the locks their segments declare."""

    def __init__(
        self,
        *,
        registry: TaskRegistry,
        budget: GpuBudget,
        mode: WriteMode,
        wake: Any,
        copy_stage: CopyStage,
        escalate: Join,
        join: Join,
        drain: Callable[[], None],
        close_staging: Callable[[], None],
    ) -> None:
        self._registry = registry
        self._budget = budget
        self._mode = mode
        self._wake = wake
        self._escalate = escalate
        self._join = join
        self._drain = drain
        self._close_staging = close_staging
        self.stages = WriteStages(copy_stage)
        self.inline: list[WriteTask] = []
        self.registering_queued = False

    def tables(self) -> tuple[Effects, Guards, BatchEffects, BatchGuards]:
        """Effects, guards, batch effects and batch guards (``compile_ops``' order)."""
        return self.effects(), self.guards(), self.batch_effects(), self.batch_guards()

    def _flush_oldest(self, nbytes: int) -> None:
        self._budget.flush(nbytes, self._registry.unfinished, self._escalate, self._join)

    def _wake_committer(self) -> Callable[[Any], None]:
        """Effect ``wake_committer``: notify the committer's condition, where
        a committer thread waits on it; with none (eager, manual, on_demand)
        nothing waits, so it is nothing."""
        mode, wake = self._mode, self._wake
        if mode.eager or mode.committer != "thread":
            return _nothing
        return lambda _: wake.notify_all()

    def effects(self) -> Effects:
        budget, registry, stages = self._budget, self._registry, self.stages
        return {
            "register_task": lambda task: registry.register((task,), self.registering_queued),
            "charge_budget": budget.charge,
            "flush_oldest": self._flush_oldest,
            "refund_unpinned": budget.refund_unpinned,
            "unpin_budget": budget.unpin,
            "wake_committer": self._wake_committer(),
            "dispatch_inline": self.inline.append,
            "copy_to_host": lambda task: stages.copy.copy_task(task),
            "pool_write": lambda task: stages.pool_write.write(task),
            "publish_completed": registry.publish_completed,
            "publish_failed": registry.publish_failed,
            "wake_failed": lambda task: task.wake_failed_waiters(),
            "close_staging": lambda _: self._close_staging(),
            "drain_queues": lambda _: self._drain(),
        }

    def batch_effects(self) -> BatchEffects:
        """Effects that run once for a whole batch (see specs.batch)."""
        budget, registry, stages = self._budget, self._registry, self.stages
        return {
            "copy_to_host": lambda batch: stages.copy.copy_batch(batch),
            "pool_write": lambda batch: stages.pool_write.write_batch(batch),
            "register_task": lambda batch: registry.register(batch.items, self.registering_queued),
            "unpin_budget": lambda batch: budget.unpin_many(batch.items),
            "wake_committer": self._wake_committer(),
            "publish_completed": registry.publish_completed_batch,
            "dispatch_inline": lambda batch: self.inline.extend(batch.items),
        }

    def guards(self) -> Guards:
        budget, mode, registry = self._budget, self._mode, self._registry
        return {
            "immediate": lambda task: task.schedule is WriteSchedule.JOIN_NEXT_STEP,
            "queued_at_submit": lambda task: bool(task.queued_at_submit),
            # The manager appends to an open write itself; the controller
            # registers only writes it does not know yet.
            "open_write_accepts": lambda task: task.tid in registry.tasks,
            "over_budget": lambda nbytes: budget.exceeded_by(nbytes) and registry.any_unfinished(),
            "task_failed": task_failed,
            "eager": lambda _: mode.eager,
        }

    def batch_guards(self) -> BatchGuards:
        """Guards answered for a whole batch at once (see specs.batch): the
        same answer per task as ``guards``, without a call per task."""
        immediate, mode = WriteSchedule.JOIN_NEXT_STEP, self._mode
        return {
            "immediate": lambda tasks: [task.schedule is immediate for task in tasks],
            "eager": lambda tasks: [mode.eager] * len(tasks),
        }


def _nothing(ctx: Any) -> None:
    return None
