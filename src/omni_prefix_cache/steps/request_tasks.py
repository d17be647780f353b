"""Per-request write bookkeeping of the write ledger.

``RequestTasks`` keeps, for every request with deferred writes, the tids of
its undrained JOIN_ON_FINISH writes, its open one and how many it has
opened (a step's JOIN_NEXT_STEP write is one task for all of its requests
and is kept per step, not here); ``TaskRecord`` is what the ledger
remembers about one write until it is drained. Every table is bounded by the working set (live requests and
undrained writes), never by the requests ever seen.

Threading: no lock of its own; the ledger calls it under the manager's state
lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_prefix_cache.controller import WriteTask
from omni_prefix_cache.interface import ReqId, TensorName, Tid
from omni_prefix_cache.writes.chunks import WriteChunk


@dataclass(eq=False)
class TaskRecord:
    """What the ledger must remember about a write until it is drained:
    the task, whose it is (None: a step's write, its requests on the
    task), and which (keys, slots) it maps."""

    task: WriteTask
    req_id: ReqId | None
    parts: list[tuple[tuple[TensorName, ...], WriteChunk]]


class RequestTasks:
    """Per-request write bookkeeping (under the state lock).

    ``tasks[req]``: tids of the request's undrained deferred writes, in
    opening order. ``deferred[req]``: its open JOIN_ON_FINISH write (chunks
    append to it). ``opened[req]``: how many deferred writes the request
    has opened (``write_n``).
    An entry lives while the request is live or has undrained writes
    (``drop_if_idle``), so every table is bounded by the working set, not
    by the requests ever seen.
    """

    def __init__(self) -> None:
        self.tasks: dict[ReqId, dict[Tid, None]] = {}
        self.deferred: dict[ReqId, WriteTask] = {}
        self.opened: dict[ReqId, int] = {}

    def open(self, req_id: ReqId, tid: Tid) -> int:
        """Record a new write of ``req_id``; returns its ``write_n``."""
        return self.open_many([req_id], [tid])[0]

    def open_many(self, req_ids: list[ReqId], tids: list[Tid]) -> list[int]:
        """``open`` for each ``(req_ids[i], tids[i])`` in order (a step's
        writes); returns their ``write_n``s."""
        opened, tasks = self.opened, self.tasks
        write_ns: list[int] = []
        for rid, tid in zip(req_ids, tids, strict=True):
            n = opened.get(rid, 0) + 1
            opened[rid] = n
            # Not setdefault: it would build a dict per call to throw away.
            mine = tasks.get(rid)
            if mine is None:
                tasks[rid] = {tid: None}
            else:
                mine[tid] = None
            write_ns.append(n)
        return write_ns

    def forget_drained(self, drained: list[TaskRecord], live: set[ReqId]) -> None:
        """The writes were drained (written or failed): forget each, in
        order, and drop its request once idle if it is not in ``live``."""
        tasks, deferred = self.tasks, self.deferred
        for rec in drained:
            rid, task = rec.req_id, rec.task
            if rid is None:  # a step's write: nothing kept per request
                continue
            tids = tasks.get(rid)
            if tids is not None:
                tids.pop(task.tid, None)
                if not tids:
                    del tasks[rid]
            if deferred and deferred.get(rid) is task:
                del deferred[rid]
            if rid not in live:
                self.drop_if_idle(rid)

    def drop_if_idle(self, req_id: ReqId) -> None:
        """Forget ``req_id`` (no longer live) once it has no undrained write;
        a later request reusing the id counts its writes from 1 again."""
        if req_id not in self.tasks:
            self.opened.pop(req_id, None)
            self.deferred.pop(req_id, None)
