"""The errors a failed write raises: to the thread whose copy or pool write
failed, and to its joiners."""

from __future__ import annotations

import torch

from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    TensorName,
)
from omni_prefix_cache.writes.write_task import WriteTask


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


def join_error(
    task: WriteTask, event: str, cause: OmniPrefixCacheWriteFailedError | None, shut_down: bool
) -> OmniPrefixCacheUnmatchError:
    """What a joiner of failed ``task`` raises: the shutdown error when the
    task failed with no cause while the cache was shut down, else a
    write-failed error carrying the recorded cause's keys and slots."""
    if cause is None and shut_down:
        return OmniPrefixCacheShutdownError(
            f"task {task.tid} ({task.schedule.value}) failed before {event}: the cache was shut down"
        )
    error = OmniPrefixCacheWriteFailedError(
        f"task {task.tid} ({task.schedule.value}) write failed before {event}"
        + (f": {cause}" if cause is not None else ""),
        tid=task.tid,
        req_id=task.req_id,
        keys=cause.keys if cause is not None else (),
        slots=cause.slots if cause is not None else (),
    )
    error.__cause__ = cause.__cause__ if cause is not None else None
    return error
