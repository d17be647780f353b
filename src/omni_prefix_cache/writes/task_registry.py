"""The controller's registered writes and their records: the registry
(effect ``register_task``), the completion and failure records (effects
``publish_completed`` / ``publish_failed``) the manager drains, and the
failure records (one per failure cause) failed writes are raised with."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from omni_prefix_cache.interface import OmniPrefixCacheWriteFailedError, Tid
from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.writes.write_errors import FailureRecord, FailureRecords
from omni_prefix_cache.writes.write_task import WriteTask


class TaskRegistry:
    """Registered tasks (until the manager drains their completion), the
    undrained completion and failure records, and failure causes.

    ``lock`` is the controller's (reentrant) lock; it covers every table.
    Effects run with it held; the other methods take it themselves, except
    the lock-free reads (``tasks``, ``completed``, ``failed``, ``get``:
    a checker between scheduled steps; callers racing the committer use
    ``registered()``).
    Failed tasks stay registered (a joiner still finds them).
    """

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.tasks: dict[Tid, WriteTask] = {}
        self.completed: deque[Tid] = deque()  # pool-written, not yet drained by the manager
        self.failed: deque[Tid] = deque()  # failed; the manager raises from every later entry
        # Why tasks failed, for the error their joiners and the manager
        # raise: one record per failure cause (not per task).
        self._causes = FailureRecords()

    def __len__(self) -> int:
        return len(self.tasks)

    # ------------------------------------------------------------ effects (lock held)

    def register(self, tasks: Iterable[WriteTask], queued: bool) -> None:
        """Effect ``register_task``: the tasks join the registry, stamped for
        the budget flush's oldest-first order (``queued``: registered to be
        queued at their dispatch)."""
        now, registry = time.monotonic(), self.tasks
        for task in tasks:
            task.enqueued_time = now
            task.queued_at_submit = queued
            registry[task.tid] = task

    def publish_completed(self, task: WriteTask) -> None:
        """Effect ``publish_completed``."""
        self.completed.append(task.tid)

    def publish_completed_batch(self, batch: Batch) -> None:
        """Effect ``publish_completed`` for a batch of tasks."""
        self.completed.extend([task.tid for task in batch.items])

    def publish_failed(self, task: WriteTask) -> None:
        """Effect ``publish_failed``."""
        self.failed.append(task.tid)

    # ------------------------------------------------------------ the drain's records (effect take_records)

    def take_completed(self) -> list[Tid]:
        """Pop the pool-written tids and forget their tasks (effect
        ``take_records`` of the ledger's drain, under the manager's state
        lock; takes ``lock``)."""
        with self.lock:
            completed = self.completed
            if not completed:
                return []
            out = list(completed)
            completed.clear()
            forget = self.tasks.pop
            for tid in out:
                forget(tid, None)
        return out

    def take_failed(self) -> list[Tid]:
        """Pop the failed tids (one-shot; takes ``lock``). Their tasks stay
        registered (a joiner still finds them)."""
        with self.lock:
            failed = self.failed
            if not failed:
                return []
            out = list(failed)
            failed.clear()
        return out

    # ------------------------------------------------------------ reads

    def get(self, tid: Tid) -> WriteTask | None:
        return self.tasks.get(tid)

    def registered(self) -> list[WriteTask]:
        """Every registered task (not yet drained)."""
        with self.lock:
            return list(self.tasks.values())

    def unfinished(self) -> list[WriteTask]:
        """Registered tasks not yet terminal."""
        with self.lock:
            return [t for t in self.tasks.values() if not t.is_terminal]

    def any_unfinished(self) -> bool:
        with self.lock:
            return any(not t.is_terminal for t in self.tasks.values())

    # ------------------------------------------------------------ causes

    def record_cause(self, task: WriteTask, error: BaseException | None) -> None:
        """Record that ``error`` fails ``task``, where it is a write-failed
        error and the task is not terminal yet (a task keeps its first)."""
        if isinstance(error, OmniPrefixCacheWriteFailedError) and not task.is_terminal:
            with self.lock:
                self._causes.add(task.tid, error)

    def failure_of(self, tid: Tid) -> OmniPrefixCacheWriteFailedError | None:
        """The error of the failure record naming a failed task: the first
        write-failed error its cause made, which names the first task that
        cause failed (None if the task failed without a write-failed error:
        a shutdown, a save refused by a library error)."""
        with self.lock:
            return self._causes.of(tid)

    def failures(self) -> list[FailureRecord]:
        """The failure records (copies), one per failure cause, each naming
        the tasks it failed; kept until shutdown."""
        with self.lock:
            return self._causes.records()
