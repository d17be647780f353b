"""A lock whose blocking acquisitions are timed into ``wait_seconds``.

Only a contended acquisition reads the clock: the first, non-blocking try
either takes the lock at once (no wait to report) or the caller is about to
block anyway. The wrapped lock's semantics are unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

from omni_prefix_cache.telemetry.registry import TELEMETRY


class TimedLock:
    """``lock`` (a ``threading.Lock``) with its waits reported as
    ``wait_seconds{wait=label}`` while metrics are on. Any thread."""

    __slots__ = ("_lock", "label")

    def __init__(self, lock: Any, label: str) -> None:
        self._lock = lock
        self.label = label

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``; a blocking wait is timed. Any thread."""
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        return self._wait(timeout)

    def _wait(self, timeout: float) -> bool:
        dp = TELEMETRY.datapath
        if dp is None:
            return bool(self._lock.acquire(True, timeout))
        start = TELEMETRY.clock()
        got = bool(self._lock.acquire(True, timeout))
        dp.waited(self.label, start, TELEMETRY.clock())
        return got

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return bool(self._lock.locked())

    def __enter__(self) -> bool:
        # The uncontended try inline, not through ``acquire``: a ``with``
        # runs two Python frames (enter, exit) on top of the lock's own.
        return True if self._lock.acquire(False) else self._wait(-1)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._lock.release()


def timed_lock(lock: Any, label: str) -> Any:
    """``lock`` timed while metrics are on, else ``lock`` itself. A lock
    from the interleaving explorer's seam is left as it is: its extra
    non-blocking try would be a scheduling point the explorer counts."""
    if TELEMETRY.enabled and type(lock) is type(threading.Lock()):
        return TimedLock(lock, label)
    return lock
