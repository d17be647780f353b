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

Every task and holder move goes through the compiled specs (``write_task``,
``staging_holder``); this module holds no transition table of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Literal

import torch

from omni_prefix_cache import sync
from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.copy_engine import CopyEngine, DeviceEvents, default_engine
from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    TensorName,
    Tid,
    WriteSchedule,
)
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
    "_WriteChunk",
]


# How often an on_demand join looks for committer work that another joiner
# made visible after this one found none (test modes only).
_ON_DEMAND_RECHECK_S = 0.005


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0; when the parts are back-to-back views of one
    buffer (a step's staging page, its slot mapping) return one view over
    them instead of copying every row again."""
    first = parts[0]
    if first.dim() >= 1 and first.is_contiguous():
        row = first.stride(0) if first.dim() > 0 else 1
        storage, offset, rows = first.untyped_storage().data_ptr(), first.storage_offset(), first.shape[0]
        for part in parts[1:]:
            if (
                part.untyped_storage().data_ptr() != storage
                or part.storage_offset() != offset + rows * row
                or part.shape[1:] != first.shape[1:]
                or not part.is_contiguous()
            ):
                return torch.cat(parts, dim=0)
            rows += part.shape[0]
        return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), first.storage_offset())
    return torch.cat(parts, dim=0)


class _PoolWriteBatch:
    """Pool writes of one eager dispatch, flushed once per key."""

    def __init__(self) -> None:
        self.tasks: list[WriteTask] = []
        self.rows: list[list[tuple[TensorName, torch.Tensor, torch.Tensor]]] = []


class OmniPrefixCacheController:
    """Staging pool + queues + committer for one manager.

    Locking: ``_lock`` (shared with the ``_wake`` condition) covers the task
    registry, the queues, ``_blocked``/``_claimed``, the completion and
    failure records and ``_staged_bytes``. Never held across a copy, a pool
    write, a join or a budget flush. Each task's own lock covers its state.
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
        self._pool = pool
        self._config = config
        self._eager = (not torch.cuda.is_available()) if eager is None else bool(eager)
        self._engine = engine or default_engine(self._eager)
        self._committer_mode = committer
        self._tasks: dict[Tid, WriteTask] = {}
        self._completed: deque[Tid] = deque()  # pool-written, not yet drained by the manager
        self._failed: deque[Tid] = deque()  # failed; the manager raises from every later entry
        # Why a task failed, for the error its joiners and the manager raise.
        # Only failed tasks have an entry, and failed tasks stay registered.
        self._causes: dict[Tid, OmniPrefixCacheWriteFailedError] = {}
        self._staged_bytes = 0
        self._budget_flushes = 0
        self._lock = sync.Lock()
        self._wake = sync.Condition(self._lock)
        self._queue_hi: deque[Tid] = deque()  # JOIN_NEXT_STEP and escalated JOIN_ON_FINISH
        self._queue_lo: deque[Tid] = deque()  # JOIN_ON_FINISH queued without escalation
        self._claimed: deque[Tid] = deque()  # COPYING, claimed, copy stage not yet run
        self._blocked: list[Tid] = []  # copy stage done (HOST_READY), awaiting pool write
        self._shutdown = False
        self._batch = threading.local()
        self._staging_pool = StagingBufferPool(
            config.staging_depth,
            config.staging_capacity_tokens,
            pin_memory=self._engine.pin_memory,
            alloc=self._engine.host_empty,
        )
        self._worker: threading.Thread | None = None
        if not self._eager and committer == "thread":
            self._worker = sync.Thread(target=self._worker_loop, name="omni-prefix-cache-committer", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------ staging

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

    def staging_bind(self, slot: int, holder: StagingBufferHolder) -> None:
        """Bind a task holder to the page its step holds (before dispatch)."""
        self._staging_pool.bind(slot, holder)

    def staging_bind_many(self, slot: int, holders: list[StagingBufferHolder]) -> None:
        """``staging_bind`` for all of a step's task holders, under one lock."""
        self._staging_pool.bind_many(slot, holders)

    def staging_release(self, slot: int, holder: StagingBufferHolder, trigger: str = "consume") -> None:
        """Release a holder by a ``staging_holder`` spec trigger."""
        self._staging_pool.release(slot, holder, trigger)

    def _release_task_slot(self, task: WriteTask, trigger: Literal["written", "fail"]) -> None:
        """Drop the task's staging hold at its pool write or failure. A
        failure path tolerates a hold that was never bound."""
        if task.staging_slot is None:
            return
        holder = StagingBufferHolder.for_task(task.tid)
        if trigger == "fail" and not self._staging_pool.holds(holder):
            return
        self._staging_pool.release(task.staging_slot, holder, trigger)

    def in_flight_tasks(self) -> int:
        """Registered tasks not yet drained (diagnostics)."""
        return len(self._tasks)

    # ------------------------------------------------------------ submit

    def register(self, task: WriteTask, queued: bool = True) -> None:
        """Make ``task`` visible; ``queued`` moves it PENDING -> QUEUED.

        Safe under the manager's state lock: runs no copy. Reserve the
        task's bytes and pin its budget tickets first; queued tasks must
        then go through ``dispatch``.
        """
        self.register_many([task], queued)

    def register_many(self, tasks: list[WriteTask], queued: bool = True) -> None:
        """``register`` for a step's tasks under one lock (same contract)."""
        now = time.monotonic()
        with self._lock:
            for task in tasks:
                task.enqueued_time = now
                self._tasks[task.tid] = task
                if queued:
                    task.transition(TaskState.QUEUED)

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """Hand registered, queued tasks to the committer.

        Threaded/manual: enqueue and wake. Eager: copy and pool write run
        here, inline (never call under the manager's state lock); the pool
        is written once per key for the batch, and if any task fails, every
        task of the batch not yet written fails too before the write-failed
        error (naming the failed task, its cause as ``__cause__``) propagates.
        """
        if not tasks:
            return
        if self._eager:
            with torch.inference_mode():
                self._dispatch_eager(tasks)
            return
        with self._wake:
            for task in tasks:
                queue = self._queue_hi if task.schedule is WriteSchedule.JOIN_NEXT_STEP else self._queue_lo
                queue.append(task.tid)
            self._wake.notify_all()

    def _dispatch_eager(self, tasks: list[WriteTask]) -> None:
        # A task listed twice (e.g. escalate([t, t])) must run once: its
        # second visit would find it HOST_READY in the open batch and queue
        # its pool write and completion a second time.
        tasks = list(dict.fromkeys(tasks))
        outer = getattr(self._batch, "open", None)
        batch = _PoolWriteBatch()
        self._batch.open = batch
        current: WriteTask | None = None
        try:
            for current in tasks:
                self._run_eager(current)
        except BaseException as exc:
            self._batch.open = outer
            # Tasks written before the failure keep their rows; the rest were
            # registered but will never run, so they fail (releasing budget
            # and staging holds) before the error reaches the caller.
            self._flush_batch(batch, reraise=False)
            error = self.write_error(current, exc, "copy") if current is not None else exc
            self.fail_tasks(tasks, error)
            raise error  # noqa: B904 - the cause is set on the error itself
        self._batch.open = outer
        try:
            self._flush_batch(batch, reraise=True)
        except BaseException as exc:
            self.fail_tasks(tasks, exc)
            raise

    def fail_tasks(self, tasks: list[WriteTask], error: BaseException) -> None:
        """Fail every unfinished task of ``tasks`` (an eager batch, a failed
        save's registrations), recording ``error`` as the cause where it is a
        write-failed error."""
        for task in tasks:
            if isinstance(error, OmniPrefixCacheWriteFailedError):
                self._note_cause(task, error)
            self._fail_task(task.tid)

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

    def _note_cause(self, task: WriteTask, error: BaseException) -> None:
        """Record why ``task`` fails (first cause wins), before it fails."""
        if isinstance(error, OmniPrefixCacheWriteFailedError) and not task.is_terminal:
            with self._lock:
                self._causes.setdefault(task.tid, error)

    def failure_of(self, tid: Tid) -> OmniPrefixCacheWriteFailedError | None:
        """The recorded cause of a failed task (None if it failed without a
        write-failed error: a shutdown, a save refused by a library error)."""
        with self._lock:
            return self._causes.get(tid)

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
        with self._lock:
            ticket.tids.add(tid)

    def reserve(self, nbytes: int) -> None:
        """Charge ``nbytes`` of device clone. Over budget, force the oldest
        unfinished task to copy and wait for it, until under budget or none
        is left. Blocks: never call under the manager's state lock."""
        while True:
            with self._lock:
                if self._staged_bytes + nbytes <= self._config.gpu_staging_bytes:
                    self._staged_bytes += nbytes
                    return
                pending = [t for t in self._tasks.values() if not t.is_terminal]
                if not pending:
                    self._staged_bytes += nbytes
                    return
                oldest = min(pending, key=lambda t: t.enqueued_time)
                self._budget_flushes += 1
            # DEBUG: a small budget flushes every few steps; stats() counts them (budget_flushes_total).
            logger.debug("omni prefix cache: GPU staging budget full, flushing task %d", oldest.tid)
            self.escalate([oldest.tid])
            self.join([oldest.tid])

    def refund_unpinned(self, tickets: list[_BudgetTicket]) -> None:
        """Uncharge reservations that no task ever pinned (a save that
        failed, or a clone no request views). A pinned or already freed
        ticket refunds nothing: its last task uncharges it."""
        with self._lock:
            for ticket in tickets:
                if not ticket.tids:
                    self._staged_bytes -= ticket.release(-1)

    def _release_staged_bytes(self, task: WriteTask) -> None:
        """Unpin ``task`` from its tickets; a ticket uncharges once, when its
        last holder leaves. Idempotent."""
        tickets = task.budget_tickets()
        if not tickets:
            return
        with self._lock:
            for ticket in tickets:
                self._staged_bytes -= ticket.release(task.tid)

    # ------------------------------------------------------------ lifecycle

    def escalate(self, tids: list[Tid]) -> None:
        """Put unfinished tasks at the head of the high-priority queue.

        PENDING -> QUEUED (head of high); QUEUED on the low queue moves up;
        QUEUED on the high queue stays. COPYING and later belong to the
        committer and are never re-queued: the committer claims under the
        same lock, so it cannot pop a task behind escalate's back. Eager:
        runs the unfinished tasks inline (outside the manager's state lock).
        """
        if self._eager:
            self.dispatch([t for tid in tids if (t := self._tasks.get(tid)) is not None and not t.is_terminal])
            return
        with self._wake:
            for tid in tids:
                task = self._tasks.get(tid)
                if task is None:
                    continue
                if task.try_transition(TaskState.QUEUED):
                    self._queue_hi.appendleft(tid)
                elif task.state is TaskState.QUEUED and tid in self._queue_lo:
                    self._queue_lo.remove(tid)
                    self._queue_hi.appendleft(tid)
            self._wake.notify_all()

    def join(self, tids: list[Tid]) -> None:
        """Wait until each task's pool write is over. Raises if one failed
        or does not finish within ``staging_claim_timeout_s``."""
        self._wait_tasks(tids, "done")

    def join_host_ready(self, tids: list[Tid]) -> None:
        """Wait until each task's host rows exist (not the pool write)."""
        self._wait_tasks(tids, "host_ready")

    def _wait_tasks(self, tids: list[Tid], event: Literal["done", "host_ready"]) -> None:
        timeout = self._config.staging_claim_timeout_s
        deadline = time.monotonic() + timeout
        for tid in tids:
            task = self._tasks.get(tid)
            if task is None:
                continue  # drained: already written
            if self._committer_mode == "on_demand" and not self._eager:
                self._step_until(task, event, deadline)
            if not getattr(task, event).wait(max(0.0, deadline - time.monotonic())):
                raise OmniPrefixCacheUnmatchError(
                    f"task {tid} ({task.schedule.value}) did not reach {event} within {timeout:g}s "
                    f"(state={task.state.name}, in_flight_tasks={len(self._tasks)})"
                )
            if task.state is TaskState.FAILED:
                # FAILED sets both events; the one-shot failure record may
                # already be drained elsewhere, so raise here too.
                cause = self.failure_of(tid)
                if cause is None and self._shutdown:
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

    def _step_until(self, task: WriteTask, event: Literal["done", "host_ready"], deadline: float) -> None:
        """on_demand joins: run committer steps on this thread until the event
        fires. An idle step does not mean the task is stuck: another joiner may
        be mid-copy of it (claimed, not yet queued for its write), so look
        again after a short wait instead of waiting out the whole timeout."""
        done = getattr(task, event)
        with torch.inference_mode():
            while not done.is_set():
                if self.committer_step() is not None:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                done.wait(min(_ON_DEMAND_RECHECK_S, remaining))

    def drain_completed(self) -> list[Tid]:
        """Pop pool-written tids and forget their tasks (manager, under its lock)."""
        with self._lock:
            out = list(self._completed)
            self._completed.clear()
            for tid in out:
                self._tasks.pop(tid, None)
        return out

    def drain_failed(self) -> list[Tid]:
        """Pop failed tids (one-shot). Their tasks stay registered."""
        with self._lock:
            out = list(self._failed)
            self._failed.clear()
        return out

    def get_task(self, tid: Tid) -> WriteTask | None:
        return self._tasks.get(tid)

    def shutdown(self) -> None:
        """Stop. Queued work is written first (threaded: the worker drains
        the queues; manual: drained here); tasks still unfinished after that
        (pending deferred writes, a stuck copy) fail so no joiner hangs.
        Waiting claims are woken and raise."""
        self._staging_pool.close()
        with self._wake:
            self._shutdown = True
            self._wake.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
        elif not self._eager:
            while self.committer_step() is not None:
                pass
        for task in list(self._tasks.values()):
            if not task.is_terminal:
                self._fail_task(task.tid)

    # ------------------------------------------------------------ reads

    @torch.inference_mode()
    def fetch_host(self, task: WriteTask, slots: torch.Tensor, key: TensorName) -> torch.Tensor:
        """Rows of ``slots`` for ``key`` from a task not yet in the pool:
        its host rows once copied, else its device clone (read on the read
        lane). Waits the staging event first. Caller order is preserved.
        Raises OmniPrefixCacheUnmatchError naming the task, key and slot
        when the task holds no row for a slot."""
        if task.step_d2h_event is not None:
            task.step_d2h_event.synchronize()
        return self._rows_from(task, slots, key)

    def _rows_from(self, task: WriteTask, slots: torch.Tensor, key: TensorName) -> torch.Tensor:
        s2r = task.slot_to_row()
        per_chunk: dict[int, tuple[list[int], list[int]]] = {}
        for pos, slot in enumerate(slots.tolist()):
            where = s2r.get(slot)
            if where is None:
                raise OmniPrefixCacheUnmatchError(f"task {task.tid} (req {task.req_id}) has no row for slot {slot}")
            positions, rows = per_chunk.setdefault(where[0], ([], []))
            positions.append(pos)
            rows.append(where[1])
        out: torch.Tensor | None = None
        for si, (positions, rows) in per_chunk.items():
            src = task.get_host_tensor(si, key)
            if src is None:
                raise OmniPrefixCacheUnmatchError(
                    f"task {task.tid} (req {task.req_id}) has no {key!r} rows for slots {slots.tolist()}"
                )
            picked = self._pick_rows(task, src, rows)
            if len(per_chunk) == 1:
                return picked
            if out is None:
                out = torch.empty((slots.numel(), *picked.shape[1:]), dtype=picked.dtype)
            out.index_copy_(0, torch.tensor(positions, dtype=torch.int64), picked)
        if out is None:
            raise OmniPrefixCacheUnmatchError(f"task {task.tid}: no slots requested for {key!r}")
        return out

    def _pick_rows(self, task: WriteTask, src: torch.Tensor, rows: list[int]) -> torch.Tensor:
        first, n = rows[0], len(rows)
        if not self._engine.is_device(src):
            if rows[-1] - first == n - 1 and all(b - a == 1 for a, b in zip(rows, rows[1:])):
                return src[first : first + n]
            return src.index_select(0, torch.tensor(rows, dtype=torch.int64))
        # A device clone: each run of consecutive rows is copied straight
        # into its slice of one host tensor on the read lane. No index
        # tensor and no gathered temporary is allocated on the device (it
        # would sit outside gpu_staging_bytes and vLLM's memory profile).
        out = self._engine.host_empty((n, *src.shape[1:]), src.dtype)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        for i in range(1, n + 1):
            if i == n or rows[i] != rows[i - 1] + 1:
                copies.append((out[start:i], src[rows[start] : rows[i - 1] + 1]))
                start = i
        self._engine.read(task.freeze_event, copies)
        return out

    # ------------------------------------------------------------ eager

    def _run_eager(self, task: WriteTask) -> None:
        """Walk one task's whole chain inline (eager dispatch)."""
        task.try_transition(TaskState.QUEUED)  # no-op when register already queued it
        if not task.claim_copy():
            # Copy stage already ran elsewhere: finish the write if it can be.
            if task.state is TaskState.HOST_READY:
                self._scatter(task)
            return
        self._copy_task(task)
        self._scatter(task)

    # ------------------------------------------------------------ committer

    def committer_claim(self) -> Tid | None:
        """Pop the next queued task (high first) and claim its copy stage
        (QUEUED -> COPYING) in the same critical section escalate uses.
        Skips stale queue entries (failed or drained tasks). Returns the
        claimed tid, or None when the queues are empty."""
        with self._wake:
            while self._queue_hi or self._queue_lo:
                tid = (self._queue_hi or self._queue_lo).popleft()
                task = self._tasks.get(tid)
                if task is not None and task.claim_copy():
                    self._claimed.append(tid)
                    return tid
        return None

    def committer_copy(self) -> Tid | None:
        """Run the copy stage of the oldest claimed task (COPYING ->
        HOST_READY) and queue it for its pool write. A failure fails only
        that task. Returns its tid, or None when nothing is claimed."""
        with self._wake:
            if not self._claimed:
                return None
            tid = self._claimed.popleft()
        task = self._tasks.get(tid)
        if task is None:
            return tid
        try:
            self._copy_task(task)
            with self._wake:
                if tid in self._blocked:
                    raise OmniPrefixCacheUnmatchError(f"task {tid} reached HOST_READY twice")
                self._blocked.append(tid)
        except BaseException as exc:
            logger.exception("omni prefix cache: copy failed for task %s (req %s)", tid, task.req_id)
            self._note_cause(task, self.write_error(task, exc, "copy"))
            self._fail_task(tid)
        return tid

    def committer_write(self) -> list[Tid]:
        """Write every HOST_READY task waiting in ``_blocked`` to the pool;
        a failing write fails only its own task. Returns the tids tried."""
        return self._scatter_host_ready()

    def committer_step(self) -> str | None:
        """One unit of committer work on the calling thread: a claimed
        task's copy stage first, then pending pool writes, else claim and
        copy one task. Returns "copy", "write" or None when idle."""
        if self._claimed:
            self.committer_copy()
            return "copy"
        if self._scatter_host_ready():
            return "write"
        if self.committer_claim() is not None:
            self.committer_copy()
            return "copy"
        return None

    def _has_work(self) -> bool:
        if self._queue_hi or self._queue_lo or self._claimed:
            return True
        return any((t := self._tasks.get(tid)) is not None and t.state is TaskState.HOST_READY for tid in self._blocked)

    def _worker_loop(self) -> None:
        # A dead committer would strand every join, so nothing escapes this
        # loop: each unit attributes its own failure to its own task.
        while True:
            with self._wake:
                while not self._shutdown and not self._has_work():
                    self._wake.wait()
                if self._shutdown and not self._has_work():
                    return
            try:
                with torch.inference_mode():
                    self.committer_step()
            except BaseException:  # pragma: no cover - committer_step already attributes failures
                logger.exception("omni prefix cache committer step failed")

    def _copy_task(self, task: WriteTask) -> None:
        """COPYING -> HOST_READY, then unpin the task's device budget.

        JOIN_NEXT_STEP: host rows are staging views copied at save; only
        wait that copy's event. JOIN_ON_FINISH: one owned host tensor per
        key; each chunk's clone is copied (in ``copy_chunk_bytes`` pieces)
        straight into its own slice, which becomes the chunk's host rows.
        No device-side concatenation: nothing is allocated on the copy lane.
        """
        if task.schedule is WriteSchedule.JOIN_NEXT_STEP:
            task.mark_host_ready()
            self._release_staged_bytes(task)
            return
        by_key: dict[TensorName, list[_WriteChunk]] = {}
        for chunk in task.chunks:
            for key in chunk.tensors:
                by_key.setdefault(key, []).append(chunk)
        piece_bytes = self._config.copy_chunk_bytes
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        rows_out: list[tuple[_WriteChunk, TensorName, torch.Tensor]] = []
        for key, chunks in by_key.items():
            srcs = [c.tensors[key] for c in chunks]
            total = sum(int(src.shape[0]) for src in srcs)
            host = self._engine.host_empty((total, *srcs[0].shape[1:]), srcs[0].dtype)
            offset = 0
            for chunk, src in zip(chunks, srcs):
                rows = int(src.shape[0])
                row_bytes = max(1, src[:1].numel() * src.element_size())
                step = max(1, rows if rows * row_bytes <= piece_bytes else piece_bytes // row_bytes)
                for s in range(0, rows, step):
                    end = min(rows, s + step)
                    copies.append((host[offset + s : offset + end], src[s:end]))
                rows_out.append((chunk, key, host[offset : offset + rows]))
                offset += rows
        event = self._engine.launch(task.freeze_event, copies)
        if event is not None:
            event.synchronize()
        task.set_host_tensor(rows_out)
        self._release_staged_bytes(task)

    def _fail_task(self, tid: Tid | None) -> None:
        """-> FAILED and release everything the task holds. No-op once the
        task is terminal (so budget is never uncharged twice).

        Order matters: the failure record is published before the wake
        effects run, so a woken joiner finds it on its next drain.
        """
        if tid is None:
            return
        task = self._tasks.get(tid)
        if task is None or not task.mark_failed(defer_wake=True):
            return
        self._release_staged_bytes(task)
        with self._wake:
            if tid in self._blocked:
                self._blocked.remove(tid)
            if tid in self._claimed:
                self._claimed.remove(tid)
        self._release_task_slot(task, "fail")
        with self._lock:
            self._failed.append(task.tid)
        task.wake_failed_waiters()

    def _scatter_host_ready(self) -> list[Tid]:
        """HOST_READY -> WRITTEN for each ``_blocked`` task that is HOST_READY."""
        with self._wake:
            ready = [tid for tid in self._blocked if (t := self._tasks.get(tid)) and t.state is TaskState.HOST_READY]
            for tid in ready:
                self._blocked.remove(tid)
        for tid in ready:
            task = self._tasks[tid]
            try:
                self._scatter(task)
            except BaseException as exc:
                # This task's failure only: letting it escape would fail
                # whatever the loop touches next and strand this task's join.
                logger.exception("omni prefix cache: pool write failed for task %s", tid)
                self._note_cause(task, self.write_error(task, exc, "pool write"))
                self._fail_task(tid)
        return ready

    def _scatter(self, task: WriteTask) -> None:
        """Write the task's rows to the pool, then complete it. Inside an
        eager dispatch the rows join the batch and complete at its flush."""
        rows = task.scatter_rows()
        batch: _PoolWriteBatch | None = getattr(self._batch, "open", None)
        if batch is not None:
            batch.tasks.append(task)
            batch.rows.append(rows)
            return
        for key, slots, host in rows:
            self._pool.write(key, slots, host)
        self._complete(task)

    def _complete(self, task: WriteTask) -> None:
        self._complete_many([task])

    def _flush_batch(self, batch: _PoolWriteBatch, *, reraise: bool) -> None:
        """Write a batch once per key where no slot repeats across tasks;
        otherwise (or if a merged write fails) write task by task, so a
        failure is attributed to exactly the task whose rows failed."""
        if not batch.tasks:
            return
        written_merged = True
        if len(batch.tasks) > 1:
            per_key: dict[TensorName, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for rows in batch.rows:
                for key, slots, host in rows:
                    per_key.setdefault(key, []).append((slots, host))
            try:
                for key, parts in per_key.items():
                    if len(parts) == 1:
                        self._pool.write(key, *parts[0])
                        continue
                    slots = _joined([p[0] for p in parts])
                    if len(set(slots.tolist())) != slots.numel():
                        written_merged = False
                        break
                    self._pool.write(key, slots, _joined([p[1] for p in parts]))
            except Exception:
                written_merged = False
        else:
            written_merged = False
        first_error: BaseException | None = None
        written: list[WriteTask] = []
        for task, rows in zip(batch.tasks, batch.rows):
            row_key: TensorName | None = None
            row_slots: torch.Tensor | None = None
            try:
                if not written_merged:
                    for row_key, row_slots, host in rows:
                        self._pool.write(row_key, row_slots, host)
                written.append(task)
            except BaseException as exc:
                logger.exception("omni prefix cache: pool write failed for task %s", task.tid)
                error = self.write_error(task, exc, "pool write", row_key, row_slots)
                self._note_cause(task, error)
                self._fail_task(task.tid)
                first_error = first_error or error
        self._complete_many(written)
        if first_error is not None and reraise:
            raise first_error

    def _complete_many(self, tasks: list[WriteTask]) -> None:
        """Complete written tasks: release their staging holds, publish
        their completion records, then set each ``done``. `done` comes
        last: a joiner (the save barrier) must find the record on its next
        drain and the page free; a done-but-unpublished window would leave
        occupancy IN_TRANSIT and make the copy-on-write preserve skip reused
        rows. One staging lock and one record lock for the whole batch."""
        if not tasks:
            return
        holds = [(t.staging_slot, StagingBufferHolder.for_task(t.tid)) for t in tasks if t.staging_slot is not None]
        if holds:
            self._staging_pool.release_many(holds, "written")
        with self._lock:
            self._completed.extend(t.tid for t in tasks)
        for task in tasks:
            task.mark_done()

    # ------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        """A snapshot for operators: tasks by state, queue depths, staged
        bytes, staging holders by kind, pending completion/failure records."""
        with self._lock:
            by_state = Counter(t.state.name for t in self._tasks.values())
            out: dict[str, Any] = {
                "tasks_by_state": {s.name: by_state.get(s.name, 0) for s in TaskState},
                "queue_hi": len(self._queue_hi),
                "queue_lo": len(self._queue_lo),
                "claimed": len(self._claimed),
                "blocked": len(self._blocked),
                "completed_undrained": len(self._completed),
                "failed_undrained": len(self._failed),
                "staged_bytes": self._staged_bytes,
                "budget_flushes": self._budget_flushes,
            }
        out["staging_host_bytes"] = self._staging_pool.host_bytes()
        holders = Counter(h.kind for h in self._staging_pool.holders())
        out["holders"] = {"step": holders.get("step", 0), "task": holders.get("task", 0)}
        out["mode"] = "eager" if self._eager else f"{self._committer_mode}:{self._engine.name}"
        return out
