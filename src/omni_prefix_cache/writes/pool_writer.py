"""The pool writer: effect ``pool_write`` (spec/protocol.yaml), batched.

A batch of pool writes is opened per thread by whoever writes many tasks at
once (the committer's write pass, an eager dispatch); while it is open, a
task's pool write joins it, and ``land`` writes the whole batch into the
CPU block pool once per key, then finishes its tasks (the operation's
segments after its pool write). Outside a batch a task's rows are written
and finished at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.interface import TensorName
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.specs.composition import CompiledOperation
from omni_prefix_cache.specs.runner import SegmentRunner
from omni_prefix_cache.writes.chunks import StepRows, step_runs
from omni_prefix_cache.writes.mode import WriteMode
from omni_prefix_cache.writes.operations import ControllerOps
from omni_prefix_cache.writes.write_errors import write_error
from omni_prefix_cache.writes.write_task import WriteTask

logger = logging.getLogger(__name__)

# Operation ``fail`` for a task, with its cause (the controller's fail_task).
FailTask = Callable[[WriteTask, BaseException | None], object]


class PoolWriteStage(Protocol):
    """What effect ``pool_write`` calls: ``PoolWriter``, or a stage wrapping
    it (a harness's fault-injecting fake)."""

    def write(self, task: WriteTask) -> None:
        """Effect ``pool_write`` for one task."""
        ...

    def write_batch(self, batch: Batch) -> None:
        """Effect ``pool_write`` for a batch; an item that raises leaves it."""
        ...


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
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


class PoolWriteBatch:
    """Pool writes collected while a batch runs (an eager dispatch, one
    committer write pass), landed once per key; ``errors``: the tasks the
    dispatch's run stopped at, with their exceptions."""

    def __init__(self, op: CompiledOperation, outer: PoolWriteBatch | None) -> None:
        self.op = op  # the operation whose segments after the pool write finish the written tasks
        self.outer = outer  # the batch this one interrupts on the same thread
        self.tasks: list[WriteTask] = []
        self.errors: list[tuple[WriteTask, BaseException]] = []


def step_window(tasks: list[WriteTask]) -> tuple[StepRows, int, int] | None:
    """``(step, start, end)`` when the tasks are back-to-back untouched
    windows of one step in order (a save's immediate writes, none taken
    over): their rows are rows ``[start, end)`` of the step's arrays.
    None otherwise."""
    for t in tasks:  # a loop, not any(genexpr): no generator step per task
        if len(t.chunks) != 1 or t.taken_over or not t.chunks[0].whole_step_view():
            return None
    runs = step_runs([t.chunks[0] for t in tasks])
    if len(runs) != 1:
        return None
    step, start, end, _ = runs[0]
    return None if step is None else (step, start, end)


class PoolWriter:
    """Writes tasks' rows into ``pool``, once per key for a whole batch (per
    thread; a nested batch interrupts the outer one), and finishes them
    through ``runner``. A task whose rows fail to write goes to ``fail``
    with a write-failed error naming its rows; one the state no longer lets
    finish (it failed meanwhile) goes to ``fail`` with no cause.

    ``mode`` picks the operation that finishes a task written outside any
    batch (``ControllerOps.pool_write_op``). Any thread; no lock held
    across a pool write.
    """

    def __init__(
        self, pool: PrefixBlockPool, runner: SegmentRunner, ops: ControllerOps, mode: WriteMode, fail: FailTask
    ):
        self._pool = pool
        self._runner = runner
        self._ops = ops
        self._mode = mode
        self._fail = fail
        self._local = threading.local()

    # ------------------------------------------------------------ batches

    def open_batch(self) -> PoolWriteBatch | None:
        """The calling thread's open batch (effect ``pool_write`` joins it)."""
        batch: PoolWriteBatch | None = getattr(self._local, "open", None)
        return batch

    def open(self, op: CompiledOperation) -> PoolWriteBatch:
        """Open a pool-write batch on this thread (``close`` it in a finally)."""
        batch = PoolWriteBatch(op, self.open_batch())
        self._local.open = batch
        return batch

    def close(self, batch: PoolWriteBatch) -> None:
        self._local.open = batch.outer

    # ------------------------------------------------------------ effect pool_write

    def write(self, task: WriteTask) -> None:
        """Effect ``pool_write``, then the rest of the task's write
        operation: release its hold, publish its record, done. Inside an
        open batch the task joins it instead; the batch's ``land``
        finishes it."""
        batch = self.open_batch()
        if batch is not None:
            batch.tasks.append(task)
            return
        pool = self._pool
        for key, slots, host in task.scatter_rows():
            pool.write(key, slots, host)
        self.finish([task], self._ops.pool_write_op(self._mode.eager))

    def write_batch(self, batch: Batch) -> None:
        """Effect ``pool_write`` for a batch: the tasks join the open batch
        at once; with none open, ``write`` per task, a task that raises
        leaving the batch."""
        open_batch = self.open_batch()
        if open_batch is not None:
            open_batch.tasks.extend(batch.items)
            return
        guarded_each(batch, self.write)

    def finish(self, tasks: list[WriteTask], op: CompiledOperation) -> None:
        """The segments of ``op`` from ``publish`` on (the ones after its
        pool write), batched, for tasks whose rows are in the pool. A task
        whose move the state no longer allows (it failed meanwhile) is
        logged and fails with no cause."""
        if not tasks:
            return
        batch = self._runner.run_batch(op, tasks, start="publish")
        for task, exc in batch.errors:
            logger.error("omni prefix cache: finishing the write of task %s: %s", task.tid, exc)
            self._fail(task, None)

    # ------------------------------------------------------------ landing a batch

    def land(self, batch: PoolWriteBatch, *, reraise: bool = False) -> None:
        """Write a closed batch and finish its tasks; a failing write fails
        only the tasks whose rows failed. Nothing raises (the committer's
        rule) unless ``reraise``: then the first write failure does, after
        the batch landed (an eager dispatch's rule).

        Written at once where it can (``_write_merged``); otherwise (or if
        a merged write fails) task by task, so a failure is attributed to
        exactly the task whose rows failed. Then the written tasks finish
        their operation (its segments after the pool write)."""
        if not batch.tasks:
            return
        pool = self._pool
        written_merged = False
        if len(batch.tasks) > 1:
            try:
                written_merged = self._write_merged(batch.tasks)
            except Exception:
                written_merged = False
        if written_merged:
            self.finish(list(batch.tasks), batch.op)
            return
        first_error: BaseException | None = None
        written: list[WriteTask] = []
        for task in batch.tasks:
            row_key: TensorName | None = None
            row_slots: torch.Tensor | None = None
            try:
                for row_key, row_slots, host in task.scatter_rows():
                    pool.write(row_key, row_slots, host)
                written.append(task)
            except BaseException as exc:
                logger.exception("omni prefix cache: pool write failed for task %s", task.tid)
                error = write_error(task, exc, "pool write", row_key, row_slots)
                self._fail(task, error)
                first_error = first_error or error
        self.finish(written, batch.op)
        if first_error is not None and reraise:
            raise first_error

    def _write_window(self, step: StepRows, start: int, end: int) -> None:
        """One scatter per key of rows ``[start, end)`` of ``step``."""
        pool = self._pool
        whole = start == 0 and end == int(step.slots.shape[0])
        slots = step.slots if whole else step.slots[start:end]
        for key, host in step.host.items():
            pool.write(key, slots, host if whole else host[start:end])

    def _write_merged(self, tasks: list[WriteTask]) -> bool:
        """Write every task's rows at once: a step's windows by ranges of its
        arrays, else one scatter per key where no slot repeats across
        tasks. False (nothing or part written) when the caller must write
        task by task."""
        window = step_window(tasks)
        if window is not None and window[0].unique_slots():
            self._write_window(*window)
            return True
        pool = self._pool
        per_key: dict[TensorName, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for task in tasks:
            for key, slots, host in task.scatter_rows():
                per_key.setdefault(key, []).append((slots, host))
        for key, parts in per_key.items():
            if len(parts) == 1:
                pool.write(key, *parts[0])
                continue
            slots = joined([p[0] for p in parts])
            if len(set(slots.tolist())) != slots.numel():
                return False
            pool.write(key, slots, joined([p[1] for p in parts]))
        return True
