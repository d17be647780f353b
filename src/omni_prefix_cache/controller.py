"""The write path: WriteTasks, the staging pool, the GPU-byte budget, the
copy queues and the single committer that writes the CPU block pool.

The manager owns request and slot identity and decides when to submit; this
class runs the writes. Two schedules (``WriteSchedule``):

    JOIN_NEXT_STEP   save already copied the whole step into a staging page
                     and set ``chunk.host`` to views of it. The committer
                     waits that copy's event, then writes the pool.
    JOIN_ON_FINISH   rows stay in a device clone; the committer copies them
                     to owned host tensors, then writes the pool.

Three ways to run the committer:

    threaded  (eager=False)  a daemon thread serves the queues (CUDA lanes
                             where CUDA exists, host copies on CPU).
    manual    (eager=False, committer="manual")  no thread; a test drives
                             ``committer_claim`` / ``committer_copy`` /
                             ``committer_write`` to pick the interleaving.
    on_demand (eager=False, committer="on_demand")  as manual, but a join
                             first runs committer steps on the joining
                             thread until the awaited event fires or the
                             committer is idle: single-threaded runs of the
                             whole manager whose interleaving a test picks.
    eager     (eager=True)   ``dispatch`` runs copy and pool write inline.

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
from collections.abc import Callable
from typing import Any, Literal

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.budget import GpuBudget
from omni_prefix_cache.committer import Committer
from omni_prefix_cache.copy_engine import CopyEngine, DeviceEvents, default_engine
from omni_prefix_cache.copy_queues import CopyQueues
from omni_prefix_cache.eager import EagerDispatch, _joined, _PoolWriteBatch
from omni_prefix_cache.host_rows import HostRows
from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    TensorName,
    Tid,
    WriteSchedule,
)
from omni_prefix_cache.protocol_runtime import ControllerBinding, RuntimeOp, active_protocol, compile_ops, task_failed
from omni_prefix_cache.staging import StagingBufferHolder, StagingBufferPool, StepD2HClaim
from omni_prefix_cache.write_task import (
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


class OmniPrefixCacheController:
    """Staging pool + queues + committer for one manager.

    Locking: ``lock`` (reentrant, shared with the ``wake`` condition) covers
    the task registry, the copy queues, the completion and failure records
    and the budget counter. Never held across a copy, a pool write, a join
    or a budget flush. Each task's own lock covers its state.
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
        self._config = config
        self.eager = (not torch.cuda.is_available()) if eager is None else bool(eager)
        self._committer_mode = committer
        self._tasks: dict[Tid, WriteTask] = {}
        self._completed: deque[Tid] = deque()  # pool-written, not yet drained by the manager
        self._failed: deque[Tid] = deque()  # failed; the manager raises from every later entry
        # Why a task failed, for the error its joiners and the manager raise.
        # Only failed tasks have an entry, and failed tasks stay registered.
        self._causes: dict[Tid, OmniPrefixCacheWriteFailedError] = {}
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
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
        self._registering_queued = False
        self._inline: list[WriteTask] = []  # dispatch_inline's tasks, run after the dispatch segment
        self.binding = ControllerBinding(self.queues, self._staging_pool)
        self.ops = compile_ops(active_protocol(), self.binding, self._effects(), self._guards())
        self._eager_dispatch = EagerDispatch(self)
        self._committer = Committer(self)
        self._worker: threading.Thread | None = None
        if not self.eager and committer == "thread":
            self._worker = threading.Thread(
                target=self._committer.loop, name="omni-prefix-cache-committer", daemon=True
            )
            self._worker.start()

    # ------------------------------------------------------------ protocol handlers

    def _effects(self) -> dict[str, Callable[[Any], None]]:
        budget = self._budget

        def register_task(task: WriteTask) -> None:
            task.enqueued_time = time.monotonic()
            task.queued_at_submit = self._registering_queued
            self._tasks[task.tid] = task

        def drain_queues(_: Any) -> None:
            with self.wake:
                self.stopping = True
                self.wake.notify_all()
            if self._worker is not None:
                self._worker.join(timeout=5.0)
            elif not self.eager:
                while self._committer.step() is not None:
                    pass
            for task in list(self._tasks.values()):
                self._run(self.ops.fail, task)

        return {
            "register_task": register_task,
            "charge_budget": budget.charge,
            "flush_oldest": self._flush_oldest,
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
            "drain_queues": drain_queues,
        }

    def _guards(self) -> dict[str, Callable[[Any], bool]]:
        return {
            "immediate": lambda task: task.schedule is WriteSchedule.JOIN_NEXT_STEP,
            "queued_at_submit": lambda task: bool(task.queued_at_submit),
            # The manager appends to an open write itself; the controller
            # registers only writes it does not know yet.
            "open_write_accepts": lambda task: task.tid in self._tasks,
            "over_budget": lambda nbytes: self._budget.exceeded_by(nbytes) and self._has_unfinished(),
            "task_failed": task_failed,
            "eager": lambda _: self.eager,
        }

    def _copy_task(self, task: WriteTask) -> None:
        """Effect ``copy_to_host``: the rows the task's host_ready move installs."""
        task.copied_rows = self._host.copy(task)

    def _scatter(self, task: WriteTask) -> None:
        """Effect ``pool_write``, then the rest of the task's write operation
        (``committer_write``, or ``eager_run`` on an eager controller):
        release its hold, publish its record, done. Inside an eager dispatch
        the rows join its batch instead; the batch's flush finishes them."""
        batch = self._eager_dispatch.open_batch()
        if batch is not None:
            self._eager_dispatch.add(batch, task)
            return
        for key, slots, host in task.scatter_rows():
            self.pool.write(key, slots, host)
        self.finish_writes([task], self.ops.eager if self.eager else self.ops.write)

    def _run_eager(self, task: WriteTask) -> None:
        """Operation ``eager_run`` for ``task`` on this thread (see ``EagerDispatch.run``)."""
        self._eager_dispatch.run(task)

    def _lock_for(self, name: str, task: WriteTask) -> Any:
        if name == "controller":
            return self.lock
        if name == "task":
            return task.lock
        if name == "staging":
            return self._staging_pool.lock
        return _NO_LOCK  # "none"; "state" is the manager's, held by the caller

    def _run(self, op: RuntimeOp, ctx: Any) -> bool:
        """Every segment of ``op`` for ``ctx``, each under the lock it
        declares; the entry move is checked under the first segment's lock.
        False when the entry does not admit ``ctx``."""
        first = True
        for name, segment in zip(op.locks, op.segments):
            with self._lock_for(name, ctx):
                if first and not op.admits(ctx):
                    return False
                first = False
                segment(ctx)
        return True

    def finish_writes(self, tasks: list[WriteTask], op: RuntimeOp) -> None:
        """The segments of ``op`` after its pool write, for tasks whose rows
        are in the pool: per task in the spec's order, one lock acquisition
        per segment for the whole batch. A task whose move the state no
        longer allows (it failed meanwhile) is failed and dropped."""
        for index in range(op.tail, len(op.segments)):
            segment, name = op.segments[index], op.locks[index]
            batched = name in ("controller", "staging")
            keep: list[WriteTask] = []
            # A controller segment may release staging holds: one staging
            # acquisition for the batch too (lock order controller -> staging).
            with self.lock if batched else _NO_LOCK, self._staging_pool.lock if batched else _NO_LOCK:
                for task in tasks:
                    try:
                        with _NO_LOCK if batched else self._lock_for(name, task):
                            segment(task)
                        keep.append(task)
                    except OmniPrefixCacheUnmatchError as exc:
                        logger.error("omni prefix cache: finishing the write of task %s: %s", task.tid, exc)
                        self.fail_task(task, None)
            tasks = keep

    # ------------------------------------------------------------ staging

    @property
    def _engine(self) -> CopyEngine:
        return self._host.engine

    @_engine.setter
    def _engine(self, engine: CopyEngine) -> None:
        self._host.engine = engine

    def stage_step_host(
        self,
        tensors: dict[TensorName, torch.Tensor],
        n: int,
        freeze_event: Any,
        step_holder: StagingBufferHolder,
    ) -> StepD2HClaim:
        """Claim a staging page for ``step_holder`` and launch one whole-step
        device-to-host copy of ``tensors`` (each ``n`` rows) into it.

        Engine thread, outside the manager's state lock (the claim may wait).
        A leftover-only save passes no tensors and still claims a page.
        Raises OmniPrefixCacheUnmatchError when ``n`` exceeds the page, and
        the pool's timeout error when no page frees in time. On any failure
        the step holder is released (``abandon``) before raising.
        """
        if tensors and n > self._staging_pool.capacity:
            raise OmniPrefixCacheUnmatchError(
                f"step {step_holder.owner_id} has {n} tokens; staging capacity is {self._staging_pool.capacity} "
                "(size staging_capacity_tokens to max_num_batched_tokens)"
            )
        page = self._staging_pool.claim(step_holder, self._config.staging_claim_timeout_s)
        try:
            views = {
                key: self._staging_pool.views(page, key, n, int(src.shape[-1]), src.dtype)
                for key, src in tensors.items()
            }
            # Each key's rows land straight in its slice of the page: no
            # device-side temporary on the copy stream.
            copies = [(views[key], src) for key, src in tensors.items()]
            event = None
            if any(self._engine.is_device(src) for _, src in copies):
                event = self._engine.launch(freeze_event, copies)
            else:
                for dst, src in copies:
                    dst.copy_(src)
            return StepD2HClaim(staging_slot=page, views=views, event=event)
        except BaseException as exc:
            self._staging_pool.release(page, step_holder, "abandon")
            if isinstance(exc, OmniPrefixCacheUnmatchError) or not isinstance(exc, Exception):
                raise
            # Nothing was registered yet, so nothing is lost but this step.
            raise OmniPrefixCacheUnmatchError(
                f"step {step_holder.owner_id}: copying keys {sorted(tensors)} ({n} rows) into staging page {page} "
                f"failed: {exc!r}"
            ) from exc

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
        register = self.ops.register.segments[0]
        with self.lock, self._staging_pool.lock:
            self._registering_queued = queued
            for task in tasks:
                register(task)

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """Hand registered writes to the committer (``save``'s dispatch).

        Threaded/manual: push and wake. Eager: copy and pool write run
        here, inline (never call under the manager's state lock); the pool
        is written once per key for the batch, and if any task fails, every
        task of the batch not yet written fails too before the write-failed
        error (naming the failed task, its cause as ``__cause__``) propagates.
        """
        if not tasks:
            return
        segment = self.ops.dispatch.segments[0]
        with self.lock:
            for task in tasks:
                segment(task)
            inline = self._inline.copy()
            self._inline.clear()
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
                self._causes.setdefault(task.tid, error)
        return self._run(self.ops.fail, task)

    def _fail_task(self, tid: Tid | None) -> None:
        """``fail_task`` by tid, with no cause (tests)."""
        task = self._tasks.get(tid) if tid is not None else None
        if task is not None:
            self.fail_task(task, None)

    def write_error(
        self,
        task: WriteTask,
        cause: BaseException,
        stage: str,
        key: TensorName | None = None,
        slots: torch.Tensor | None = None,
    ) -> BaseException:
        """The error to raise for ``task`` failing at ``stage`` (``copy`` or
        ``pool write``): ``cause`` itself when it is already one (or not an
        Exception), else a write-failed error naming the task, request, keys
        and slots, with ``cause`` as its ``__cause__``."""
        if isinstance(cause, OmniPrefixCacheWriteFailedError) or not isinstance(cause, Exception):
            return cause
        if key is not None:
            keys: tuple[TensorName, ...] = (key,)
        else:
            keys = tuple(dict.fromkeys(k for c in task.chunks for k in (*c.host, *c.tensors)))
        if slots is None:
            parts = [c.slots_cpu for c in task.chunks]
            slots = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
        listed = [int(x) for x in slots.tolist()]
        shown = f"{listed[:16]}" + (f" (+{len(listed) - 16} more)" if len(listed) > 16 else "")
        error = OmniPrefixCacheWriteFailedError(
            f"omni prefix cache write failed: {stage} of task {task.tid} (req {task.req_id!r}, "
            f"{task.schedule.value}) keys {list(keys)} slots {shown}: {cause!r}",
            tid=task.tid,
            req_id=task.req_id,
            keys=keys,
            slots=tuple(listed),
        )
        error.__cause__ = cause
        return error

    def failure_of(self, tid: Tid) -> OmniPrefixCacheWriteFailedError | None:
        """The recorded cause of a failed task (None if it failed without a
        write-failed error: a shutdown, a save refused by a library error)."""
        with self.lock:
            return self._causes.get(tid)

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

    @property
    def _staged_bytes(self) -> int:
        return self._budget.staged_bytes

    def pin_budget(self, ticket: _BudgetTicket, tid: Tid) -> None:
        """Record that ``tid`` views the clone ``ticket`` charges."""
        self._budget.pin(ticket, tid)

    def reserve(self, nbytes: int) -> None:
        """``save``'s budget steps: over budget, flush the oldest unfinished
        tasks (escalate + join) until under budget or none is left; then
        charge ``nbytes``. Blocks: never call under the manager's state lock."""
        self.ops.reserve.segments[0](nbytes)

    def _has_unfinished(self) -> bool:
        with self.lock:
            return any(not t.is_terminal for t in self._tasks.values())

    def _flush_oldest(self, nbytes: int) -> None:
        while True:
            with self.lock:
                oldest = self._budget.over(nbytes, [t for t in self._tasks.values() if not t.is_terminal])
            if oldest is None:
                return
            # DEBUG: a small budget flushes every few steps; stats() counts them (budget_flushes_total).
            logger.debug("omni prefix cache: GPU staging budget full, flushing task %d", oldest.tid)
            self.escalate([oldest.tid])
            self.join([oldest.tid])

    def refund_unpinned(self, tickets: list[_BudgetTicket]) -> None:
        """Uncharge reservations that no task ever pinned (``abandon_save``'s
        refund; also a clone no request views). A pinned or already freed
        ticket refunds nothing: its last task uncharges it."""
        self.ops.refund.segments[-1](tickets)

    def _release_staged_bytes(self, task: WriteTask) -> None:
        """Unpin ``task`` from its tickets (effect ``unpin_budget``)."""
        self._budget.unpin(task)

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
        timeout = self._config.staging_claim_timeout_s
        deadline = time.monotonic() + timeout
        raises = self.ops.join_raises
        for tid in tids:
            task = self._tasks.get(tid)
            if task is None:
                continue  # drained: already written
            if self._committer_mode == "on_demand" and not self.eager:
                self._committer.step_until(task, event, deadline)
            if not getattr(task, event).wait(max(0.0, deadline - time.monotonic())):
                raise OmniPrefixCacheUnmatchError(
                    f"task {tid} ({task.schedule.value}) did not reach {event} within {timeout:g}s "
                    f"(state={task.state.name}, in_flight_tasks={len(self._tasks)})"
                )
            if raises(task):
                # The one-shot failure record may already be drained
                # elsewhere, so the joiner raises too.
                cause = self.failure_of(tid)
                if cause is None and self.stopping:
                    raise OmniPrefixCacheShutdownError(
                        f"task {tid} ({task.schedule.value}) failed before {event}: the cache was shut down"
                    )
                error = OmniPrefixCacheWriteFailedError(
                    f"task {tid} ({task.schedule.value}) write failed before {event}"
                    + (f": {cause}" if cause is not None else ""),
                    tid=tid,
                    req_id=task.req_id,
                    keys=cause.keys if cause is not None else (),
                    slots=cause.slots if cause is not None else (),
                )
                raise error from (cause.__cause__ if cause is not None else None)

    def drain_completed(self) -> list[Tid]:
        """Pop pool-written tids and forget their tasks (manager, under its lock)."""
        with self.lock:
            out = list(self._completed)
            self._completed.clear()
            for tid in out:
                self._tasks.pop(tid, None)
        return out

    def drain_failed(self) -> list[Tid]:
        """Pop failed tids (one-shot). Their tasks stay registered."""
        with self.lock:
            out = list(self._failed)
            self._failed.clear()
        return out

    def get_task(self, tid: Tid) -> WriteTask | None:
        return self._tasks.get(tid)

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

    def _scatter_host_ready(self) -> list[Tid]:
        return self._committer.write()

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
    def _eager(self) -> bool:
        return self.eager

    @_eager.setter
    def _eager(self, value: bool) -> None:
        self.eager = value

    # ------------------------------------------------------------ reads

    def fetch_host(self, task: WriteTask, slots: torch.Tensor, key: TensorName) -> torch.Tensor:
        """Rows of ``slots`` for ``key`` from a task not yet in the pool (see
        ``HostRows.fetch``)."""
        return self._host.fetch(task, slots, key)

    # ------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        """A snapshot for operators: tasks by state, queue depths, staged
        bytes, staging holders by kind, pending completion/failure records."""
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
        out["mode"] = "eager" if self.eager else f"{self._committer_mode}:{self._engine.name}"
        return out
