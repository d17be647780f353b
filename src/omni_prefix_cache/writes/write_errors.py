"""The errors a failed write raises: to the thread whose copy or pool write
failed, and to its joiners."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    TensorName,
    Tid,
)
from omni_prefix_cache.writes.write_task import WriteTask


@dataclass(eq=False, slots=True)
class FailureRecord:
    """One failure cause: the first write-failed error it made (naming its
    first task, the cause as ``__cause__``) and every task it failed."""

    error: OmniPrefixCacheWriteFailedError
    tids: set[Tid] = field(default_factory=set)


class FailureRecords:
    """Why failed tasks failed, one record per failure cause (the exception
    underneath, ``error.__cause__``, else the error itself), not one per
    task: a fault that fails a whole batch costs one record and a tid each.
    Not thread-safe: the controller lock covers every call."""

    def __init__(self) -> None:
        # Keyed by the cause's id: the record's error keeps the cause alive.
        self._by_cause: dict[int, FailureRecord] = {}

    def add(self, tid: Tid, error: OmniPrefixCacheWriteFailedError) -> None:
        """Record that ``error`` failed ``tid`` (a tid keeps its first record)."""
        if self.of(tid) is not None:
            return
        cause = error.__cause__ if error.__cause__ is not None else error
        record = self._by_cause.get(id(cause))
        if record is None:
            record = self._by_cause[id(cause)] = FailureRecord(error)
        record.tids.add(tid)

    def of(self, tid: Tid) -> OmniPrefixCacheWriteFailedError | None:
        """The error of the record that names ``tid``, if any."""
        for record in self._by_cause.values():
            if tid in record.tids:
                return record.error
        return None

    def records(self) -> list[FailureRecord]:
        """A copy of every record, in the order their causes first failed a task."""
        return [FailureRecord(r.error, set(r.tids)) for r in self._by_cause.values()]

    def __len__(self) -> int:
        return len(self._by_cause)


def write_error(
    task: WriteTask,
    cause: BaseException,
    stage: str,
    key: TensorName | None = None,
    slots: torch.Tensor | None = None,
) -> BaseException:
    """The error to raise for ``task`` failing at ``stage`` (``copy`` or
    ``pool write``): ``cause`` itself when it is already one (or not an
    Exception), else a write-failed error naming the task, request, keys
    and slots (a step's write: every request with its rows and slot
    range), with ``cause`` as its ``__cause__``."""
    if isinstance(cause, OmniPrefixCacheWriteFailedError) or not isinstance(cause, Exception):
        return cause
    keys, listed = _keys_and_slots(task)
    if key is not None:
        keys = (key,)
    if slots is not None:
        listed = tuple(int(x) for x in slots.tolist())
    shown = f"{listed[:16]}" + (f" (+{len(listed) - 16} more)" if len(listed) > 16 else "")
    error = OmniPrefixCacheWriteFailedError(
        f"omni prefix cache write failed: {stage} of task {task.tid} ({task.describe_requests()}, "
        f"{task.schedule.value}) keys {list(keys)} slots {shown}: {cause!r}",
        tid=task.tid,
        req_id=task.req_id,
        req_ids=task.req_ids,
        keys=keys,
        slots=listed,
    )
    error.__cause__ = cause
    return error


def _keys_and_slots(task: WriteTask) -> tuple[tuple[TensorName, ...], tuple[int, ...]]:
    """Every key and slot ``task`` writes, in chunk order."""
    keys = tuple(dict.fromkeys(k for c in task.chunks for k in (*c.host, *c.tensors)))
    parts = [c.slots_cpu for c in task.chunks]
    slots = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
    return keys, tuple(int(x) for x in slots.tolist())


def join_error(
    task: WriteTask, event: str, cause: OmniPrefixCacheWriteFailedError | None, shut_down: bool
) -> OmniPrefixCacheUnmatchError:
    """What a joiner of failed ``task`` raises: the shutdown error when the
    task failed with no cause while the cache was shut down, else a
    write-failed error carrying the recorded cause's keys and slots (the
    task's own when the cause's record names another task it failed)."""
    if cause is None and shut_down:
        return OmniPrefixCacheShutdownError(
            f"task {task.tid} ({task.schedule.value}) failed before {event}: the cache was shut down"
        )
    keys: tuple[TensorName, ...] = ()
    slots: tuple[int, ...] = ()
    if cause is not None:
        keys, slots = (cause.keys, cause.slots) if cause.tid == task.tid else _keys_and_slots(task)
    error = OmniPrefixCacheWriteFailedError(
        f"task {task.tid} ({task.describe_requests()}, {task.schedule.value}) write failed before {event}"
        + (f": {cause}" if cause is not None else ""),
        tid=task.tid,
        req_id=task.req_id,
        req_ids=task.req_ids,
        keys=keys,
        slots=slots,
    )
    error.__cause__ = cause.__cause__ if cause is not None else None
    return error
