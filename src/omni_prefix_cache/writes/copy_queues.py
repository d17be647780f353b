"""The committer's copy queues, as the ``copy_queue`` spec's positions.

Each WriteTask's ``position`` (spec/copy_queue.yaml, enum ``QueuePosition``)
and the real structures move together here, through the compiled table:
``high`` / ``low`` hold HIGH / LOW entries (and STALE ones until their pop),
``claimed`` the CLAIMED tasks whose copy no committer has taken yet,
``blocked`` the BLOCKED tasks whose pool write no committer has taken yet.
The pairs a position may form with a task state are the composition's
(spec/protocol.yaml ``pairs``); only the controller's compiled operations
call ``fire``, under the controller lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from omni_prefix_cache.interface import Tid
from omni_prefix_cache.specs import SpecError, compile_machine, load_spec
from omni_prefix_cache.specs.composition import ProtocolViolation
from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger, QueuePosition

COPY_QUEUE_MACHINE = compile_machine(load_spec("copy_queue"), state_enum=QueuePosition)


class QueueEntry(Protocol):
    """What the copy queues read and move of a task: its tid and position."""

    tid: Tid
    position: QueuePosition


def _discard(box: deque[Tid] | list[Tid], tid: Tid) -> None:
    # A committer that took the work already removed the entry.
    if tid in box:
        box.remove(tid)


class CopyQueues:
    """The high and low copy queues, the claimed and blocked lists, and the
    moves that change them with a task's position. Not thread-safe: the
    controller lock covers every call."""

    def __init__(self) -> None:
        self.high: deque[Tid] = deque()  # immediate writes and escalated deferred ones
        self.low: deque[Tid] = deque()  # deferred writes queued at submit
        self.claimed: deque[Tid] = deque()  # claimed, copy stage not taken yet
        self.blocked: list[Tid] = []  # host rows ready, pool write not taken yet
        # None: the move changes the position only (no structure holds the task).
        self._effects: dict[CopyQueueTrigger, Callable[[Tid], None] | None] = {
            CopyQueueTrigger.PUSH: self.high.append,
            CopyQueueTrigger.PUSH_LOW: self.low.append,
            CopyQueueTrigger.PUSH_HEAD: self.high.appendleft,
            CopyQueueTrigger.PROMOTE: self._promote,
            CopyQueueTrigger.CLAIM: self._claim,
            CopyQueueTrigger.COPIED: self._copied,
            CopyQueueTrigger.WRITTEN: lambda tid: _discard(self.blocked, tid),
            CopyQueueTrigger.SKIP: self._unqueue,
            CopyQueueTrigger.INLINE: None,
            CopyQueueTrigger.FAIL: self._failed,  # a queue entry stays (STALE) until its pop
        }
        missing = sorted(set(COPY_QUEUE_MACHINE.triggers) - set(self._effects))
        if missing:
            raise SpecError(f"copy_queue.yaml: the copy queues have no call for triggers {missing}")

    # ------------------------------------------------------------ moves

    def enabled(self, task: QueueEntry, trigger: CopyQueueTrigger) -> bool:
        return COPY_QUEUE_MACHINE.move(task.position, trigger) is not None

    def enabled_many(self, tasks: Sequence[QueueEntry], trigger: CopyQueueTrigger) -> list[bool]:
        """``enabled`` for each task (one table lookup per task)."""
        moves = COPY_QUEUE_MACHINE.by_state(trigger)
        return [moves[task.position] is not None for task in tasks]

    def fire(self, task: QueueEntry, trigger: CopyQueueTrigger) -> None:
        """Move ``task``'s position by ``trigger`` and its entry with it."""
        move = COPY_QUEUE_MACHINE.move(task.position, trigger)
        if move is None:
            raise ProtocolViolation(
                f"task {task.tid}: copy queue position {QueuePosition(task.position).name} has no move {str(trigger)!r}"
            )
        effect = self._effects[trigger]
        if effect is not None:
            effect(task.tid)
        task.position = move.dest  # type: ignore[assignment]  # the table's states are QueuePosition
        recorder = COPY_QUEUE_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, task)

    def try_fire(self, task: QueueEntry, trigger: CopyQueueTrigger) -> bool:
        """``fire`` if the position has the move; False (nothing moved) otherwise."""
        move = COPY_QUEUE_MACHINE.move(task.position, trigger)
        if move is None:
            return False
        effect = self._effects[trigger]
        if effect is not None:
            effect(task.tid)
        task.position = move.dest  # type: ignore[assignment]  # the table's states are QueuePosition
        recorder = COPY_QUEUE_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, task)
        return True

    def try_fire_many(self, tasks: Sequence[QueueEntry], trigger: CopyQueueTrigger) -> list[bool | BaseException]:
        """``try_fire`` for each task in order (a batched step); per task
        True if its position moved, False if it has no such move."""
        moves = COPY_QUEUE_MACHINE.by_state(trigger)
        out: list[bool | BaseException] = [True] * len(tasks)
        moved = tasks
        recorder = COPY_QUEUE_MACHINE.recorder
        if recorder is not None:
            recorder.moved_batch(tasks, [moves[task.position] for task in tasks])
        for i, task in enumerate(tasks):
            move = moves[task.position]
            if move is None:
                out[i] = False
                continue
            task.position = move.dest  # type: ignore[assignment]
        if not all(out):
            moved = [task for task, ok in zip(tasks, out) if ok]
        effect = self._effects[trigger]
        if moved and effect is not None:
            if trigger == CopyQueueTrigger.WRITTEN and len(moved) > 1:
                # One pass over the blocked list for the whole batch.
                gone = {task.tid for task in moved}
                self.blocked[:] = [tid for tid in self.blocked if tid not in gone]
            else:
                for task in moved:
                    effect(task.tid)
        return out

    def _unqueue(self, tid: Tid) -> None:
        for queue in (self.high, self.low):
            if queue and queue[0] == tid:
                queue.popleft()
                return
        for queue in (self.high, self.low):
            if tid in queue:
                queue.remove(tid)
                return

    def _promote(self, tid: Tid) -> None:
        self.low.remove(tid)
        self.high.appendleft(tid)

    def _claim(self, tid: Tid) -> None:
        self._unqueue(tid)
        self.claimed.append(tid)

    def _copied(self, tid: Tid) -> None:
        _discard(self.claimed, tid)
        self.blocked.append(tid)

    def _failed(self, tid: Tid) -> None:
        _discard(self.claimed, tid)
        _discard(self.blocked, tid)

    # ------------------------------------------------------------ work

    def head(self) -> Tid | None:
        """The entry the next claim pops (high first), or None."""
        if self.high:
            return self.high[0]
        return self.low[0] if self.low else None

    def take_claimed(self) -> Tid | None:
        """Take the oldest claimed task's copy stage (its position stays
        CLAIMED until ``copied``), or None."""
        return self.claimed.popleft() if self.claimed else None

    def has_work(self) -> bool:
        return bool(self.high or self.low or self.claimed or self.blocked)

    def depths(self) -> dict[str, int]:
        return {
            "queue_hi": len(self.high),
            "queue_lo": len(self.low),
            "claimed": len(self.claimed),
            "blocked": len(self.blocked),
        }
