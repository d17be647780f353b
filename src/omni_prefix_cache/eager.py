"""Eager dispatch: operation ``eager_run`` (spec/protocol.yaml) for each of
a dispatch's tasks on the calling thread, with the pool written once per key
for the whole dispatch (effect ``pool_write`` joins the open batch)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from omni_prefix_cache.interface import TensorName
from omni_prefix_cache.write_task import WriteTask

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
    """Pool writes of one eager dispatch, flushed once per key."""

    def __init__(self) -> None:
        self.tasks: list[WriteTask] = []
        self.rows: list[list[tuple[TensorName, torch.Tensor, torch.Tensor]]] = []


class EagerDispatch:
    """Runs ``eager_run`` for a controller's dispatched tasks, batching the
    pool writes of one dispatch (per thread; a nested dispatch opens its own)."""

    def __init__(self, ctrl: OmniPrefixCacheController):
        self._ctrl = ctrl
        self._local = threading.local()

    def open_batch(self) -> _PoolWriteBatch | None:
        """The calling thread's open batch (effect ``pool_write`` joins it)."""
        batch: _PoolWriteBatch | None = getattr(self._local, "open", None)
        return batch

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """``eager_run`` for each task; if one fails, every task of the
        dispatch not yet written fails too before the error (naming the
        failed task, its cause as ``__cause__``) propagates."""
        ctrl = self._ctrl
        # A task listed twice runs once (its entry move admits it once).
        tasks = list(dict.fromkeys(tasks))
        outer = self.open_batch()
        batch = _PoolWriteBatch()
        self._local.open = batch
        current: WriteTask | None = None
        try:
            for current in tasks:
                ctrl._run_eager(current)  # through the facade: a test may probe it
        except BaseException as exc:
            self._local.open = outer
            # Tasks written before the failure keep their rows; the rest
            # fail (releasing budget and staging holds) before the error
            # reaches the caller.
            self._flush(batch, reraise=False)
            error = ctrl.write_error(current, exc, "copy") if current is not None else exc
            ctrl.fail_tasks(tasks, error)
            raise error  # noqa: B904 - the cause is set on the error itself
        self._local.open = outer
        try:
            self._flush(batch, reraise=True)
        except BaseException as exc:
            ctrl.fail_tasks(tasks, exc)
            raise

    def run(self, task: WriteTask) -> None:
        """``eager_run`` for ``task`` if its entry admits it. Inside a
        dispatch it stops at its pool write (the batch's flush finishes it);
        on its own it runs to the end."""
        ctrl = self._ctrl
        op = ctrl.ops.eager
        with ctrl.lock:
            if not op.admits(task):
                return
            op.segments[0](task)
        # Up to its pool write, which (outside a dispatch) finishes the write.
        for segment in op.segments[1 : op.tail]:
            segment(task)

    def add(self, batch: _PoolWriteBatch, task: WriteTask) -> None:
        batch.tasks.append(task)
        batch.rows.append(task.scatter_rows())

    def _flush(self, batch: _PoolWriteBatch, *, reraise: bool) -> None:
        """Write a batch once per key where no slot repeats across tasks;
        otherwise (or if a merged write fails) write task by task, so a
        failure is attributed to exactly the task whose rows failed. Then
        the written tasks finish ``eager_run``."""
        if not batch.tasks:
            return
        ctrl = self._ctrl
        pool = ctrl.pool
        written_merged = True
        if len(batch.tasks) > 1:
            per_key: dict[TensorName, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for rows in batch.rows:
                for key, slots, host in rows:
                    per_key.setdefault(key, []).append((slots, host))
            try:
                for key, parts in per_key.items():
                    if len(parts) == 1:
                        pool.write(key, *parts[0])
                        continue
                    slots = _joined([p[0] for p in parts])
                    if len(set(slots.tolist())) != slots.numel():
                        written_merged = False
                        break
                    pool.write(key, slots, _joined([p[1] for p in parts]))
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
                        pool.write(row_key, row_slots, host)
                written.append(task)
            except BaseException as exc:
                logger.exception("omni prefix cache: pool write failed for task %s", task.tid)
                error = ctrl.write_error(task, exc, "pool write", row_key, row_slots)
                ctrl.fail_task(task, error)
                first_error = first_error or error
        ctrl.finish_writes(written, ctrl.ops.eager)
        if first_error is not None and reraise:
            raise first_error
