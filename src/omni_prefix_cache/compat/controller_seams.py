"""The controller's private names that upstream tests read or wrap (the
seed suite): aliases of the components that now own them. A wrapped seam
(``_scatter``, ``_run_eager``) is served by installing a wrapping
collaborator; the runtime itself never looks these names up."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import Tid
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.eager import EagerDispatch, RunEager
from omni_prefix_cache.writes.handlers import WriteHandlers
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.mode import WriteMode
from omni_prefix_cache.writes.operations import ControllerOps
from omni_prefix_cache.writes.pool_writer import PoolWriter
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_task import WriteTask

# Upstream's spellings of the public chunk types (the seed suite imports them).
_BudgetTicket = BudgetTicket
_WriteChunk = WriteChunk

Scatter = Callable[[WriteTask], Any]


class _ScatterStage:
    """The pool-write stage while upstream's ``_scatter`` is replaced: every
    task's pool write goes through ``scatter`` (which usually calls the
    real ``PoolWriter.write``), batches task by task."""

    def __init__(self, scatter: Scatter) -> None:
        self.scatter = scatter

    def write(self, task: WriteTask) -> None:
        self.scatter(task)

    def write_batch(self, batch: Batch) -> None:
        guarded_each(batch, self.scatter)


class UpstreamSeams:
    """Mixin of OmniPrefixCacheController: ``_queue_hi`` and friends."""

    queues: CopyQueues
    mode: WriteMode
    ops: ControllerOps
    _host: HostRows
    _budget: GpuBudget
    _registry: TaskRegistry
    _writer: PoolWriter
    _handlers: WriteHandlers
    _eager_dispatch: EagerDispatch
    fail_task: Callable[[WriteTask, BaseException | None], bool]
    fail_tasks: Callable[[list[WriteTask], BaseException | None], None]
    committer_write: Callable[[], list[Tid]]

    @property
    def _queue_hi(self) -> deque[Tid]:
        return self.queues.high

    @property
    def _queue_lo(self) -> deque[Tid]:
        return self.queues.low

    @property
    def _claimed(self) -> deque[Tid]:
        return self.queues.claimed

    @property
    def _blocked(self) -> list[Tid]:
        return self.queues.blocked

    @property
    def _tasks(self) -> dict[Tid, WriteTask]:
        return self._registry.tasks

    @property
    def _completed(self) -> deque[Tid]:
        return self._registry.completed

    @property
    def _failed(self) -> deque[Tid]:
        return self._registry.failed

    @property
    def _eager(self) -> bool:
        return self.mode.eager

    @_eager.setter
    def _eager(self, value: bool) -> None:
        self.mode.eager = value

    @property
    def _engine(self) -> CopyEngine:
        return self._host.engine

    @_engine.setter
    def _engine(self, engine: CopyEngine) -> None:
        self._host.engine = engine

    @property
    def _staged_bytes(self) -> int:
        return self._budget.staged_bytes

    def _release_staged_bytes(self, task: WriteTask) -> None:
        """Effect ``unpin_budget`` for ``task``."""
        self._budget.unpin(task)

    def _fail_task(self, tid: Tid | None) -> None:
        """Operation ``fail`` by tid, with no cause."""
        task = self._registry.get(tid) if tid is not None else None
        if task is not None:
            self.fail_task(task, None)

    def _scatter_host_ready(self) -> list[Tid]:
        """Operation ``committer_write`` (``Committer.write``)."""
        return self.committer_write()

    @property
    def _scatter(self) -> Scatter:
        """Effect ``pool_write`` for one task (``PoolWriter.write``, or what
        replaced it)."""
        stage = self._handlers.stages.pool_write
        return stage.scatter if isinstance(stage, _ScatterStage) else stage.write

    @_scatter.setter
    def _scatter(self, scatter: Scatter) -> None:
        # Setting back the writer's own write (a monkeypatch undone)
        # restores the real stage.
        real = self._writer
        self._handlers.stages.use(pool_write=real if scatter == real.write else _ScatterStage(scatter))

    @property
    def _run_eager(self) -> RunEager:
        """Operation ``eager_run`` for a task or a dispatch's tasks (``EagerRun``)."""
        return self._eager_dispatch.run

    @_run_eager.setter
    def _run_eager(self, run: RunEager) -> None:
        # A dispatch that runs its tasks through ``run`` instead.
        self._eager_dispatch = EagerDispatch(run, self._writer, self.ops.eager, self.fail_tasks)
