"""Eager dispatch: operation ``eager_run`` (spec/protocol.yaml) for each of
a dispatch's tasks on the calling thread, with the pool written once per key
for the whole dispatch (effect ``pool_write`` joins the open batch)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from omni_prefix_cache.interface import TensorName
from omni_prefix_cache.writes.operations import RuntimeOp
from omni_prefix_cache.writes.write_task import StepRows, WriteTask, step_runs

if TYPE_CHECKING:
    from omni_prefix_cache.controller import OmniPrefixCacheController

logger = logging.getLogger(__name__)


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
    """Pool writes collected while a batch runs (an eager dispatch, one
    committer write pass), flushed once per key; ``errors``: the tasks the
    dispatch's run stopped at, with their exceptions."""

    def __init__(self, op: RuntimeOp, outer: _PoolWriteBatch | None) -> None:
        self.op = op  # the operation whose tail finishes the written tasks
        self.outer = outer  # the batch this one interrupts on the same thread
        self.tasks: list[WriteTask] = []
        self.errors: list[tuple[WriteTask, BaseException]] = []


def _step_window(tasks: list[WriteTask]) -> tuple[StepRows, int, int] | None:
    """``(step, start, end)`` when the tasks are back-to-back untouched
    windows of one step in order (a save's immediate writes, none
    reassigned): their rows are rows ``[start, end)`` of the step's arrays.
    None otherwise."""
    for t in tasks:  # a loop, not any(genexpr): no generator step per task
        if len(t.chunks) != 1 or t.reassigned or not t.chunks[0].whole_step_view():
            return None
    runs = step_runs([t.chunks[0] for t in tasks])
    if len(runs) != 1:
        return None
    step, start, end, _ = runs[0]
    return None if step is None else (step, start, end)


class EagerDispatch:
    """Runs ``eager_run`` for a controller's dispatched tasks as one batch
    (``OpRunner.run_many``), and writes the pool once per key for a whole
    batch of written tasks (per thread; a nested dispatch opens its own)."""

    def __init__(self, ctrl: OmniPrefixCacheController):
        self._ctrl = ctrl
        self._local = threading.local()

    def open_batch(self) -> _PoolWriteBatch | None:
        """The calling thread's open batch (effect ``pool_write`` joins it)."""
        batch: _PoolWriteBatch | None = getattr(self._local, "open", None)
        return batch

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """``eager_run`` for the tasks, batched; if one fails, every task of
        the dispatch not yet written fails too before the error (naming the
        failed task, its cause as ``__cause__``) propagates. Tasks before it
        in dispatch order keep their rows, as if run one by one."""
        ctrl = self._ctrl
        # A task listed twice runs once (its entry move admits it once).
        tasks = list(dict.fromkeys(tasks))
        batch = self.open(ctrl.ops.eager)
        try:
            ctrl._run_eager(tasks)  # through the facade: a test may probe it
        except BaseException as exc:
            # Raised outside any one task's steps (a probe): no task to name.
            self.close(batch)
            self._flush(batch, reraise=False)
            ctrl.fail_tasks(tasks, exc)
            raise
        self.close(batch)
        if batch.errors:
            current, cause = batch.errors[0]
            # Tasks written before the failure keep their rows; the rest
            # fail (releasing budget and staging holds) before the error
            # reaches the caller.
            self._flush(batch, reraise=False)
            error = ctrl.write_error(current, cause, "copy")
            ctrl.fail_tasks(tasks, error)
            raise error
        try:
            self._flush(batch, reraise=True)
        except BaseException as exc:
            ctrl.fail_tasks(tasks, exc)
            raise

    def open(self, op: RuntimeOp) -> _PoolWriteBatch:
        """Open a pool-write batch on this thread (``close`` it in a finally)."""
        batch = _PoolWriteBatch(op, self.open_batch())
        self._local.open = batch
        return batch

    def close(self, batch: _PoolWriteBatch) -> None:
        self._local.open = batch.outer

    def run(self, tasks: WriteTask | list[WriteTask]) -> None:
        """``eager_run`` for the tasks its entry admits, as one batch. Inside
        a dispatch it stops at the pool write (the batch's flush finishes
        the writes) and hands the dispatch the first task that failed; on
        its own it runs to the end and raises that task's exception."""
        ctrl = self._ctrl
        op = ctrl.ops.eager
        items = tasks if isinstance(tasks, list) else [tasks]
        run = ctrl._runner.run_many(op, items, stop=op.tail, truncate=True)
        if run.errors:
            outer = self.open_batch()
            if outer is None:
                raise run.errors[0][1]
            outer.errors.extend(run.errors)

    def add(self, batch: _PoolWriteBatch, tasks: list[WriteTask]) -> None:
        """The tasks' pool writes join ``batch`` (its flush writes them)."""
        batch.tasks.extend(tasks)

    def _write_window(self, step: StepRows, start: int, end: int) -> None:
        """One scatter per key of rows ``[start, end)`` of ``step``."""
        pool = self._ctrl.pool
        whole = start == 0 and end == int(step.slots.shape[0])
        slots = step.slots if whole else step.slots[start:end]
        for key, host in step.host.items():
            pool.write(key, slots, host if whole else host[start:end])

    def _write_merged(self, tasks: list[WriteTask]) -> bool:
        """Write every task's rows at once: a step's windows by ranges of its
        arrays, else one scatter per key where no slot repeats across
        tasks. False (nothing or part written) when the caller must write
        task by task."""
        window = _step_window(tasks)
        if window is not None and window[0].unique_slots():
            self._write_window(*window)
            return True
        pool = self._ctrl.pool
        per_key: dict[TensorName, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for task in tasks:
            for key, slots, host in task.scatter_rows():
                per_key.setdefault(key, []).append((slots, host))
        for key, parts in per_key.items():
            if len(parts) == 1:
                pool.write(key, *parts[0])
                continue
            slots = _joined([p[0] for p in parts])
            if len(set(slots.tolist())) != slots.numel():
                return False
            pool.write(key, slots, _joined([p[1] for p in parts]))
        return True

    def flush(self, batch: _PoolWriteBatch) -> None:
        """Write and finish a closed batch; a failing write fails only the
        tasks whose rows failed (the committer's rule: nothing raises)."""
        self._flush(batch, reraise=False)

    def _flush(self, batch: _PoolWriteBatch, *, reraise: bool) -> None:
        """Write a batch at once where it can (``_write_merged``); otherwise
        (or if a merged write fails) task by task, so a failure is
        attributed to exactly the task whose rows failed. Then the written
        tasks finish their operation (its segments after the pool write)."""
        if not batch.tasks:
            return
        ctrl = self._ctrl
        pool = ctrl.pool
        written_merged = False
        if len(batch.tasks) > 1:
            try:
                written_merged = self._write_merged(batch.tasks)
            except Exception:
                written_merged = False
        if written_merged:
            ctrl.finish_writes(list(batch.tasks), batch.op)
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
                error = ctrl.write_error(task, exc, "pool write", row_key, row_slots)
                ctrl.fail_task(task, error)
                first_error = first_error or error
        ctrl.finish_writes(written, batch.op)
        if first_error is not None and reraise:
            raise first_error
