"""The controller's private names that upstream tests read or wrap (the
seed suite): aliases of the components that now own them. A wrapped seam
(``_scatter``, ``_run_eager``) is served by installing a wrapping
collaborator; the runtime itself never looks these names up.

Upstream's tests think of one write task per request. The runtime keeps a
step's immediate rows as one write (its requests as state arrays), so:

- reading seams serve per-request views, built on read: ``request_write_ids``
  names each request's share of a step's write by a view id (the task's own
  tid when it holds one request), and ``get_task`` of a view id returns a
  ``RequestWriteView`` (``request_view``);
- while a per-request seam is wrapped (``_scatter``, ``_run_eager``, or a
  WriteTask method), each request's immediate rows are their own write, so
  the wrapper sees one request per task: compat's registration strategy
  (``compat.registration``), which managers built while compat's seams are
  installed use (``omni_prefix_cache.compat.install_upstream_seams``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch

from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, TensorName, Tid
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from omni_prefix_cache.writes.committer import Committer
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.eager import EagerDispatch, EagerRun, RunEager
from omni_prefix_cache.writes.handlers import WriteHandlers
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.mode import WriteMode
from omni_prefix_cache.writes.operations import ControllerOps
from omni_prefix_cache.writes.pool_writer import PoolWriter
from omni_prefix_cache.writes.staging import HolderTrigger, StagingBufferHolder, StagingBufferPool, StepD2HClaim
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_task import TaskState, WriteTask

# Upstream's spellings of the public chunk types: upstream's tests import them
# from ``omni_prefix_cache.controller``, which serves them through
# ``controller_module_attr`` (its module ``__getattr__``).
_BudgetTicket = BudgetTicket
_WriteChunk = WriteChunk
_CONTROLLER_MODULE_NAMES: dict[str, Any] = {"_BudgetTicket": BudgetTicket, "_WriteChunk": WriteChunk}


def controller_module_attr(name: str) -> Any:
    """The controller module's ``__getattr__`` (PEP 562): upstream's private
    names of that module, looked up only when a normal lookup fails (an
    import in a test), so the runtime never pays for them."""
    try:
        return _CONTROLLER_MODULE_NAMES[name]
    except KeyError:
        raise AttributeError(f"module 'omni_prefix_cache.controller' has no attribute {name!r}") from None


Scatter = Callable[[WriteTask], Any]
# ``HostRows.fetch``: (task, slots, key, pinned=None) -> rows.
FetchHost = Callable[..., torch.Tensor]

# View ids: -((step tid + 1) * _VIEW_STRIDE + request index), so every view id
# is <= -_VIEW_STRIDE (never a tid, never an owner array's -1) and a step's
# write may have up to _VIEW_STRIDE requests.
_VIEW_STRIDE = 1 << 20


def request_write_ids(task: WriteTask) -> list[tuple[ReqId, Tid]]:
    """``(request, id)`` for each request whose rows ``task`` holds, in step
    order: the task's own tid when it holds one request (a deferred write,
    a per-request immediate write), else a view id per request."""
    requests = task.requests
    if requests is None or len(requests.req_ids) == 1:
        return [(task.req_id, task.tid)]
    if len(requests.req_ids) > _VIEW_STRIDE:
        raise OmniPrefixCacheUnmatchError(
            f"task {task.tid}: {len(requests.req_ids)} requests have no per-request view ids (at most {_VIEW_STRIDE})"
        )
    base = -(task.tid + 1) * _VIEW_STRIDE
    return [(rid, base - i) for i, rid in enumerate(requests.req_ids)]


class RequestWriteView:
    """One request's share of a step's write, as upstream's tests read a
    per-request task: ``tid`` (its view id), ``req_id``, ``rows`` (its
    ``[start, end)`` in the write's chunk) and ``slots``; every other name
    (``state``, ``done``, ``schedule``...) reads the step's write itself,
    live. Read-only: moving it means moving the step's write (``task``)."""

    def __init__(self, task: WriteTask, index: int, tid: Tid) -> None:
        assert task.requests is not None
        self.task = task
        self.tid = tid
        self.req_id = task.requests.req_ids[index]
        self.rows = (task.requests.offsets[index], task.requests.offsets[index + 1])

    @property
    def slots(self) -> Any:
        start, end = self.rows
        return self.task.chunks[0].slots_cpu[start:end]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def __repr__(self) -> str:
        return f"RequestWriteView(tid={self.tid}, req={self.req_id!r}, rows {list(self.rows)} of {self.task!r})"


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


class ControllerSeams:
    """Mixin of OmniPrefixCacheController: ``_queue_hi`` and friends, and
    upstream's public names of what the controller's parts own now
    (``get_task``, ``fetch_host``, ``pin_budget``...: upstream's tests and
    manager call them on the controller; the runtime calls the parts)."""

    queues: CopyQueues
    mode: WriteMode
    ops: ControllerOps
    _host: HostRows
    _budget: GpuBudget
    _registry: TaskRegistry
    _staging_pool: StagingBufferPool
    _committer: Committer
    _writer: PoolWriter
    _handlers: WriteHandlers
    _eager_dispatch: EagerDispatch
    fail_task: Callable[[WriteTask, BaseException | None], bool]
    fail_tasks: Callable[[list[WriteTask], BaseException | None], None]

    # ------------------------------------------------------------ upstream's public names

    def stage_step_host(
        self, tensors: dict[TensorName, torch.Tensor], n: int, freeze_event: Any, step_holder: StagingBufferHolder
    ) -> StepD2HClaim:
        """``StagingBufferPool.stage_step``: claim a page for ``step_holder``
        and copy the step's rows into it (engine thread, no state lock)."""
        return self._staging_pool.stage_step(tensors, n, freeze_event, step_holder)

    def staging_release(
        self, slot: int, holder: StagingBufferHolder, trigger: HolderTrigger = StagingHolderTrigger.CONSUME
    ) -> None:
        """``StagingBufferPool.release`` of a step holder (the spec refuses
        to release a task holder by ``consume`` or ``abandon``: raises)."""
        self._staging_pool.release(slot, holder, trigger)

    def append_chunk(self, task: WriteTask, chunk: WriteChunk, freeze_event: Any = None) -> TaskState | None:
        """``WriteTask.append_chunk``: None when appended, else the closing state."""
        return task.append_chunk(chunk, freeze_event)

    def pin_budget(self, ticket: BudgetTicket, tid: Tid) -> None:
        """``GpuBudget.pin``: ``tid`` views the clone ``ticket`` charges."""
        self._budget.pin(ticket, tid)

    @property
    def fetch_host(self) -> FetchHost:
        """``HostRows.fetch``: rows of ``slots`` from a task not yet in the
        pool (or what replaced it)."""
        return self._host.fetch

    @fetch_host.setter
    def fetch_host(self, fetch: FetchHost) -> None:
        # Upstream's tests wrap it on the controller; the hit reads hold the
        # host rows, so the wrapper shadows ``fetch`` on that one object.
        self._host.fetch = fetch  # type: ignore[method-assign]

    def drain_completed(self) -> list[Tid]:
        """``TaskRegistry.take_completed``: pop the pool-written tids, forget their tasks."""
        return self._registry.take_completed()

    def drain_failed(self) -> list[Tid]:
        """``TaskRegistry.take_failed``: pop the failed tids."""
        return self._registry.take_failed()

    # ------------------------------------------------------------ private names

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

    @property
    def _staged_bytes(self) -> int:
        return self._budget.staged_bytes

    def _release_staged_bytes(self, task: WriteTask) -> None:
        """Effect ``unpin_budget`` for ``task``."""
        self._budget.unpin(task)

    def get_task(self, tid: Tid) -> WriteTask | None:
        """Upstream's lookup: the registered task ``tid`` (None once
        drained); only when the registry misses, a view id (negative) names
        the ``RequestWriteView`` of one request's share of a step's write.
        The runtime looks tasks up in its ``TaskRegistry``. Any thread."""
        task = self._registry.tasks.get(tid)
        if task is None and tid is not None and tid < 0:
            return self.request_view(tid)
        return task

    def request_view(self, tid: Tid) -> WriteTask | None:
        """``get_task``'s miss path: the ``RequestWriteView`` a view id names
        (None when it names none: its step's write is drained, or it is no
        view id). Typed as a WriteTask for ``get_task``'s callers; it
        answers the names a per-request task has, read-only."""
        if tid > -_VIEW_STRIDE:
            return None
        step_tid, index = divmod(-tid, _VIEW_STRIDE)
        task = self._registry.tasks.get(step_tid - 1)
        held = 0 if task is None or task.requests is None else len(task.requests.req_ids)
        if task is None or held < 2 or index >= held:  # one request: its view id is the tid
            return None
        return cast(WriteTask, RequestWriteView(task, index, tid))

    def _fail_task(self, tid: Tid | None) -> None:
        """Operation ``fail`` by tid, with no cause (a view id fails the
        step's write that holds the request)."""
        task = self.get_task(tid) if tid is not None else None
        if isinstance(task, RequestWriteView):
            task = task.task
        if task is not None:
            self.fail_task(task, None)

    def _scatter_host_ready(self) -> list[Tid]:
        """Operation ``committer_write`` (``Committer.write``)."""
        return self._committer.write()

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
        # A dispatch that runs its tasks through ``run`` instead (an EagerRun
        # is the real one, set back).
        self._eager_dispatch = EagerDispatch(run, self._writer, self.ops.eager, self.fail_tasks)

    def per_request_seam_wrapped(self) -> bool:
        """True while ``_scatter`` or ``_run_eager`` runs through a wrapper
        an upstream test set (compat's registration strategy asks, per save)."""
        return isinstance(self._handlers.stages.pool_write, _ScatterStage) or not isinstance(
            self._eager_dispatch.run, EagerRun
        )
