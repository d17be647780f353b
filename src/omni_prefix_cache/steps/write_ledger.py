"""The write ledger: every write the manager opened, until drained.

``WriteLedger`` registers a save's writes with the controller (one
JOIN_NEXT_STEP write per step, holding every request's immediate rows and
viewing the staging page; deferred chunks
appended to the request's open JOIN_ON_FINISH write or a new one), makes the
step the tenant of its slots, and settles drained writes into the slot
occupancy: written rows commit, failed rows drop and the first failure
becomes sticky (``sticky_failure.StickyFailure``). It also keeps the save barrier: the previous step's
JOIN_NEXT_STEP writes, joined before a save may reuse their slots.

Threading: methods named ``*_locked`` and the takeover hook expect the
manager's state lock held (``take_tenancy_locked`` the reads lock too);
``raise_if_failed`` and ``record_fault`` take the state lock themselves;
``join_previous_step`` runs on the engine thread outside it (a join waits on
the committer, which may need the lock).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_prefix_cache.controller import OmniPrefixCacheController, StepD2HClaim, WriteTask
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
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.runner import CALLER_HOLDS
from omni_prefix_cache.specs.types.slot_occupancy import SlotOccupancyTrigger
from omni_prefix_cache.steps.registration import RegistrationStrategy, strategy_for
from omni_prefix_cache.steps.request_tasks import RequestTasks, TaskRecord
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_layout import StepOutputs
from omni_prefix_cache.steps.sticky_failure import StickyFailure
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.chunks import BudgetTicket, ChunkRuns, StepRequests, StepRows, WriteChunk
from omni_prefix_cache.writes.operations import active_protocol
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_errors import write_error


@dataclass(eq=False)
class _Drained:
    """One drain's records (the drain operation's context)."""

    completions: bool  # False: a failing save drains the failure record only
    failed: list[Tid] = field(default_factory=list)
    completed: list[Tid] = field(default_factory=list)
    settled: dict[SlotOccupancyTrigger, list[TaskRecord]] = field(default_factory=dict)


@dataclass(eq=False)
class SaveProgress:
    """What one save_outputs has done so far, for its undo (``abandon_save``):
    its staging claim, the budget it reserved, the writes it registered (each
    appended as soon as the controller may know it) and whether its step was
    published."""

    sid: StepId
    claimed: StepD2HClaim | None = None
    reserved: list[BudgetTicket] = field(default_factory=list)
    registered: list[WriteTask] = field(default_factory=list)
    published: bool = False


# The slot moves the drain operation may fire, and the drained records each settles.
_DRAIN_SETTLES = {SlotOccupancyTrigger.DROP: "failed", SlotOccupancyTrigger.COMMIT: "completed"}


class WriteLedger:
    """Undrained writes (``records`` by tid, ``requests`` per request), the
    save barrier (``previous_step_writes``) and the ``sticky`` failure.

    ``live`` is the facade's set of live requests (read only here);
    ``counters`` its operator counters (``rows_committed``, ``failed_writes``).
    """

    def __init__(
        self,
        controller: OmniPrefixCacheController,
        registry: TaskRegistry,
        budget: GpuBudget,
        occupancy: SlotOccupancy,
        state_lock: threading.Lock,
        live: set[ReqId],
        counters: Counter[str],
        units: RegistrationStrategy | None = None,
    ) -> None:
        """``controller`` runs the write operations (register, reserve, join,
        refund); ``registry`` is its task registry (the records the ledger
        drains), ``budget`` its GPU-byte budget (the clones writes pin).
        ``units``: how a save cuts its step's immediate rows into writes
        (default: the strategy installed now, ``registration.strategy_for``)."""
        self._controller = controller
        self._registry = registry
        self._budget = budget
        self.units = strategy_for(controller) if units is None else units
        self._occupancy = occupancy
        self._state_lock = state_lock
        self._live = live
        self._counters = counters
        self._tids = itertools.count(1)
        self.records: dict[Tid, TaskRecord] = {}
        self.requests = RequestTasks()
        self.previous_step_writes: list[Tid] = []
        self.sticky = StickyFailure(registry, state_lock, counters, self.drain_failures_locked)
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
        and return its writes still to escalate (state lock held): its
        deferred writes, and the previous step's write if it holds the
        request's rows. That is the only step write that can still be
        open (the save barrier joined every older one), and escalating it
        moves up the join the next save makes anyway."""
        self.requests.deferred.pop(rid, None)
        escalate: list[Tid] = []
        for tid in self.requests.tasks.get(rid, ()):
            rec = self.records.get(tid)
            if rec is not None and not rec.task.is_terminal:
                escalate.append(tid)
        for tid in self.previous_step_writes:
            rec = self.records.get(tid)
            if rec is not None and not rec.task.is_terminal and rec.task.holds_request(rid):
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
            dp = TELEMETRY.datapath
            start = TELEMETRY.clock() if dp is not None else 0
            self._controller.join(previous)
            if dp is not None:
                dp.waited("save_barrier", start, TELEMETRY.clock())
            self.previous_step_writes = []

    def reserve_budget(self, split: StepOutputs, reserved: list[BudgetTicket]) -> None:
        """Charge the step's deferred clone to the GPU-byte budget (engine
        thread, outside the state lock: a reserve may flush deferred writes
        and wait) and append its ticket to ``reserved`` once charged, for a
        failed save to refund (``abandon_save``). Raises what the reserve raises."""
        ticket = split.deferred_ticket
        if ticket is not None:
            self._controller.reserve(ticket.nbytes)
            reserved.append(ticket)

    def register_immediate_locked(
        self,
        split: StepOutputs,
        claimed: StepD2HClaim,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        slots: torch.Tensor,
        registered: list[WriteTask],
    ) -> list[WriteTask]:
        """The step's JOIN_NEXT_STEP write: one task for every request's
        immediate rows (its host rows viewing the staging page, its
        requests as state arrays in step order), bound to the page and
        queued (not dispatched). Appends it to ``registered`` as soon as
        the controller may know it; returns ``[task]`` (``[]`` without
        immediate rows or requests). The ledger's registration strategy
        (``steps.registration``, fixed when the ledger was built) may cut
        the step into several such writes, in step order."""
        if not split.immediate or not req_order:
            return []
        ctrl = self._controller
        rows = StepRows(
            slots=slots,
            host=claimed.views,
            tensors={k: split.immediate[k] for k in split.on_device},
        )
        units = self.units(req_order, [spans[r][1] for r in req_order])
        keys, page, freeze_event, d2h_event = (
            tuple(split.immediate),
            claimed.page,
            split.freeze_event,
            claimed.event,
        )
        tasks: list[WriteTask] = []
        start = 0
        for unit_reqs, unit_sizes in units:
            requests = StepRequests.of(unit_reqs, unit_sizes)
            end = start + requests.offsets[-1]
            chunk = WriteChunk.of_step(rows, start, end)
            tid = next(self._tids)
            task = WriteTask.step_write(tid, requests, chunk, freeze_event, page, d2h_event)
            self.records[tid] = TaskRecord(task, None, [(keys, chunk)])
            tasks.append(task)
            start = end
        # Queued and bound to the page (not dispatched: the committer cannot
        # see them yet), so a failed bind is cleaned up by failing them.
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
                task.taken_over_intersects(chunk) or task.append_chunk(chunk, split.freeze_event) is not None
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
                    self._budget.pin(ticket, tid)
                ctrl.register(task, queued=False)
                registered.append(task)
                self.requests.deferred[rid] = task
            else:
                self.records[task.tid].parts.append((keys, chunk))
                if ticket is not None:
                    self._budget.pin(ticket, task.tid)
            owners.append(task.tid)
        return owners

    def take_tenancy_locked(
        self,
        split: StepOutputs,
        slots: torch.Tensor,
        sizes: list[int],
        immediate: list[WriteTask],
        deferred_tids: list[Tid],
    ) -> int:
        """The step becomes the tenant of its slots (occupancy coupling
        ``take_tenancy``), one move per key for the whole step: a key the
        step writes goes IN_TRANSIT, owned by the step's write (immediate
        keys) or its request's write (deferred keys); every
        other open key of those slots is reset to ABSENT, so it can never
        serve a previous tenant's rows. ``sizes``: the rows of each scheduled
        request, in step order. State and reads locks held (version
        bumps and preserved copies change together). Returns the save's
        tenancy (-1 for a step without rows)."""
        if not sizes:
            return -1
        # Owners per row: the step's write owns every immediate row (one
        # tid); deferred owners are one int64 array shared by the keys (the
        # occupancy takes numpy owners as they are: no conversion per key).
        writes: dict[TensorName, np.ndarray | int] = {}
        if len(immediate) == 1:
            writes.update(dict.fromkeys(split.immediate, immediate[0].tid))
        elif immediate:  # a strategy cut the step: each write owns its window, in step order
            rows = [t.chunks[0].end - t.chunks[0].start for t in immediate]
            writes.update(dict.fromkeys(split.immediate, per_row_ids([t.tid for t in immediate], rows)))
        if deferred_tids:
            writes.update(dict.fromkeys(split.deferred_clone, per_row_ids(deferred_tids, sizes)))
        return self._occupancy.take_tenancy(slots, writes)

    def on_takeover(self, tid: Tid, key: TensorName, slots: torch.Tensor) -> None:
        """Occupancy hook (state lock held): a newer write took these rows
        over from write ``tid``, whose pool write must now skip them."""
        rec = self.records.get(tid)
        if rec is not None:
            rec.task.add_taken_over(key, slots)

    @staticmethod
    def stranded(registered: list[WriteTask]) -> list[WriteTask]:
        """Registered writes a failed save never handed to the committer.
        Before publish no committer or dispatch has seen them, so every one
        the write_task spec does not call final is stranded."""
        return [t for t in registered if not t.is_terminal]

    def refund_unpinned(self, reserved: list[BudgetTicket]) -> None:
        """Uncharge exactly the tickets no task pinned (a ticket is released
        once): a clone no task views is refunded as soon as its save
        registered its writes, or when the save fails. No lock held."""
        if reserved:
            self._controller.refund_unpinned(reserved)

    def save_error(self, save: SaveProgress, exc: BaseException) -> BaseException:
        """What a failed save raises: a library error (or a non-Exception)
        as is; otherwise a write-failed error when the failure strands
        registered writes (sticky), else a contract error naming the step."""
        if isinstance(exc, OmniPrefixCacheUnmatchError) or not isinstance(exc, Exception):
            return exc
        stranded = [] if save.published else self.stranded(save.registered)
        if stranded:
            try:
                return write_error(stranded[0], exc, "registration")
            except Exception:  # noqa: BLE001 - naming the write must not skip the undo (the caller abandons next)
                pass
        error = OmniPrefixCacheUnmatchError(f"save_outputs (step {save.sid}) failed: {exc!r}")
        error.__cause__ = exc
        return error

    # ------------------------------------------------------------ drains

    def commit_drained_locked(self) -> None:
        """Operation ``drain`` (spec/protocol.yaml), state lock held: take
        the committer's records; failed tasks drop their rows and make the
        failure sticky; written tasks commit theirs (one occupancy move per
        key group for the whole drain). Nothing published: the drain would
        take no record and fire no move, so it is not run (a lock-free read
        of the records; one published meanwhile is taken by the next drain,
        as it would be had it come a moment later)."""
        registry = self._registry
        if registry.completed or registry.failed:
            CALLER_HOLDS.run_all(self._drain, _Drained(completions=True))

    def drain_failures_locked(self) -> None:
        """``drain`` of the failure record only (state lock held): a save
        that is failing reports the failures nobody drained yet. Not run
        when no failure is published (as ``commit_drained_locked``)."""
        if self._registry.failed:
            CALLER_HOLDS.run_all(self._drain, _Drained(completions=False))

    # The drain operation's bindings: its context is a _Drained.
    def move(self, role: str, trigger: TriggerName) -> tuple[Callable[[Any], bool], Callable[[Any], None]]:
        """Binding of the drain operation: ``slot.drop?`` / ``slot.commit?``
        settle the drained tasks' rows where the occupancy move is enabled."""
        if role != "slot" or trigger not in _DRAIN_SETTLES:
            raise SpecError(f"write ledger: drain cannot fire {role}.{trigger}")
        slot_trigger = SlotOccupancyTrigger(trigger)
        field_name = _DRAIN_SETTLES[slot_trigger]

        def enabled(ctx: _Drained) -> bool:
            return bool(getattr(ctx, field_name))

        def fire(ctx: _Drained) -> None:
            ctx.settled[slot_trigger] = self.settle_locked(getattr(ctx, field_name), slot_trigger)

        return enabled, fire

    def coupling(self, role: str, name: str) -> Callable[[Any], None]:
        raise SpecError(f"write ledger: drain has no coupling {role}.{name}")

    def _take_records(self, ctx: _Drained) -> None:
        ctx.failed = self._registry.take_failed()
        if ctx.completions:
            ctx.completed = self._registry.take_completed()

    def _sticky_failure(self, ctx: _Drained) -> None:
        dropped = ctx.settled.get(SlotOccupancyTrigger.DROP, [])
        self.sticky.note_locked(ctx.failed, {rec.task.tid: rec.task.req_ids for rec in dropped})

    def settle_locked(self, tids: list[Tid], trigger: SlotOccupancyTrigger) -> list[TaskRecord]:
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
            if trigger == SlotOccupancyTrigger.COMMIT:
                self._counters["rows_committed"] += sum(runs.counts) * len(keys)
            # One writer (a step's write) settles as one owner of every row: no per-row array.
            owners = runs.owners
            writers = owners[0] if len(owners) == 1 else per_row_ids(owners, runs.counts)
            self._occupancy.settle_keys(trigger, keys, runs.slots(), writers)
        return settled

    # ------------------------------------------------------------ sticky failure

    @property
    def failure(self) -> OmniPrefixCacheWriteFailedError | None:
        """The first write failure, sticky (``StickyFailure.error``)."""
        return self.sticky.error

    def raise_if_failed(self) -> None:
        """``StickyFailure.raise_if_failed`` (takes the state lock)."""
        self.sticky.raise_if_failed()

    def record_fault(self, error: OmniPrefixCacheWriteFailedError) -> None:
        """``StickyFailure.record_fault`` (takes the state lock)."""
        self.sticky.record_fault(error)
