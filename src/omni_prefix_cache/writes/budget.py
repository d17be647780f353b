"""The GPU-byte budget of device clones (spec/protocol.yaml: effects
``charge_budget``, ``flush_oldest``, ``refund_unpinned``, ``unpin_budget``;
guard ``over_budget``).

A ``BudgetTicket`` is one clone's charge; the writes viewing the clone pin
it, and it uncharges once, when its last write leaves (or, never pinned, at
its refund).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from omni_prefix_cache.interface import Tid
from omni_prefix_cache.writes.chunks import BudgetTicket
from omni_prefix_cache.writes.write_task import WriteTask

logger = logging.getLogger(__name__)


class GpuBudget:
    """The staged-bytes counter against ``limit``; ``lock`` is the
    controller's (reentrant) lock, which covers the counter."""

    def __init__(self, limit: int, lock: Any):
        self.limit = limit
        self._lock: threading.RLock = lock
        self.staged_bytes = 0
        self.flushes = 0

    def pin(self, ticket: BudgetTicket, tid: Tid) -> None:
        """Record that ``tid`` views the clone ``ticket`` charges."""
        with self._lock:
            ticket.tids.add(tid)

    def exceeded_by(self, nbytes: int) -> bool:
        """True if charging ``nbytes`` would exceed the limit."""
        with self._lock:
            return self.staged_bytes + nbytes > self.limit

    def over(self, nbytes: int, unfinished: Iterable[WriteTask]) -> WriteTask | None:
        """The oldest unfinished task to flush when charging ``nbytes`` would
        exceed the limit (counted as a flush), else None."""
        with self._lock:
            if self.staged_bytes + nbytes <= self.limit:
                return None
            oldest = min(unfinished, key=lambda t: t.enqueued_time, default=None)
            if oldest is not None:
                self.flushes += 1
            return oldest

    def flush(
        self,
        nbytes: int,
        unfinished: Callable[[], list[WriteTask]],
        escalate: Callable[[list[Tid]], None],
        join: Callable[[list[Tid]], None],
    ) -> None:
        """Effect ``flush_oldest``: escalate and join the oldest unfinished
        task until charging ``nbytes`` fits or no task is unfinished."""
        while (oldest := self.over(nbytes, unfinished())) is not None:
            # DEBUG: a small budget flushes every few steps; stats() counts them (budget_flushes_total).
            logger.debug("omni prefix cache: GPU staging budget full, flushing task %d", oldest.tid)
            escalate([oldest.tid])
            join([oldest.tid])

    def charge(self, nbytes: int) -> None:
        with self._lock:
            self.staged_bytes += nbytes

    def refund_unpinned(self, tickets: Iterable[BudgetTicket]) -> None:
        """Uncharge reservations that no task ever pinned (a save that
        failed, or a clone no request views). A pinned or already freed
        ticket refunds nothing: its last task uncharges it."""
        with self._lock:
            for ticket in tickets:
                if not ticket.tids:
                    self.staged_bytes -= ticket.release(-1)

    def unpin_many(self, tasks: list[WriteTask]) -> None:
        """``unpin`` for each task, under one acquisition."""
        pinned = [(task, tickets) for task in tasks if (tickets := task.budget_tickets())]
        if not pinned:
            return
        with self._lock:
            for task, tickets in pinned:
                for ticket in tickets:
                    self.staged_bytes -= ticket.release(task.tid)

    def unpin(self, task: WriteTask) -> None:
        """Unpin ``task`` from its tickets; a ticket uncharges once, when its
        last holder leaves. Idempotent."""
        self.unpin_many([task])
