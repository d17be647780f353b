"""The write path: WriteTasks, the staging pool, the GPU-byte budget, the
copy queues and the single committer that writes the CPU block pool.

The manager owns request and slot identity and decides when to submit; this
class runs the writes. Two schedules (``WriteSchedule``):

    JOIN_NEXT_STEP   save already copied the whole step into a staging page
                     and set ``chunk.host`` to views of it. The committer
                     waits that copy's event, then writes the pool.
    JOIN_ON_FINISH   rows stay in a device clone; the committer copies them
                     to owned host tensors, then writes the pool.

The committer runs threaded, manual, on_demand or eager (see ``committer``).

Every operation is the composition's (spec/protocol.yaml), compiled once per
controller (``protocol_runtime``): a task, its queue position and its
staging hold move only through those compiled segments, each run under the
lock it declares. Modules: ``copy_queues`` (positions), ``committer``
(claim, copy, write), ``eager`` (inline dispatch), ``budget`` (GPU bytes),
``host_rows`` (copy stage and reads).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.compat.controller_seams import UpstreamSeams
from omni_prefix_cache.device import sync
from omni_prefix_cache.device.copy_engine import CopyEngine, DeviceEvents, default_engine
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    TensorName,
    Tid,
    WriteSchedule,
)
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.committer import Committer
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.eager import EagerDispatch, _joined, _PoolWriteBatch
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.operations import (
    ControllerBinding,
    OpRunner,
    RuntimeOp,
    active_protocol,
    compile_ops,
    task_failed,
)
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool, StepD2HClaim
from omni_prefix_cache.writes.write_errors import FailureRecord, FailureRecords, write_error
from omni_prefix_cache.writes.write_task import (
    TaskEvent,
    TaskState,
    WriteTask,
    _BudgetTicket,
    _WriteChunk,
)

logger = logging.getLogger(__name__)

__all__ = [
    "OmniPrefixCacheController",
    "StagingBufferHolder",
    "StagingBufferPool",
    "StepD2HClaim",
    "TaskEvent",
    "TaskState",
    "WriteSchedule",
    "WriteTask",
    "_BudgetTicket",
    "_PoolWriteBatch",
    "_WriteChunk",
    "_joined",
]

_NO_LOCK = contextlib.nullcontext()


class OmniPrefixCacheController(UpstreamSeams):
    """Staging pool + queues + committer for one manager.

    Locking: ``lock`` (reentrant, shared with the ``wake`` condition) covers
    the task registry, the copy queues, the completion and failure records
    and the budget counter. Never held across a copy, a pool write, a join
    or a budget flush. Each task's own lock covers its state.

    Failures: the controller keeps one failure record per failure cause
    (``failures``: the cause's first write-failed error and the tids it
    failed), not one per failed task; records and failed tasks stay until
    shutdown (a failure is sticky, so nothing is retried meanwhile).
    """

    def __init__(
        self,
        pool: PrefixBlockPool,
        config: PrefixCacheConfig,
        eager: bool | None = None,
        *,
        engine: CopyEngine | None = None,
        committer: Literal["thread", "manual", "on_demand"] = "thread",
    ):
        if committer not in ("thread", "manual", "on_demand"):
            raise OmniPrefixCacheUnmatchError(f"committer must be 'thread', 'manual' or 'on_demand', got {committer!r}")
        self.pool = pool
        self.config = config
        self.eager = (not torch.cuda.is_available()) if eager is None else bool(eager)
        self.committer_mode = committer
        self._tasks: dict[Tid, WriteTask] = {}
        self._completed: deque[Tid] = deque()  # pool-written, not yet drained by the manager
        self._failed: deque[Tid] = deque()  # failed; the manager raises from every later entry
        # Why tasks failed, for the error their joiners and the manager
        # raise: one record per failure cause (not per task), kept until
        # shutdown. Failed tasks stay registered.
        self._causes = FailureRecords()
        self.lock = sync.RLock()
        self.wake = sync.Condition(self.lock)
        self.stopping = False
        self._budget = GpuBudget(config.gpu_staging_bytes, self.lock)
        self._host = HostRows(engine or default_engine(self.eager), config)
        self._staging_pool = StagingBufferPool(
            config.staging_depth,
            config.staging_capacity_tokens,
            pin_memory=self._engine.pin_memory,
            alloc=self._engine.host_empty,
        )
        self.queues = CopyQueues()
        self._runner = OpRunner(self.lock, self._staging_pool.lock)
        self._registering_queued = False
        self._inline: list[WriteTask] = []  # dispatch_inline's tasks, run after the dispatch segment
        self.binding = ControllerBinding(self.queues, self._staging_pool)
        self.ops = compile_ops(
            active_protocol(),
            self.binding,
            self._effects(),
            self._guards(),
            self._batch_effects(),
            self._batch_guards(),
        )
        self._eager_dispatch = EagerDispatch(self)
        self._committer = Committer(self)
        self._worker: threading.Thread | None = None
        if not self.eager and committer == "thread":
            self._worker = sync.Thread(target=self._committer.loop, name="omni-prefix-cache-committer", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------ components

    @property
    def budget(self) -> GpuBudget:
        """The GPU-byte budget (its counters under ``lock``)."""
        return self._budget

    @property
    def staging_pool(self) -> StagingBufferPool:
        """The staging pages and their holders (under ``staging_pool.lock``)."""
        return self._staging_pool

    @property
    def host_rows(self) -> HostRows:
        """The copy stage and the reads of rows not yet in the pool."""
        return self._host

    @property
    def tasks(self) -> Mapping[Tid, WriteTask]:
        """The task registry (registered, not yet drained). Read without
        the lock: a checker looks between scheduled steps; callers that
        race the committer use ``registered()``."""
        return self._tasks

    @property
    def completed(self) -> Sequence[Tid]:
        """Pool-written tids not yet drained by the manager (read as ``tasks``)."""
        return self._completed

    @property
    def failed(self) -> Sequence[Tid]:
        """Failed tids not yet drained by the manager (read as ``tasks``)."""
        return self._failed

    @property
    def engine(self) -> CopyEngine:
        """Where rows leave the device."""
        return self._host.engine

    # ------------------------------------------------------------ protocol handlers

    def _effects(self) -> dict[str, Callable[[Any], None]]:
        budget = self._budget

        return {
            "register_task": lambda task: self._register_tasks((task,)),
            "charge_budget": budget.charge,
            "flush_oldest": lambda nbytes: budget.flush(nbytes, self._unfinished, self.escalate, self.join),
            "refund_unpinned": budget.refund_unpinned,
            "unpin_budget": budget.unpin,
            "wake_committer": lambda _: self.wake.notify_all(),
            "dispatch_inline": self._inline.append,
            # Looked up per call: tests wrap these two seams to inject failures.
            "copy_to_host": lambda task: self._copy_task(task),
            "pool_write": lambda task: self._scatter(task),
            "publish_completed": lambda task: self._completed.append(task.tid),
            "publish_failed": lambda task: self._failed.append(task.tid),
            "wake_failed": lambda task: task.wake_failed_waiters(),
            "close_staging": lambda _: self._staging_pool.close(),
            "drain_queues": lambda _: self._committer.drain(self._worker),
        }

    def _batch_effects(self) -> dict[str, Callable[[Batch], None]]:
        """Effects that run once for a whole batch (see specs.batch)."""

        def publish_completed(batch: Batch) -> None:
            self._completed.extend([task.tid for task in batch.items])

        return {
            "copy_to_host": self._copy_tasks,
            "pool_write": self._scatter_tasks,
            "register_task": lambda batch: self._register_tasks(batch.items),
            "unpin_budget": lambda batch: self._budget.unpin_many(batch.items),
            "wake_committer": lambda _: self.wake.notify_all(),
            "publish_completed": publish_completed,
            "dispatch_inline": lambda batch: self._inline.extend(batch.items),
        }

    def _register_tasks(self, tasks: Sequence[WriteTask]) -> None:
        """Effect ``register_task`` (controller lock held): the tasks join
        the registry, stamped for the budget flush's oldest-first order."""
        now, queued, registry = time.monotonic(), self._registering_queued, self._tasks
        for task in tasks:
            task.enqueued_time = now
            task.queued_at_submit = queued
            registry[task.tid] = task

    def _guards(self) -> dict[str, Callable[[Any], bool]]:
        return {
            "immediate": lambda task: task.schedule is WriteSchedule.JOIN_NEXT_STEP,
            "queued_at_submit": lambda task: bool(task.queued_at_submit),
            # The manager appends to an open write itself; the controller
            # registers only writes it does not know yet.
            "open_write_accepts": lambda task: task.tid in self._tasks,
            "over_budget": lambda nbytes: self._budget.exceeded_by(nbytes) and self._any_unfinished(),
            "task_failed": task_failed,
            "eager": lambda _: self.eager,
        }

    def _batch_guards(self) -> dict[str, Callable[[list[Any]], list[bool]]]:
        """Guards answered for a whole batch at once (see specs.batch): the
        same answer per task as ``_guards``, without a call per task."""
        immediate = WriteSchedule.JOIN_NEXT_STEP
        return {
            "immediate": lambda tasks: [task.schedule is immediate for task in tasks],
            "eager": lambda tasks: [self.eager] * len(tasks),
        }

    def _copy_task(self, task: WriteTask) -> None:
        """Effect ``copy_to_host``: the rows the task's host_ready move installs."""
        task.copied_rows = self._host.copy(task)

    def _copy_tasks(self, batch: Batch) -> None:
        """Effect ``copy_to_host`` for a batch: ``_copy_task`` per task, an
        item that raises leaving the batch. A staging view's copy stage
        makes no rows (it was copied at save), so while the seam is the
        controller's own it is not called for those tasks."""
        copy = self._copy_task  # looked up per batch: tests wrap the seam
        if getattr(copy, "__func__", None) is _PLAIN_COPY_TASK and self._host.copies_nothing(batch.items):
            return
        guarded_each(batch, copy)

    def _scatter_tasks(self, batch: Batch) -> None:
        """Effect ``pool_write`` for a batch: ``_scatter`` per task, an item
        that raises leaving the batch; while the seam is the controller's
        own and an eager batch is open, the tasks join it at once."""
        scatter = self._scatter  # looked up per batch: tests wrap the seam
        if getattr(scatter, "__func__", None) is _PLAIN_SCATTER:
            open_batch = self._eager_dispatch.open_batch()
            if open_batch is not None:
                self._eager_dispatch.add(open_batch, batch.items)
                return
        guarded_each(batch, scatter)

    def _scatter(self, task: WriteTask) -> None:
        """Effect ``pool_write``, then the rest of the task's write operation
        (``committer_write``, or ``eager_run`` on an eager controller):
        release its hold, publish its record, done. Inside an eager dispatch
        the rows join its batch instead; the batch's flush finishes them."""
        batch = self._eager_dispatch.open_batch()
        if batch is not None:
            self._eager_dispatch.add(batch, [task])
            return
        for key, slots, host in task.scatter_rows():
            self.pool.write(key, slots, host)
        self.finish_writes([task], self.ops.eager if self.eager else self.ops.write)

    def _run_eager(self, tasks: WriteTask | list[WriteTask]) -> None:
        """Operation ``eager_run`` for a task, or a dispatch's tasks as one
        batch, on this thread (see ``EagerDispatch.run``)."""
        self._eager_dispatch.run(tasks)

    def _run(self, op: RuntimeOp, ctx: Any) -> bool:
        return self._runner.run(op, ctx)

    def finish_writes(self, tasks: list[WriteTask], op: RuntimeOp) -> None:
        """The segments of ``op`` after its pool write (see ``OpRunner.finish``);
        a task the state no longer lets finish fails."""
        self._runner.finish(tasks, op, lambda task: self.fail_task(task, None))

    # ------------------------------------------------------------ staging

    def stage_step_host(
        self,
        tensors: dict[TensorName, torch.Tensor],
        n: int,
        freeze_event: Any,
        step_holder: StagingBufferHolder,
    ) -> StepD2HClaim:
        """Claim a staging page for ``step_holder`` and launch one whole-step
        device-to-host copy of ``tensors`` (see ``StagingBufferPool.stage_step``)."""
        return self._staging_pool.stage_step(
            tensors, n, freeze_event, step_holder, self._engine, self.config.staging_claim_timeout_s
        )

    def staging_release(self, slot: int, holder: StagingBufferHolder, trigger: str = "consume") -> None:
        """Release a step holder by a ``staging_holder`` spec trigger
        (``consume``, ``abandon``). Task holders move only in operations."""
        if holder.kind != "step":
            raise OmniPrefixCacheUnmatchError(
                f"staging: task {holder.owner_id} is released by its own write or failure, not by a caller"
            )
        self._staging_pool.release(slot, holder, trigger)

    def in_flight_tasks(self) -> int:
        """Registered tasks not yet drained (diagnostics)."""
        return len(self._tasks)

    # ------------------------------------------------------------ submit

    def register(self, task: WriteTask, queued: bool = True) -> None:
        """Register ``task`` (``save``'s registration, see ``register_many``)."""
        self.register_many([task], queued)

    def register_many(self, tasks: list[WriteTask], queued: bool = True) -> None:
        """Register a step's new writes: operation ``save``'s registration
        steps, per task under one controller and one staging lock. An
        immediate write is queued and binds to its step's staging page; a
        deferred one is queued when ``queued``. Runs no copy (safe under the
        manager's state lock); queued writes then go through ``dispatch``."""
        register = self.ops.register.batch.segments[0]
        batch = Batch(list(tasks), truncate=True)
        with self.lock, self._staging_pool.lock:
            self._registering_queued = queued
            register(batch)
        if batch.errors:
            raise batch.errors[0][1]

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """Hand registered writes to the committer (``save``'s dispatch):
        push and wake; eager, ``eager_run`` inline (never under the manager's
        state lock; see ``EagerDispatch.dispatch`` for its failure rule)."""
        if not tasks:
            return
        segment = self.ops.dispatch.batch.segments[0]
        batch = Batch(list(tasks), truncate=True)
        with self.lock:
            try:
                segment(batch)
            finally:
                inline = self._inline.copy()
                self._inline.clear()
        if batch.errors:
            raise batch.errors[0][1]
        if inline:
            with torch.inference_mode():
                self._eager_dispatch.dispatch(inline)

    def submit(self, task: WriteTask, queued: bool = True) -> None:
        """``register`` + ``dispatch`` (callers not holding the state lock)."""
        self.register(task, queued)
        if queued:
            self.dispatch([task])

    def append_chunk(self, task: WriteTask, chunk: _WriteChunk, freeze_event: Any = None) -> Any:
        """Append to a pending task. None when appended, else the closing state.
        Per device the newest freeze event covers the older ones; a device
        only an older chunk used keeps its own event."""
        return task.append_chunk(chunk, DeviceEvents.merged(task.freeze_event, freeze_event))

    # ------------------------------------------------------------ failure

    def fail_tasks(self, tasks: list[WriteTask], error: BaseException | None) -> None:
        """Operation ``fail`` for every task of ``tasks`` it admits (an eager
        batch, a failed save's registrations), recording ``error`` as the
        cause where it is a write-failed error."""
        for task in tasks:
            self.fail_task(task, error)

    def fail_task(self, task: WriteTask, error: BaseException | None) -> bool:
        """Operation ``fail`` for ``task`` (a no-op once it is terminal, so
        budget is never uncharged twice), ``error`` its recorded cause."""
        if isinstance(error, OmniPrefixCacheWriteFailedError) and not task.is_terminal:
            with self.lock:
                self._causes.add(task.tid, error)
        return self._run(self.ops.fail, task)

    # The error to raise for a task failing at a stage (see write_errors).
    write_error = staticmethod(write_error)

    def failure_of(self, tid: Tid) -> OmniPrefixCacheWriteFailedError | None:
        """The error of the failure record naming a failed task: the first
        write-failed error its cause made, which names the first task that
        cause failed (None if the task failed without a write-failed error:
        a shutdown, a save refused by a library error)."""
        with self.lock:
            return self._causes.of(tid)

    @property
    def failures(self) -> list[FailureRecord]:
        """The failure records, one per failure cause (not one per failed
        task), each naming the tasks it failed; kept until shutdown."""
        with self.lock:
            return self._causes.records()

    # ------------------------------------------------------------ device

    def is_device(self, t: torch.Tensor) -> bool:
        """True if ``t`` is copied on the engine's device lanes (so it must be
        frozen by a clone and a freeze event first)."""
        return self._engine.is_device(t)

    def freeze(self, tensors: list[torch.Tensor]) -> Any:
        """The freeze event for clones just taken on the compute stream:
        blocking, recorded on each tensor device's current stream. None when
        none is a device tensor. Record it after the clones, on the stream
        the forward ran on (see docs/cuda.md)."""
        return self._engine.freeze(tensors)

    # ------------------------------------------------------------ budget

    def pin_budget(self, ticket: _BudgetTicket, tid: Tid) -> None:
        """Record that ``tid`` views the clone ``ticket`` charges."""
        self._budget.pin(ticket, tid)

    def reserve(self, nbytes: int) -> None:
        """``save``'s budget steps: over budget, flush the oldest unfinished
        tasks (escalate + join) until under budget or none is left; then
        charge ``nbytes``. Blocks: never call under the manager's state lock."""
        self.ops.reserve.segments[0](nbytes)

    def _any_unfinished(self) -> bool:
        with self.lock:
            return any(not t.is_terminal for t in self._tasks.values())

    def _unfinished(self) -> list[WriteTask]:
        with self.lock:
            return [t for t in self._tasks.values() if not t.is_terminal]

    def refund_unpinned(self, tickets: list[_BudgetTicket]) -> None:
        """Uncharge reservations that no task ever pinned (``abandon_save``'s
        refund; also a clone no request views). A pinned or already freed
        ticket refunds nothing: its last task uncharges it."""
        self.ops.refund.segments[-1](tickets)

    # ------------------------------------------------------------ lifecycle

    def escalate(self, tids: list[Tid]) -> None:
        """Operation ``escalate``: put unfinished tasks at the head of the
        high-priority queue. A claimed task is never re-queued: the committer
        claims under the same lock. Eager: ``eager_run`` for the tasks its
        entry admits, inline (outside the manager's state lock)."""
        tasks = [t for tid in tids if (t := self._tasks.get(tid)) is not None]
        if self.eager:
            if tasks:
                with torch.inference_mode():
                    self._eager_dispatch.dispatch(tasks)
            return
        segment = self.ops.escalate.segments[0]
        with self.lock:
            for task in tasks:
                segment(task)

    def join(self, tids: list[Tid]) -> None:
        """Operation ``join``: wait until each task's pool write is over.
        Raises if one failed or does not finish within ``staging_claim_timeout_s``."""
        self._wait_tasks(tids, self.ops.join_event)  # type: ignore[arg-type]

    def join_host_ready(self, tids: list[Tid]) -> None:
        """Wait until each task's host rows exist (not the pool write)."""
        self._wait_tasks(tids, "host_ready")

    def _wait_tasks(self, tids: list[Tid], event: Literal["done", "host_ready"]) -> None:
        self._committer.wait(tids, event)

    def drain_completed(self) -> list[Tid]:
        """Pop pool-written tids and forget their tasks (manager, under its lock)."""
        with self.lock:
            completed = self._completed
            if not completed:
                return []
            out = list(completed)
            completed.clear()
            forget = self._tasks.pop
            for tid in out:
                forget(tid, None)
        return out

    def drain_failed(self) -> list[Tid]:
        """Pop failed tids (one-shot). Their tasks stay registered."""
        with self.lock:
            failed = self._failed
            if not failed:
                return []
            out = list(failed)
            failed.clear()
        return out

    def get_task(self, tid: Tid) -> WriteTask | None:
        return self._tasks.get(tid)

    def registered(self) -> list[WriteTask]:
        """Every registered task (not yet drained)."""
        with self.lock:
            return list(self._tasks.values())

    def shutdown(self) -> None:
        """Operation ``shutdown``: close the staging pool (waiting claims
        wake and raise); the committer writes what is queued (threaded: the
        worker drains the queues; manual: drained here); every task still
        unfinished (pending deferred writes, a stuck copy) then fails so no
        joiner hangs."""
        self._run(self.ops.shutdown, None)

    # ------------------------------------------------------------ committer

    def committer_claim(self) -> Tid | None:
        """Operation ``committer_claim`` (see ``Committer.claim``)."""
        return self._committer.claim()

    def committer_copy(self) -> Tid | None:
        """Operation ``committer_copy`` (see ``Committer.copy``)."""
        return self._committer.copy()

    def committer_write(self) -> list[Tid]:
        """Operation ``committer_write`` (see ``Committer.write``)."""
        return self._committer.write()

    def committer_step(self) -> str | None:
        """One unit of committer work (see ``Committer.step``)."""
        return self._committer.step()

    # ------------------------------------------------------------ reads

    def fetch_host(self, task: WriteTask, slots: torch.Tensor, key: TensorName) -> torch.Tensor:
        """Rows of ``slots`` for ``key`` from a task not yet in the pool (see
        ``HostRows.fetch``)."""
        return self._host.fetch(task, slots, key)

    # ------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        """Tasks by state, queue depths, staged bytes, holders by kind, records."""
        with self.lock:
            by_state = Counter(t.state.name for t in self._tasks.values())
            out: dict[str, Any] = {
                "tasks_by_state": {s.name: by_state.get(s.name, 0) for s in TaskState},
                **self.queues.depths(),
                "completed_undrained": len(self._completed),
                "failed_undrained": len(self._failed),
                "staged_bytes": self._budget.staged_bytes,
                "budget_flushes": self._budget.flushes,
            }
        out["staging_host_bytes"] = self._staging_pool.host_bytes()
        holders = Counter(h.kind for h in self._staging_pool.holders())
        out["holders"] = {"step": holders.get("step", 0), "task": holders.get("task", 0)}
        out["mode"] = "eager" if self.eager else f"{self.committer_mode}:{self._engine.name}"
        return out


# The controller's own copy and pool-write seams: a batch effect takes its
# fast path only while the seam a task would go through is one of these.
_PLAIN_COPY_TASK = OmniPrefixCacheController._copy_task
_PLAIN_SCATTER = OmniPrefixCacheController._scatter
