"""The write ledger: every write the manager opened, per request, until drained.

``WriteLedger`` registers a save's writes with the controller (one
JOIN_NEXT_STEP write per request viewing the staging page; deferred chunks
appended to the request's open JOIN_ON_FINISH write or a new one), makes the
step the tenant of its slots, and settles drained writes into the slot
occupancy: written rows commit, failed rows drop and the first failure
becomes sticky. It also keeps the save barrier: the previous step's
JOIN_NEXT_STEP writes, joined before a save may reuse their slots.

Threading: methods named ``*_locked`` and the occupancy hook expect the
manager's state lock held (``take_tenancy_locked`` the reads lock too);
``raise_if_failed`` and ``record_fault`` take the state lock themselves;
``join_previous_step`` runs on the engine thread outside it (a join waits on
the committer, which may need the lock).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_prefix_cache.controller import OmniPrefixCacheController, StagingBufferHolder, StepD2HClaim, WriteTask
from omni_prefix_cache.device.index_tensors import per_row_ids
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    ReqId,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
)
from omni_prefix_cache.specs.composition import compile_operation
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.steps.occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_layout import StepOutputs
from omni_prefix_cache.writes.chunks import BudgetTicket, ChunkRuns, StepRows, WriteChunk
from omni_prefix_cache.writes.operations import active_protocol

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TaskRecord:
    """What the ledger must remember about a write until it is drained:
    the task, whose it is, and which (keys, slots) it maps."""

    task: WriteTask
    req_id: ReqId
    parts: list[tuple[tuple[TensorName, ...], WriteChunk]]


class RequestTasks:
    """Per-request write bookkeeping (under the state lock).

    ``tasks[req]``: tids of the request's undrained writes, in opening order.
    ``deferred[req]``: its open JOIN_ON_FINISH write (chunks append to it).
    ``opened[req]``: how many writes the request has opened (``write_n``).
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


@dataclass(eq=False)
class _Drained:
    """One drain's records (the drain operation's context)."""

    completions: bool  # False: a failing save drains the failure record only
    failed: list[Tid] = field(default_factory=list)
    completed: list[Tid] = field(default_factory=list)
    settled: dict[str, list[TaskRecord]] = field(default_factory=dict)


class WriteLedger:
    """Undrained writes (``records`` by tid, ``requests`` per request), the
    save barrier (``previous_step_writes``) and the sticky ``failure``.

    ``live`` is the facade's set of live requests (read only here);
    ``counters`` its operator counters (``rows_committed``, ``failed_writes``).
    """

    def __init__(
        self,
        controller: OmniPrefixCacheController,
        occupancy: SlotOccupancy,
        state_lock: threading.Lock,
        live: set[ReqId],
        counters: Counter[str],
    ) -> None:
        self._controller = controller
        self._occupancy = occupancy
        self._state_lock = state_lock
        self._live = live
        self._counters = counters
        self._tids = itertools.count(1)
        self.records: dict[Tid, TaskRecord] = {}
        self.requests = RequestTasks()
        self.previous_step_writes: list[Tid] = []
        self.failure: OmniPrefixCacheWriteFailedError | None = None  # the first, sticky
        # Operation `drain`, compiled once against this ledger (its only executor).
        self._drain = compile_operation(
            active_protocol().ops["drain"],
            self,
            effects={"take_records": self._take_records, "sticky_failure": self._sticky_failure},
            guards={"failures_drained": lambda ctx: bool(ctx.failed)},
        )

    # ------------------------------------------------------------ requests

    def finish_request_locked(self, rid: ReqId) -> list[Tid]:
        """The request finished or was aborted: close its open deferred write
        and return its writes still to escalate (state lock held)."""
        self.requests.deferred.pop(rid, None)
        escalate: list[Tid] = []
        for tid in self.requests.tasks.get(rid, ()):
            rec = self.records.get(tid)
            if rec is not None and not rec.task.is_terminal:
                escalate.append(tid)
        self.requests.drop_if_idle(rid)
        return escalate

    # ------------------------------------------------------------ save

    def join_previous_step(self) -> None:
        """Save barrier (engine thread, outside the state lock): a slot this
        step may reuse must be pool-complete, so join the previous step's
        JOIN_NEXT_STEP writes. Raises what the join raises."""
        previous = self.previous_step_writes
        if previous:
            self._controller.join(previous)
            self.previous_step_writes = []

    def register_immediate_locked(
        self,
        split: StepOutputs,
        claimed: StepD2HClaim,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        slots: torch.Tensor,
        registered: list[WriteTask],
    ) -> list[WriteTask]:
        """One JOIN_NEXT_STEP task per request, its host rows viewing the
        staging page, bound to the page and queued (not dispatched). Appends
        each task to ``registered`` as soon as the controller may know it."""
        if not split.immediate or not req_order:
            return []
        ctrl = self._controller
        rows = StepRows(
            slots=slots,
            host=claimed.views,
            tensors={k: t for k, t in split.immediate.items() if ctrl.is_device(t)},
        )
        keys = tuple(split.immediate)
        page = claimed.staging_slot
        tasks: list[WriteTask] = []
        records = self.records
        of_step, step_write = WriteChunk.of_step, WriteTask.step_write
        freeze_event, d2h_event = split.freeze_event, claimed.event
        tids = list(itertools.islice(self._tids, len(req_order)))
        write_ns = self.requests.open_many(req_order, tids)
        start = 0
        for rid, tid, write_n in zip(req_order, tids, write_ns):
            end = start + spans[rid][1]
            chunk = of_step(rows, start, end)
            task = step_write(tid, rid, write_n, chunk, freeze_event, page, d2h_event)
            records[tid] = TaskRecord(task, rid, [(keys, chunk)])
            tasks.append(task)
            start = end
        # One controller lock and one staging lock for the whole step; each
        # task is queued and bound to the page (not dispatched: the committer
        # cannot see them yet), so a failed bind is cleaned up by failing them.
        registered.extend(tasks)
        ctrl.register_many(tasks, queued=True)
        return tasks

    def register_deferred_locked(self, split: StepOutputs, registered: list[WriteTask]) -> list[Tid]:
        """Append each request's deferred chunk to its open JOIN_ON_FINISH
        write, or open a new one when there is none, it is closed (copy
        claimed: budget flush, escalate) or it already lost a slot the chunk
        would re-add (the old write would skip the fresh rows). Returns the
        owning tid per chunk, in request order."""
        owners: list[Tid] = []
        ticket = split.deferred_ticket
        ctrl = self._controller
        keys = tuple(split.deferred_clone)
        for rid, chunk in split.deferred_chunks:
            task = self.requests.deferred.get(rid)
            if task is not None and (
                task.taken_over_intersects(chunk) or ctrl.append_chunk(task, chunk, split.freeze_event) is not None
            ):
                task = None
            if task is None:
                tid = next(self._tids)
                task = WriteTask(
                    tid=tid,
                    req_id=rid,
                    write_n=self.requests.open(rid, tid),
                    schedule=WriteSchedule.JOIN_ON_FINISH,
                    chunks=[chunk],
                    freeze_event=split.freeze_event,
                )
                self.records[tid] = TaskRecord(task, rid, [(keys, chunk)])
                if ticket is not None:
                    ctrl.pin_budget(ticket, tid)
                ctrl.register(task, queued=False)
                registered.append(task)
                self.requests.deferred[rid] = task
            else:
                self.records[task.tid].parts.append((keys, chunk))
                if ticket is not None:
                    ctrl.pin_budget(ticket, task.tid)
            owners.append(task.tid)
        return owners

    def take_tenancy_locked(
        self,
        split: StepOutputs,
        slots: torch.Tensor,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        immediate: list[WriteTask],
        deferred_tids: list[Tid],
    ) -> None:
        """The step becomes the tenant of its slots (occupancy coupling
        ``take_tenancy``), one move per key for the whole step: a key the
        step writes goes IN_TRANSIT, owned by its request's write; every
        other open key of those slots is reset to ABSENT, so it can never
        serve a previous tenant's rows. State and reads locks held (version
        bumps and preserved copies change together)."""
        if not req_order:
            return
        sizes = [spans[r][1] for r in req_order]
        # Owners per row as one int64 array each, shared by the keys (the
        # occupancy takes numpy owners as they are: no conversion per key).
        writes: dict[TensorName, np.ndarray] = {}
        if immediate:
            writes.update(dict.fromkeys(split.immediate, per_row_ids([t.tid for t in immediate], sizes)))
        if deferred_tids:
            writes.update(dict.fromkeys(split.deferred_clone, per_row_ids(deferred_tids, sizes)))
        self._occupancy.take_tenancy(slots, writes)

    def on_reassign(self, tid: Tid, key: TensorName, slots: torch.Tensor) -> None:
        """Occupancy hook (state lock held): a newer write took these rows."""
        rec = self.records.get(tid)
        if rec is not None:
            rec.task.add_taken_over(key, slots)

    @staticmethod
    def stranded(registered: list[WriteTask]) -> list[WriteTask]:
        """Registered writes a failed save never handed to the committer.
        Before publish no committer or dispatch has seen them, so every one
        the write_task spec does not call final is stranded."""
        return [t for t in registered if not t.is_terminal]

    def abandon_save(
        self,
        sid: StepId,
        claimed: StepD2HClaim | None,
        reserved: list[BudgetTicket],
        registered: list[WriteTask],
        published: bool,
        error: BaseException,
    ) -> None:
        """The write side of undoing a failed save (no lock held): tasks
        registered but never handed to the committer fail with ``error``
        (their rows will never land: the failure is sticky); budget no task
        pinned is refunded; the step's staging holder is released
        (``abandon``). An eager dispatch failure already failed its batch."""
        if not published:
            self._controller.fail_tasks(self.stranded(registered), error)
        if reserved:
            # Uncharges exactly the tickets no task pinned (release is once per ticket).
            self._controller.refund_unpinned(reserved)
        if claimed is not None:
            self._controller.staging_release(claimed.staging_slot, StagingBufferHolder.for_step(sid), "abandon")

    def save_error(
        self, sid: StepId, exc: BaseException, registered: list[WriteTask], published: bool
    ) -> BaseException:
        """What a failed save raises: a library error (or a non-Exception)
        as is; otherwise a write-failed error when the failure strands
        registered writes (sticky), else a contract error naming the step."""
        if isinstance(exc, OmniPrefixCacheUnmatchError) or not isinstance(exc, Exception):
            return exc
        stranded = [] if published else self.stranded(registered)
        if stranded:
            return self._controller.write_error(stranded[0], exc, "registration")
        error = OmniPrefixCacheUnmatchError(f"save_outputs (step {sid}) failed: {exc!r}")
        error.__cause__ = exc
        return error

    # ------------------------------------------------------------ drains

    def commit_drained_locked(self) -> None:
        """Operation ``drain`` (spec/protocol.yaml), state lock held: take
        the committer's records; failed tasks drop their rows and make the
        failure sticky; written tasks commit theirs (one occupancy move per
        key group for the whole drain)."""
        self._drain.run(_Drained(completions=True))

    def drain_failures_locked(self) -> None:
        """``drain`` of the failure record only (state lock held): a save
        that is failing reports the failures nobody drained yet."""
        self._drain.run(_Drained(completions=False))

    # The drain operation's bindings: its context is a _Drained.
    def move(self, role: str, trigger: str) -> tuple[Callable[[Any], bool], Callable[[Any], None]]:
        """Binding of the drain operation: ``slot.drop?`` / ``slot.commit?``
        settle the drained tasks' rows where the occupancy move is enabled."""
        if role != "slot" or trigger not in ("drop", "commit"):
            raise SpecError(f"write ledger: drain cannot fire {role}.{trigger}")
        field_name = "failed" if trigger == "drop" else "completed"

        def enabled(ctx: _Drained) -> bool:
            return bool(getattr(ctx, field_name))

        def fire(ctx: _Drained) -> None:
            ctx.settled[trigger] = self.settle_locked(getattr(ctx, field_name), trigger)

        return enabled, fire

    def coupling(self, role: str, name: str) -> Callable[[Any], None]:
        raise SpecError(f"write ledger: drain has no coupling {role}.{name}")

    def _take_records(self, ctx: _Drained) -> None:
        ctx.failed = self._controller.drain_failed()
        if ctx.completions:
            ctx.completed = self._controller.drain_completed()

    def _sticky_failure(self, ctx: _Drained) -> None:
        self._note_failures_locked(ctx.failed, ctx.settled.get("drop", []))

    def settle_locked(self, tids: list[Tid], trigger: str) -> list[TaskRecord]:
        """``commit`` or ``drop`` the rows of drained writes and forget them
        (state lock held). Rows are grouped by their key tuple (one per save
        and schedule), so a drain costs one occupancy move per key group,
        not one per task; each group's slots and writers are gathered in the
        one pass over the drained records."""
        groups: dict[tuple[TensorName, ...], ChunkRuns] = {}
        settled: list[TaskRecord] = []
        pop = self.records.pop
        for tid in tids:
            rec = pop(tid, None)
            if rec is None:
                continue
            settled.append(rec)
            for keys, chunk in rec.parts:
                runs = groups.get(keys)
                if runs is None:
                    runs = groups[keys] = ChunkRuns()
                runs.add(chunk, tid)
        self.requests.forget_drained(settled, self._live)
        for keys, runs in groups.items():
            if trigger == "commit":
                self._counters["rows_committed"] += sum(runs.counts) * len(keys)
            self._occupancy.settle_keys(trigger, keys, runs.slots(), per_row_ids(runs.owners, runs.counts))
        return settled

    def _note_failures_locked(self, failed: list[Tid], dropped: list[TaskRecord]) -> None:
        self._counters["failed_writes"] += len(failed)
        settled = {rec.task.tid: rec for rec in dropped}
        names = [f"task {tid} (req {settled[tid].req_id!r})" if tid in settled else f"task {tid}" for tid in failed]
        causes = [c for tid in failed if (c := self._controller.failure_of(tid)) is not None]
        first = causes[0] if causes else None
        message = (
            f"omni prefix cache write failed: {', '.join(names)}; rows behind published block hashes never "
            "landed, so the cache can no longer serve hits" + (f" (first: {first})" if first is not None else "")
        )
        logger.error("%s", message)
        if self.failure is None:
            rec = settled.get(failed[0])
            error = OmniPrefixCacheWriteFailedError(
                message,
                tid=first.tid if first is not None else failed[0],
                req_id=first.req_id if first is not None else (rec.req_id if rec is not None else None),
                keys=first.keys if first is not None else (),
                slots=first.slots if first is not None else (),
            )
            error.__cause__ = first.__cause__ if first is not None else None
            self.failure = error

    # ------------------------------------------------------------ sticky failure

    def raise_if_failed(self) -> None:
        """Sticky failure check at every serving facade entry (takes the
        state lock). Raises the first write failure again."""
        with self._state_lock:
            self.drain_failures_locked()
            failure = self.failure
        if failure is not None:
            raise failure.again()

    def record_fault(self, error: OmniPrefixCacheWriteFailedError) -> None:
        """A device fault lost every write in flight: sticky like a failed
        pool write, unless a failure is already recorded (takes the state
        lock)."""
        with self._state_lock:
            if self.failure is None:
                self.failure = error
