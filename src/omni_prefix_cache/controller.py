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

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.copy_engine import CopyEngine, default_engine
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
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
        self._staged_bytes = 0
        self._budget_flushes = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue_hi: deque[Tid] = deque()  # JOIN_NEXT_STEP and escalated JOIN_ON_FINISH
        self._queue_lo: deque[Tid] = deque()  # JOIN_ON_FINISH queued without escalation
        self._claimed: deque[Tid] = deque()  # COPYING, claimed, copy stage not yet run
        self._blocked: list[Tid] = []  # copy stage done (HOST_READY), awaiting pool write
        self._shutdown = False
        self._batch = threading.local()
        self._staging_pool = StagingBufferPool(
            config.staging_depth, config.staging_capacity_tokens, pin_memory=self._engine.pin_memory
        )
        self._worker: threading.Thread | None = None
        if not self._eager and committer == "thread":
            self._worker = threading.Thread(target=self._worker_loop, name="omni-prefix-cache-committer", daemon=True)
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

            def copy() -> None:
                for key, src in tensors.items():
                    views[key].copy_(src, non_blocking=src.device.type != "cpu")

            if all(t.device.type == "cpu" for t in tensors.values()):
                copy()
                event = None
            else:
                event = self._engine.launch(freeze_event, copy)
            return StepD2HClaim(staging_slot=page, views=views, event=event)
        except BaseException:
            self._staging_pool.release(page, step_holder, "abandon")
            raise

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
        task of the batch not yet written fails too before the error
        propagates.
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
        try:
            for task in tasks:
                self._run_eager(task)
        except BaseException:
            self._batch.open = outer
            # Tasks written before the failure keep their rows; the rest were
            # registered but will never run, so they fail (releasing budget
            # and staging holds) before the error reaches the caller.
            self._flush_batch(batch, reraise=False)
            for task in tasks:
                self._fail_task(task.tid)
            raise
        self._batch.open = outer
        try:
            self._flush_batch(batch, reraise=True)
        except BaseException:
            for task in tasks:
                self._fail_task(task.tid)
            raise

    def submit(self, task: WriteTask, queued: bool = True) -> None:
        """``register`` + ``dispatch`` (callers not holding the state lock)."""
        self.register(task, queued)
        if queued:
            self.dispatch([task])

    def append_chunk(self, task: WriteTask, chunk: _WriteChunk, freeze_event: Any = None) -> Any:
        """Append to a pending task. None when appended, else the closing state."""
        return task.append_chunk(chunk, freeze_event)

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
                with torch.inference_mode():
                    while not getattr(task, event).is_set() and self.committer_step() is not None:
                        pass
            if not getattr(task, event).wait(max(0.0, deadline - time.monotonic())):
                raise OmniPrefixCacheUnmatchError(
                    f"task {tid} ({task.schedule.value}) did not reach {event} within {timeout:g}s "
                    f"(state={task.state.name}, in_flight_tasks={len(self._tasks)})"
                )
            if task.state is TaskState.FAILED:
                # FAILED sets both events; the one-shot failure record may
                # already be drained elsewhere, so raise here too.
                raise OmniPrefixCacheUnmatchError(f"task {tid} ({task.schedule.value}) write failed before {event}")

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
        contiguous = rows[-1] - first == n - 1 and all(b - a == 1 for a, b in zip(rows, rows[1:]))

        def pick() -> torch.Tensor:
            if contiguous:
                return src[first : first + n]
            return src.index_select(0, torch.tensor(rows, dtype=torch.int64, device=src.device))

        if src.device.type == "cpu":
            return pick()
        return self._engine.read(task.freeze_event, lambda: self._engine.to_host(pick()))

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
        except BaseException:
            logger.exception("omni prefix cache: copy failed for task %s (req %s)", tid, task.req_id)
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
        wait that copy's event. JOIN_ON_FINISH: one device cat and one
        device-to-host per key (in ``copy_chunk_bytes`` pieces), split back
        into per-chunk host views.
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
        landed: list[tuple[TensorName, list[_WriteChunk], list[torch.Tensor]]] = []

        def copy() -> None:
            for key, chunks in by_key.items():
                srcs = [c.tensors[key] for c in chunks]
                src = srcs[0] if len(srcs) == 1 else torch.cat(srcs, dim=0)
                rows = int(src.shape[0])
                row_bytes = max(1, src[:1].numel() * src.element_size())
                step = max(1, rows if rows * row_bytes <= piece_bytes else piece_bytes // row_bytes)
                pieces = [self._engine.to_host(src[s : s + step]) for s in range(0, max(rows, 1), step)]
                landed.append((key, chunks, pieces))

        event = self._engine.launch(task.freeze_event, copy)
        if event is not None:
            event.synchronize()
        rows_out: list[tuple[_WriteChunk, TensorName, torch.Tensor]] = []
        for key, chunks, pieces in landed:
            host = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
            if len(chunks) == 1:
                rows_out.append((chunks[0], key, host))
                continue
            sizes = [int(c.tensors[key].shape[0]) for c in chunks]
            rows_out.extend((c, key, v) for c, v in zip(chunks, torch.split(host, sizes, dim=0)))
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
            try:
                self._scatter(self._tasks[tid])
            except BaseException:
                # This task's failure only: letting it escape would fail
                # whatever the loop touches next and strand this task's join.
                logger.exception("omni prefix cache: pool write failed for task %s", tid)
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
            try:
                if not written_merged:
                    for key, slots, host in rows:
                        self._pool.write(key, slots, host)
                written.append(task)
            except BaseException as exc:
                logger.exception("omni prefix cache: pool write failed for task %s", task.tid)
                self._fail_task(task.tid)
                first_error = first_error or exc
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
        holders = Counter(h.kind for h in self._staging_pool.holders())
        out["holders"] = {"step": holders.get("step", 0), "task": holders.get("task", 0)}
        out["mode"] = "eager" if self._eager else f"{self._committer_mode}:{self._engine.name}"
        return out
