"""A failed pool write is sticky: the cache stops serving for good.

Once a write behind a published block hash failed (its rows never reached
the CPU block pool) or a device fault lost the writes in flight, a hit on
those hashes would read rows that are not there. So the first such failure
is kept, and every later serving facade entry (new_step_starts,
save_outputs, materialize) raises it again; discard_step and shutdown still
work. The drain operation's ``sticky_failure`` effect (spec/protocol.yaml)
records it; nothing ever clears it.

Threading: ``note_locked`` runs under the manager's state lock (inside the
drain); ``raise_if_failed`` and ``record_fault`` take that lock themselves.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping

from omni_prefix_cache.interface import OmniPrefixCacheWriteFailedError, ReqId, Tid
from omni_prefix_cache.writes.task_registry import TaskRegistry

logger = logging.getLogger(__name__)


class StickyFailure:
    """The first write failure (``error``; None while every write landed).

    ``drain_failures_locked`` drains the committer's failure record into
    ``note_locked`` (the write ledger's drain of failures only), so a check
    sees failures nobody drained yet. ``counters`` are the facade's operator
    counters (``failed_writes``).
    """

    def __init__(
        self,
        registry: TaskRegistry,
        state_lock: threading.Lock,
        counters: Counter[str],
        drain_failures_locked: Callable[[], None],
    ) -> None:
        self._registry = registry
        self._state_lock = state_lock
        self._counters = counters
        self._drain_failures_locked = drain_failures_locked
        self.error: OmniPrefixCacheWriteFailedError | None = None

    def note_locked(self, failed: list[Tid], req_of: Mapping[Tid, tuple[ReqId, ...]]) -> None:
        """The drain found ``failed`` writes (``req_of``: the requests of
        each one the ledger still knew; a step's write holds several). Logs them; the first failure ever
        becomes ``error``, naming the first cause the registry recorded
        (its task, request, keys and slots). State lock held."""
        self._counters["failed_writes"] += len(failed)
        names = [f"task {tid} ({_requests(req_of[tid])})" if tid in req_of else f"task {tid}" for tid in failed]
        causes = [c for tid in failed if (c := self._registry.failure_of(tid)) is not None]
        first = causes[0] if causes else None
        message = (
            f"omni prefix cache write failed: {', '.join(names)}; rows behind published block hashes never "
            "landed, so the cache can no longer serve hits" + (f" (first: {first})" if first is not None else "")
        )
        logger.error("%s", message)
        if self.error is None:
            error = OmniPrefixCacheWriteFailedError(
                message,
                tid=first.tid if first is not None else failed[0],
                req_id=first.req_id if first is not None else req_of.get(failed[0], (None,))[0],
                req_ids=first.req_ids if first is not None else req_of.get(failed[0], ()),
                keys=first.keys if first is not None else (),
                slots=first.slots if first is not None else (),
            )
            error.__cause__ = first.__cause__ if first is not None else None
            self.error = error

    def raise_if_failed(self) -> None:
        """The check at every serving facade entry (takes the state lock):
        drains the failure record, then raises the first write failure
        again (``OmniPrefixCacheWriteFailedError.again``) if there is one.
        With no failure recorded or published it returns without the lock
        (both read lock-free: a failure published meanwhile is raised by the
        next entry, as if it had come a moment later)."""
        if self.error is None and not self._registry.failed:
            return
        with self._state_lock:
            self._drain_failures_locked()
            error = self.error
        if error is not None:
            raise error.again()

    def record_fault(self, error: OmniPrefixCacheWriteFailedError) -> None:
        """A device fault lost every write in flight: sticky like a failed
        pool write, unless a failure is already recorded (takes the state
        lock)."""
        with self._state_lock:
            if self.error is None:
                self.error = error


def _requests(req_ids: tuple[ReqId, ...]) -> str:
    """``req 'a'`` for one request, ``reqs ['a', 'b']`` for a step's write."""
    return f"req {req_ids[0]!r}" if len(req_ids) == 1 else f"reqs {list(req_ids)!r}"
