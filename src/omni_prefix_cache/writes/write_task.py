"""WriteTask: one write of (slot, key) rows: a step's immediate rows, or
one request's deferred rows.

Its lifecycle is the ``write_task`` spec (spec/write_task.yaml): the state
enum ``TaskState`` is generated from it and every move goes through the
compiled table. The wait events ``host_ready`` and ``done`` are set only by
the effects the spec declares on a move, never directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.compat.write_task_seams import UpstreamTaskSeams, upstream_keywords
from omni_prefix_cache.device import sync
from omni_prefix_cache.device.copy_engine import DeviceEvents
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, TensorName, Tid, WriteSchedule
from omni_prefix_cache.specs import CompiledMove, compile_machine, load_spec
from omni_prefix_cache.specs.types.copy_queue import QueuePosition
from omni_prefix_cache.specs.types.write_task import TaskState as TaskState  # re-exported
from omni_prefix_cache.specs.types.write_task import WriteTaskTrigger
from omni_prefix_cache.writes.chunks import BudgetTicket, HostRow, StepRequests, WriteChunk

# Guards the one-time creation of a TaskEvent's condition (see TaskEvent.wait).
_EVENT_COND_INIT = threading.Lock()


class TaskEvent:
    """A one-shot event that is cheap until somebody waits on it.

    ``threading.Event()`` costs about 6 us to build here and each task needs
    two, while most tasks are never waited on. The condition is created on
    the first ``wait``; ``set`` notifies only if one exists. Same
    ``is_set`` / ``set`` / ``wait`` contract as ``threading.Event``
    (no ``clear``: task events never reset).
    """

    def __init__(self) -> None:
        self._flag = False
        self._cond: threading.Condition | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        cond = self._cond
        if cond is not None:
            with cond:
                cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` seconds pass; True if set."""
        if self._flag:
            return True
        with _EVENT_COND_INIT:
            if self._cond is None:
                self._cond = sync.Condition(sync.Lock())
        cond = self._cond
        with cond:
            # The predicate is re-read under the condition's lock, so a set()
            # that raced the creation above is never missed.
            return cond.wait_for(lambda: self._flag, timeout)


# --------------------------------------------------------------- spec effects
# Each runs under the task's lock, as part of the move that declares it.


def _drop_device_clone(task: WriteTask) -> None:
    for chunk in task.chunks:
        chunk.tensors = {}
        if chunk.step is not None:
            # The step's clones back none of its writes once its rows are
            # on the host (every window reads the staging views): the first
            # write past its copy frees them for all.
            chunk.step.tensors = {}


def _set_host_ready(task: WriteTask) -> None:
    task.host_ready.set()


def _set_done(task: WriteTask) -> None:
    task.done.set()


WRITE_TASK_MACHINE = compile_machine(
    load_spec("write_task"),
    effects={
        "drop_device_clone": _drop_device_clone,
        "set_host_ready": _set_host_ready,
        "set_done": _set_done,
    },
    state_enum=TaskState,
)
# The host_ready move from each state (mark_host_ready runs once per write).
_HOST_READY = WRITE_TASK_MACHINE.by_state(WriteTaskTrigger.HOST_READY)
# States in which a task still accepts chunks (the spec's accepts_chunks tag).
_ACCEPTS_CHUNKS = WRITE_TASK_MACHINE.tagged("accepts_chunks")


def illegal_move(task: WriteTask, to: TaskState | WriteTaskTrigger) -> OmniPrefixCacheUnmatchError:
    """The error for a move the spec does not declare from the task's state
    (``to``: the target state, or the trigger fired)."""
    name = to.name if isinstance(to, TaskState) else str(to)
    return OmniPrefixCacheUnmatchError(f"task {task.tid}: illegal transition {task.state.name} -> {name}")


@upstream_keywords  # compat: upstream's ``staging_slot=`` for ``page``
@dataclass(eq=False, repr=False)
class WriteTask(UpstreamTaskSeams):
    """One write of (slot, key) rows. A JOIN_NEXT_STEP write is a whole
    step's immediate rows (``step_write``): one task, one chunk, every
    request of the step named by ``requests`` (state arrays in step order;
    ``req_id`` is then its first request and ``write_n`` 1). A
    JOIN_ON_FINISH write is one request's (``req_id``'s ``write_n``-th
    write), growing by a chunk per save. May cover several keys.

    ``state`` is the single source of truth; it moves only through the
    compiled ``write_task`` spec. ``lock`` (reentrant: an operation's
    ``task`` segment holds it while its moves take it again) covers
    ``state``, ``taken_over``, chunk appends, host/clone swaps and
    ``slot_to_row``. ``position`` is the task's ``copy_queue`` state, moved
    only by the controller's compiled operations under the controller lock.
    """

    tid: Tid
    req_id: ReqId
    write_n: int
    schedule: WriteSchedule
    chunks: list[WriteChunk]
    # Compute-stream event after the on-device clone; copy and read lanes
    # wait it before touching chunk tensors (a later CUDA-graph replay
    # overwrites the static buffers the clone was taken from).
    freeze_event: Any = None
    state: TaskState = TaskState.PENDING
    # Rows of this write taken over by a newer write; skipped at pool write.
    taken_over: dict[TensorName, torch.Tensor] = field(default_factory=dict)
    host_ready: TaskEvent = field(default_factory=TaskEvent)
    done: TaskEvent = field(default_factory=TaskEvent)
    lock: Any = field(default_factory=sync.new_rlock)
    position: QueuePosition = QueuePosition.UNQUEUED
    # A deferred write registered queued (its dispatch pushes it to the low queue).
    queued_at_submit: bool = False
    # Host rows a copy stage made, installed by its host_ready move.
    copied_rows: Sequence[HostRow] = ()
    # Budget flush picks the pending task with the oldest of these.
    enqueued_time: float = field(default_factory=time.monotonic)
    # Immediate path: the staging page this write views, and the step's
    # device-to-host event (None once complete or on CPU).
    page: int | None = None
    step_d2h_event: Any = None
    _slot_to_row: dict[int, tuple[int, int]] | None = None
    # Effects a deferred ``fail`` still owes (run by wake_failed_waiters).
    _owed_wakes: tuple[Callable[[WriteTask], None], ...] = ()
    # A step's write: the requests whose rows it holds (None: one request's).
    requests: StepRequests | None = None

    @classmethod
    def step_write(
        cls,
        tid: Tid,
        requests: StepRequests,
        chunk: WriteChunk,
        freeze_event: Any,
        page: int,
        step_d2h_event: Any,
    ) -> WriteTask:
        """A step's immediate (JOIN_NEXT_STEP) write: ``chunk`` holds the
        rows of every request in ``requests``. The same task as the
        dataclass constructor with these arguments builds (every field, in
        field order, fresh factory defaults)."""
        task = cls.__new__(cls)
        task.tid = tid
        task.req_id = requests.req_ids[0]
        task.write_n = 1
        task.schedule = WriteSchedule.JOIN_NEXT_STEP
        task.chunks = [chunk]
        task.freeze_event = freeze_event
        task.state = TaskState.PENDING
        task.taken_over = {}
        task.host_ready = TaskEvent()
        task.done = TaskEvent()
        task.lock = sync.new_rlock()
        task.position = QueuePosition.UNQUEUED
        task.queued_at_submit = False
        task.copied_rows = ()
        task.enqueued_time = time.monotonic()
        task.page = page
        task.step_d2h_event = step_d2h_event
        task._slot_to_row = None
        task._owed_wakes = ()
        task.requests = requests
        return task

    def __repr__(self) -> str:
        who = f"req={self.req_id!r}" if self.requests is None else f"reqs={list(self.requests.req_ids)!r}"
        return (
            f"WriteTask(tid={self.tid}, {who}, {self.schedule.value}, "
            f"{TaskState(self.state).name}, position {QueuePosition(self.position).name})"
        )

    @property
    def req_ids(self) -> tuple[ReqId, ...]:
        """Every request whose rows this write holds, in step order."""
        return (self.req_id,) if self.requests is None else self.requests.req_ids

    def holds_request(self, req_id: ReqId) -> bool:
        return req_id == self.req_id if self.requests is None else req_id in self.requests

    def describe_requests(self) -> str:
        """``req 'a'``; a step's write: every request, its rows and slot range."""
        return f"req {self.req_id!r}" if self.requests is None else self.requests.describe(self.chunks[0].slots_cpu)

    # ------------------------------------------------------------ lifecycle

    def _move_locked(self, to: TaskState) -> None:
        move = WRITE_TASK_MACHINE.move_to(self.state, to)
        if move is None:
            raise illegal_move(self, to)
        self._apply_locked(move, False)

    def _apply_locked(self, move: CompiledMove, defer: bool) -> None:
        """Enter ``move.dest`` and run its effects (task lock held); with
        ``defer`` the deferrable ones are owed until ``wake_failed_waiters``."""
        # The machine was compiled with state_enum=TaskState: every dest is one.
        self.state = move.dest  # type: ignore[assignment]
        recorder = WRITE_TASK_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, self, defer or None)  # a trace keeps the deferred wakes
        if defer:
            for effect in move.undeferrable:
                effect(self)
            self._owed_wakes = move.deferrable
        else:
            for effect in move.effects:
                effect(self)

    def transition(self, to: TaskState) -> None:
        """Move to ``to``; raises OmniPrefixCacheUnmatchError unless the spec
        declares the move from the current state. Any thread."""
        with self.lock:
            self._move_locked(to)

    def can(self, trigger: WriteTaskTrigger) -> bool:
        """True if the spec has a ``trigger`` move from the current state."""
        return WRITE_TASK_MACHINE.move(self.state, trigger) is not None

    def try_fire(self, trigger: WriteTaskTrigger, *, defer: bool = False) -> bool:
        """``fire`` if the spec has the move from the current state, atomically;
        False (nothing moved) otherwise."""
        with self.lock:
            move = WRITE_TASK_MACHINE.move(self.state, trigger)
            if move is None:
                return False
            self._apply_locked(move, defer)
            return True

    def fire(self, trigger: WriteTaskTrigger, *, defer: bool = False, rows: Sequence[HostRow] = ()) -> None:
        """Fire ``trigger``; raises OmniPrefixCacheUnmatchError unless the
        spec declares it from the current state. ``rows``: host rows the
        move installs (a copy stage's output), before its effects run;
        ``defer``: run only the undeferrable effects now, the rest once the
        caller published its failure record (``wake_failed_waiters``)."""
        with self.lock:
            move = WRITE_TASK_MACHINE.move(self.state, trigger)
            if move is None:
                raise illegal_move(self, trigger)
            for chunk, key, tensor in rows:
                chunk.host[key] = tensor
            self._apply_locked(move, defer)

    @staticmethod
    def try_fire_many(
        tasks: Sequence[WriteTask], trigger: WriteTaskTrigger, *, defer: bool = False
    ) -> list[bool | BaseException]:
        """``try_fire`` for each task (a batched step): per task True if it
        moved, False if the spec has no such move from its state, or the
        exception one of its move's effects raised."""
        moves = WRITE_TASK_MACHINE.by_state(trigger)
        out: list[bool | BaseException] = [True] * len(tasks)
        for i, task in enumerate(tasks):
            with task.lock:
                move = moves[task.state]
                if move is None:
                    out[i] = False
                    continue
                try:
                    task._apply_locked(move, defer)
                except Exception as exc:
                    out[i] = exc
        return out

    def try_transition(self, to: TaskState) -> bool:
        """Move to ``to`` if the spec allows it from the current state."""
        with self.lock:
            if WRITE_TASK_MACHINE.move_to(self.state, to) is None:
                return False
            self._move_locked(to)
            return True

    @property
    def is_terminal(self) -> bool:
        return self.state in WRITE_TASK_MACHINE.final

    def append_chunk(self, chunk: WriteChunk, freeze_event: Any = None) -> TaskState | None:
        """Grow the write by one save's rows. Returns None if appended, else
        the state that closed the task (the caller opens a new task). Takes
        the task's lock. Per device the newest ``freeze_event`` covers the
        older ones (one compute stream's events complete in order); a device
        only an older chunk used keeps its own (``DeviceEvents.merged``)."""
        with self.lock:
            if self.state not in _ACCEPTS_CHUNKS:
                return self.state
            self.chunks.append(chunk)
            self._slot_to_row = None
            self.freeze_event = DeviceEvents.merged(self.freeze_event, freeze_event)
            return None

    def set_host_tensor(self, rows: Sequence[HostRow]) -> None:
        """COPYING -> HOST_READY after installing the copied host rows. An
        illegal call raises before touching any chunk."""
        with self.lock:
            if WRITE_TASK_MACHINE.move_to(self.state, TaskState.HOST_READY) is None:
                raise illegal_move(self, TaskState.HOST_READY)
            for chunk, key, tensor in rows:
                chunk.host[key] = tensor
            self._move_locked(TaskState.HOST_READY)

    def mark_host_ready(self) -> None:
        """COPYING -> HOST_READY for staging views: waits the step's
        device-to-host event first (outside the task lock)."""
        if self.step_d2h_event is not None:
            self.step_d2h_event.synchronize()
        with self.lock:
            move = _HOST_READY[self.state]
            if move is None:
                raise illegal_move(self, TaskState.HOST_READY)
            self._apply_locked(move, False)

    def wake_failed_waiters(self) -> None:
        """Run the wake effects a deferred ``fail`` still owes."""
        with self.lock:
            owed, self._owed_wakes = self._owed_wakes, ()
            for effect in owed:
                effect(self)

    # ------------------------------------------------------------ takeover

    def add_taken_over(self, key: TensorName, slots: torch.Tensor) -> None:
        """Record that a newer write took these (slot, key) rows over."""
        with self.lock:
            prev = self.taken_over.get(key)
            self.taken_over[key] = slots.clone() if prev is None else torch.cat([prev, slots])

    def taken_over_intersects(self, chunk: WriteChunk) -> bool:
        """True if the chunk would re-add a (key, slot) this write already
        lost; the caller opens a fresh write instead of appending."""
        with self.lock:
            if not self.taken_over:
                return False
            new = set(chunk.slots_cpu.tolist())
            for key in chunk.tensors:
                taken = self.taken_over.get(key)
                if taken is not None and not new.isdisjoint(taken.tolist()):
                    return True
            return False

    # ------------------------------------------------------------ reading rows

    def get_host_tensor(self, si: int, key: TensorName) -> torch.Tensor | None:
        """Chunk ``si``'s host rows for ``key`` if copied, else its device
        clone, read in one snapshot under the lock."""
        with self.lock:
            chunk = self.chunks[si]
            src = chunk.host.get(key)
            return chunk.tensors.get(key) if src is None else src

    def slot_to_row(self) -> dict[int, tuple[int, int]]:
        """slot -> (chunk index, row); a later chunk wins for a slot written twice."""
        with self.lock:
            if self._slot_to_row is None:
                table: dict[int, tuple[int, int]] = {}
                for si, chunk in enumerate(self.chunks):
                    for ri, slot in enumerate(chunk.slots_cpu.tolist()):
                        table[slot] = (si, ri)
                self._slot_to_row = table
            return self._slot_to_row

    def scatter_rows(self) -> list[tuple[TensorName, torch.Tensor, torch.Tensor]]:
        """``(key, slots, host_rows)`` to write, one entry per key.

        Slots in ``taken_over`` are left out; a slot written by two chunks
        (preempt and resume onto the same block) keeps the later chunk's row.
        """
        with self.lock:
            taken_over = dict(self.taken_over)
        per_key: dict[TensorName, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for chunk in self.chunks:
            for key, host in chunk.host.items():
                per_key.setdefault(key, []).append((chunk.slots_cpu, host))
        out: list[tuple[TensorName, torch.Tensor, torch.Tensor]] = []
        for key, parts in per_key.items():
            if len(parts) == 1:
                slots, host = parts[0]
            else:
                slots = torch.cat([p[0] for p in parts])
                host = torch.cat([p[1] for p in parts], dim=0)
                slots, host = _keep_last_write(slots, host)
            taken = taken_over.get(key)
            if taken is not None and taken.numel():
                gone = set(taken.tolist())
                keep = [i for i, s in enumerate(slots.tolist()) if s not in gone]
                if not keep:
                    continue
                if len(keep) < slots.numel():
                    idx = torch.tensor(keep, dtype=torch.int64)
                    slots, host = slots.index_select(0, idx), host.index_select(0, idx)
            out.append((key, slots, host))
        return out

    def budget_tickets(self) -> list[BudgetTicket]:
        """The distinct tickets across this task's chunks (by identity)."""
        if len(self.chunks) == 1:  # the usual write (a step's staging view pins none)
            budget = self.chunks[0].budget
            return [] if budget is None else [budget]
        seen: dict[int, BudgetTicket] = {}
        for chunk in self.chunks:
            if chunk.budget is not None:
                seen.setdefault(id(chunk.budget), chunk.budget)
        return list(seen.values())


def _keep_last_write(slots: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop earlier rows of any slot that appears twice (in order of first
    appearance of each slot's last write)."""
    order = slots.tolist()
    if len(set(order)) == len(order):  # the usual write: no slot twice (a set is built in C)
        return slots, host
    last = {s: i for i, s in enumerate(order)}
    idx = torch.tensor(sorted(last.values()), dtype=torch.int64)
    return slots.index_select(0, idx), host.index_select(0, idx)
