"""The controller's side of the composition (spec/protocol.yaml), compiled.

``ControllerBinding`` resolves each ``role.trigger`` the controller's
operations fire to closures over the compiled machines: ``task``
(write_task, on the WriteTask), ``position`` (copy_queue, on the copy
queues) and ``task_holder`` (staging_holder, on the staging pool). Any other
role is not the controller's and fails at compile time. ``compile_ops``
compiles, once per controller, what executor ``controller`` runs (its roles
and effects are the spec's ``executors``): escalate, committer_claim,
committer_copy, committer_write, eager_run, fail, join, and its share of
save (register, budget, dispatch), abandon_save (cleanup), new_step (kick)
and shutdown.

``controller_runner`` is the controller's ``SegmentRunner``: each segment
runs by name under the lock it declares. ``use_protocol`` swaps the spec
later controllers are compiled from (spec mutants and tests only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs.batch import AttemptMany, BatchRun, MaskMany, RunMany, attempt_each
from omni_prefix_cache.specs.composition import (
    CompiledOperation,
    ProtocolSpec,
    compile_operation,
    load_protocol,
)
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.runner import LockRule, SegmentRunner
from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.specs.types.write_task import WriteTaskTrigger
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool
from omni_prefix_cache.writes.write_task import WRITE_TASK_MACHINE, WriteTask

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]
Trigger = TypeVar("Trigger", WriteTaskTrigger, CopyQueueTrigger, StagingHolderTrigger)

_override: list[ProtocolSpec] = []
_FAILURE = WRITE_TASK_MACHINE.tagged("failure")


def _trigger(kind: type[Trigger], role: str, trigger: TriggerName) -> Trigger:
    """``trigger`` as ``kind`` (the role's generated trigger enum)."""
    try:
        return kind(trigger)
    except ValueError:
        raise SpecError(f"protocol.yaml: {role} has no trigger {trigger!r}") from None


def task_failed(task: WriteTask) -> bool:
    """Guard ``task_failed``: the task is in a state the write_task spec tags ``failure``."""
    return task.state in _FAILURE


def active_protocol() -> ProtocolSpec:
    """The composition new controllers compile: the shipped one unless
    ``use_protocol`` set another."""
    return _override[-1] if _override else load_protocol()


@contextlib.contextmanager
def use_protocol(spec: ProtocolSpec) -> Iterator[ProtocolSpec]:
    """Controllers built inside the block compile their operations from
    ``spec`` (a mutated composition). For spec mutants and tests only."""
    _override.append(spec)
    try:
        yield spec
    finally:
        _override.remove(spec)


class ControllerBinding:
    """``Binding`` for the controller: ``move(role, trigger)`` returns
    ``(enabled, fire)`` over the task passed as the context."""

    def __init__(self, queues: CopyQueues, staging: StagingBufferPool):
        self._queues = queues
        self._staging = staging

    def move(self, role: str, trigger: TriggerName) -> tuple[Pred, Run]:
        if role == "task":
            return self._task_move(_trigger(WriteTaskTrigger, role, trigger))
        if role == "position":
            queues, position = self._queues, _trigger(CopyQueueTrigger, role, trigger)
            return (lambda task: queues.enabled(task, position)), (lambda task: queues.fire(task, position))
        if role == "task_holder":
            return self._holder_move(_trigger(StagingHolderTrigger, role, trigger))
        raise SpecError(f"protocol.yaml: the controller fires no {role}.{trigger} (its roles: executor controller)")

    def try_move(self, role: str, trigger: TriggerName) -> Pred:
        """``attempt(task)``: fire the move if it is enabled, atomically
        (under the task's, the queues' or the pool's own lock)."""
        if role == "task":
            move = _trigger(WriteTaskTrigger, role, trigger)
            if move is WriteTaskTrigger.HOST_READY:
                many = _host_ready_many()

                def attempt_host_ready(task: WriteTask) -> bool:
                    result = many([task])[0]
                    if isinstance(result, BaseException):
                        raise result
                    return result

                return attempt_host_ready
            defer = move is WriteTaskTrigger.FAIL  # operation fail runs the wakes once its record is public
            return lambda task: task.try_fire(move, defer=defer)
        if role == "position":
            queues, position = self._queues, _trigger(CopyQueueTrigger, role, trigger)
            return lambda task: queues.try_fire(task, position)
        if role == "task_holder":
            staging, holder_move = self._staging, _trigger(StagingHolderTrigger, role, trigger)
            for_task = StagingBufferHolder.for_task
            return lambda task: task.page is not None and staging.try_fire(holder_move, task.page, for_task(task.tid))
        return self.move(role, trigger)[0]  # raises: not the controller's role

    def coupling(self, role: str, name: str) -> Run:
        raise SpecError(f"protocol.yaml: the controller runs no coupling {role}.{name}")

    # Batched moves (specs.batch): one call per step for a whole batch of
    # tasks, each task's move atomic under its own, the queues' or the
    # pool's lock as in ``try_move``; a move that raises is that task's.

    def try_move_many(self, role: str, trigger: TriggerName) -> AttemptMany:
        if role == "position":
            queues, position = self._queues, _trigger(CopyQueueTrigger, role, trigger)
            return lambda tasks: queues.try_fire_many(tasks, position)
        if role == "task_holder":
            staging, holder_move = self._staging, _trigger(StagingHolderTrigger, role, trigger)
            return lambda tasks: staging.try_fire_tasks(holder_move, tasks)
        if role == "task":
            move = _trigger(WriteTaskTrigger, role, trigger)
            if move is WriteTaskTrigger.HOST_READY:
                return _host_ready_many()
            defer = move is WriteTaskTrigger.FAIL  # as in try_move
            return lambda tasks: WriteTask.try_fire_many(tasks, move, defer=defer)
        # Raises for a role not the controller's.
        return attempt_each(self.try_move(role, trigger))

    def move_many(self, role: str, trigger: TriggerName) -> tuple[MaskMany, RunMany]:
        enabled, fire = self.move(role, trigger)

        def fire_many(tasks: list[Any]) -> None:
            for task in tasks:
                fire(task)

        # A batched operation's entry check: one table lookup per task.
        if role == "position":
            queues, position = self._queues, CopyQueueTrigger(trigger)
            return (lambda tasks: queues.enabled_many(tasks, position)), fire_many
        if role == "task":
            moves = WRITE_TASK_MACHINE.by_state(WriteTaskTrigger(trigger))
            return (lambda tasks: [moves[t.state] is not None for t in tasks]), fire_many
        return (lambda tasks: [bool(enabled(t)) for t in tasks]), fire_many

    @staticmethod
    def _task_move(trigger: WriteTaskTrigger) -> tuple[Pred, Run]:
        def enabled(task: WriteTask) -> bool:
            return task.can(trigger)

        if trigger is WriteTaskTrigger.HOST_READY:
            return enabled, _fire_host_ready

        if trigger is WriteTaskTrigger.FAIL:
            # Wakes are deferred: operation fail runs them (wake_failed) once
            # its failure record is public.
            def fire(task: WriteTask) -> None:
                task.fire(trigger, defer=True)

        else:

            def fire(task: WriteTask) -> None:
                task.fire(trigger)

        return enabled, fire

    def _holder_move(self, trigger: StagingHolderTrigger) -> tuple[Pred, Run]:
        staging = self._staging

        def enabled(task: WriteTask) -> bool:
            page = task.page
            return page is not None and staging.enabled(trigger, page, StagingBufferHolder.for_task(task.tid))

        def fire(task: WriteTask) -> None:
            page = task.page
            if page is None:
                raise OmniPrefixCacheUnmatchError(f"staging: task {task.tid} holds no page, so it cannot {trigger}")
            staging.fire(trigger, page, StagingBufferHolder.for_task(task.tid))

        return enabled, fire


def _fire_host_ready(task: WriteTask) -> None:
    """Move ``task.host_ready``: it installs the rows the copy stage made
    (copy_to_host); staging views have none: the move waits the step's
    copy event."""
    rows, task.copied_rows = task.copied_rows, ()
    if rows:
        task.set_host_tensor(rows)
    else:
        task.mark_host_ready()


def _host_ready_many() -> AttemptMany:
    """``attempt_many`` of ``task.host_ready``: per task one table lookup,
    then the move itself (``_fire_host_ready``), which re-checks under the
    task's lock. Only the copy's claimant moves a COPYING task on."""
    moves = WRITE_TASK_MACHINE.by_state(WriteTaskTrigger.HOST_READY)

    def attempt_many(tasks: list[WriteTask]) -> list[bool | BaseException]:
        out: list[bool | BaseException] = [True] * len(tasks)
        for i, task in enumerate(tasks):
            if moves[task.state] is None:
                out[i] = False
                continue
            try:
                _fire_host_ready(task)
            except Exception as exc:
                out[i] = exc
        return out

    return attempt_many


@dataclass(frozen=True, eq=False, slots=True)
class ControllerOps:
    """Every operation (or share of one) the controller runs, compiled once
    per controller; ``SegmentRunner`` runs them by segment name."""

    save: CompiledOperation  # the controller's share: register, budget, dispatch
    abandon_save: CompiledOperation  # the controller's share: the refund (cleanup)
    new_step: CompiledOperation  # the controller's share: the kick
    linger: CompiledOperation  # the committer thread's own wake, once queued work waited a whole linger
    escalate: CompiledOperation
    claim: CompiledOperation
    copy: CompiledOperation
    write: CompiledOperation
    eager: CompiledOperation
    fail: CompiledOperation
    join: CompiledOperation
    shutdown: CompiledOperation  # the controller's share: close the staging pool, drain
    # The event a join waits for and the guard that makes it raise.
    join_event: str
    join_raises: Pred

    def pool_write_op(self, eager: bool) -> CompiledOperation:
        """The operation whose pool write (and the segments after it) writes
        a task outside an open pool-write batch: ``eager_run`` on an eager
        controller, else ``committer_write``."""
        return self.eager if eager else self.write


def controller_runner(controller_lock: Any, staging_lock: Any) -> SegmentRunner:
    """The controller's ``SegmentRunner``: ``controller`` is the given lock
    (for a batch, with ``staging`` after it: its holder moves need both),
    ``staging`` the pool's, ``task`` the context task's own (a batch's task
    moves take each task's lock themselves); ``none`` takes nothing and
    ``state`` (the manager's) is held by the caller."""
    return SegmentRunner(
        {
            "controller": LockRule(lock=controller_lock, many=(controller_lock, staging_lock)),
            "staging": LockRule(lock=staging_lock),
            "task": LockRule(take=lambda task: task.lock),
        }
    )


def compile_ops(
    spec: ProtocolSpec,
    binding: ControllerBinding,
    effects: Mapping[str, Run],
    guards: Mapping[str, Pred],
    batch_effects: Mapping[str, BatchRun] | None = None,
    batch_guards: Mapping[str, MaskMany] | None = None,
) -> ControllerOps:
    """Compile the controller's share of ``spec`` (executor ``controller``)
    against ``binding`` and the controller's effect and guard handlers
    (``batch_effects`` / ``batch_guards``: a handler for a whole batch,
    where it has one)."""

    def make(name: str) -> CompiledOperation:
        return compile_operation(
            spec.share("controller", name),
            binding,
            effects,
            guards,
            batch_effects=batch_effects,
            batch_guards=batch_guards,
        )

    join = next((seg for seg in spec.ops["join"].segments if seg.wait), None)
    if join is None or join.raises is None or join.raises not in guards:
        raise SpecError(f"{spec.origin}: operation join must wait for an event and raise on a guard")
    return ControllerOps(
        save=make("save"),
        abandon_save=make("abandon_save"),
        new_step=make("new_step"),
        linger=make("linger"),
        escalate=make("escalate"),
        claim=make("committer_claim"),
        copy=make("committer_copy"),
        write=make("committer_write"),
        eager=make("eager_run"),
        fail=make("fail"),
        join=make("join"),
        shutdown=make("shutdown"),
        join_event=join.wait or "",
        join_raises=guards[join.raises],
    )
