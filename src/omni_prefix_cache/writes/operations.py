"""The controller's side of the composition (spec/protocol.yaml), compiled.

``ControllerBinding`` resolves each ``role.trigger`` the controller's
operations fire to closures over the compiled machines: ``task``
(write_task, on the WriteTask), ``position`` (copy_queue, on the copy
queues) and ``task_holder`` (staging_holder, on the staging pool). Any other
role is not the controller's and fails at compile time. ``compile_ops``
compiles, once per controller, the operations the controller runs:

    escalate, committer_claim, committer_copy, committer_write, eager_run,
    fail, join, shutdown; and of ``save``: the registration (its ``state``
    segment projected on the controller's roles), the budget (its ``none``
    segment) and the dispatch (its ``controller`` segment); of
    ``abandon_save``: the refund.

The controller runs each one segment by segment, taking the lock the
segment declares. ``use_protocol`` swaps the spec later controllers are
compiled from (spec mutants and tests only).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs.batch import (
    AttemptMany,
    Batch,
    BatchRun,
    CompiledBatchOperation,
    MaskMany,
    RunMany,
    attempt_each,
    compile_batch_operation,
    run_segment,
)
from omni_prefix_cache.specs.composition import (
    CompiledOperation,
    ProtocolSpec,
    compile_operation,
    load_protocol,
)
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.types.copy_queue import CopyQueueTrigger
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.specs.types.write_task import WriteTaskTrigger
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool
from omni_prefix_cache.writes.write_task import WRITE_TASK_MACHINE, WriteTask

logger = logging.getLogger(__name__)

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]
Trigger = TypeVar("Trigger", WriteTaskTrigger, CopyQueueTrigger, StagingHolderTrigger)

# The roles whose moves the controller fires, and the effects it performs.
CONTROLLER_ROLES = frozenset({"task", "position", "task_holder"})
CONTROLLER_EFFECTS = frozenset(
    {
        "register_task",
        "charge_budget",
        "flush_oldest",
        "refund_unpinned",
        "unpin_budget",
        "wake_committer",
        "dispatch_inline",
        "copy_to_host",
        "pool_write",
        "publish_completed",
        "publish_failed",
        "wake_failed",
        "close_staging",
        "drain_queues",
    }
)

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
        raise SpecError(f"protocol.yaml: the controller fires no {role}.{trigger} (roles {sorted(CONTROLLER_ROLES)})")

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
class RuntimeOp:
    """A compiled operation (per instance, and for batches) with the lock
    each segment declares."""

    op: CompiledOperation
    batch: CompiledBatchOperation
    locks: tuple[str, ...]
    # The first segment after the one that writes the pool (``pool_write``):
    # where a batch of written tasks resumes.
    tail: int

    @property
    def segments(self) -> tuple[Run, ...]:
        return self.op.segments

    @property
    def admits(self) -> Pred:
        return self.op.admits

    def run_segment(self, index: int, batch: Batch) -> None:
        """Segment ``index`` for ``batch`` (``specs.batch.run_segment``)."""
        run_segment(self.op.segments[index], self.batch.segments[index], batch)


_NO_LOCK = contextlib.nullcontext()


class OpRunner:
    """Runs compiled operations segment by segment, each under the lock it
    declares: ``controller`` and ``staging`` are the given locks, ``task``
    the context task's own; ``none`` takes nothing and ``state`` (the
    manager's) is held by the caller."""

    def __init__(self, controller_lock: Any, staging_lock: Any):
        self._locks = {"controller": controller_lock, "staging": staging_lock}

    def lock_for(self, name: str, ctx: Any) -> Any:
        if name == "task":
            return ctx.lock
        return self._locks.get(name, _NO_LOCK)

    def run(self, op: RuntimeOp, ctx: Any) -> bool:
        """Every segment of ``op`` for ``ctx``; the entry move is checked
        under the first segment's lock. False when it does not admit ``ctx``."""
        first = True
        for name, segment in zip(op.locks, op.segments):
            with self.lock_for(name, ctx):
                if first and not op.admits(ctx):
                    return False
                first = False
                segment(ctx)
        return True

    def run_many(
        self,
        op: RuntimeOp,
        tasks: list[WriteTask],
        *,
        start: int = 0,
        stop: int | None = None,
        truncate: bool = False,
    ) -> Batch:
        """Segments ``[start, stop)`` of ``op`` for a batch of tasks, each
        segment once for the whole batch (``RuntimeOp.run_segment``) under
        the lock it declares (a controller segment takes the staging lock
        with it, in that order, since its holder moves need it; a task
        segment's moves take each task's lock themselves). From segment 0 the entry move is checked
        under the first lock: a task it does not admit is skipped, as
        ``run`` skips it. Returns the batch: what went on, and what left it
        (``errors``, and with ``truncate`` the ``cut`` after the first)."""
        batch = Batch(list(tasks), truncate=truncate)
        stop = len(op.segments) if stop is None else stop
        controller, staging = self._locks["controller"], self._locks["staging"]
        for index in range(start, stop):
            both = (name := op.locks[index]) == "controller"
            with controller if both else self._locks.get(name, _NO_LOCK), staging if both else _NO_LOCK:
                if index == 0 and op.op.spec.entry is not None:
                    admitted = op.batch.admits_many(batch.items)
                    if not all(admitted):
                        batch.items = [t for t, ok in zip(batch.items, admitted) if ok]
                op.run_segment(index, batch)
            if not batch.items:
                break
        return batch

    def finish(self, tasks: list[WriteTask], op: RuntimeOp, on_violation: Callable[[WriteTask], object]) -> None:
        """The segments of ``op`` after its pool write, for tasks whose rows
        are in the pool, batched (``run_many``). A task whose move the state
        no longer allows (it failed meanwhile) goes to ``on_violation`` and
        is dropped."""
        if not tasks:
            return
        batch = self.run_many(op, tasks, start=op.tail)
        for task, exc in batch.errors:
            logger.error("omni prefix cache: finishing the write of task %s: %s", task.tid, exc)
            on_violation(task)


@dataclass(frozen=True, eq=False, slots=True)
class ControllerOps:
    """Every operation (or operation part) the controller runs."""

    register: RuntimeOp
    reserve: RuntimeOp
    dispatch: RuntimeOp
    refund: RuntimeOp
    escalate: RuntimeOp
    claim: RuntimeOp
    copy: RuntimeOp
    write: RuntimeOp
    eager: RuntimeOp
    fail: RuntimeOp
    join: RuntimeOp
    shutdown: RuntimeOp
    # The event a join waits for and the guard that makes it raise.
    join_event: str
    join_raises: Pred

    def pool_write_op(self, eager: bool) -> RuntimeOp:
        """The operation whose pool write (and tail) writes a task outside
        an open pool-write batch: ``eager_run`` on an eager controller,
        else ``committer_write``."""
        return self.eager if eager else self.write


def compile_ops(
    spec: ProtocolSpec,
    binding: ControllerBinding,
    effects: Mapping[str, Run],
    guards: Mapping[str, Pred],
    batch_effects: Mapping[str, BatchRun] | None = None,
    batch_guards: Mapping[str, MaskMany] | None = None,
) -> ControllerOps:
    """Compile the controller's operations of ``spec`` against ``binding``
    and the controller's effect and guard handlers (``batch_effects`` /
    ``batch_guards``: an effect's or a guard's handler for a whole batch,
    where it has one)."""

    def make(name: str, *, lock: str | None = None, project: bool = False) -> RuntimeOp:
        # The per-instance and the batched form compile the same (possibly
        # mutated) operation: which one runs is the executor's choice.
        op = spec.ops[name]
        if lock is not None:
            index = next(i for i, seg in enumerate(op.segments) if seg.lock == lock and not seg.wait)
            op = op.segment(index, f"{name} ({lock} segment)")
        if project:
            op = op.projected(CONTROLLER_ROLES, CONTROLLER_EFFECTS, name=op.name)
        writes = [
            i for i, seg in enumerate(op.segments) if any(getattr(s, "effect", None) == "pool_write" for s in seg.steps)
        ]
        tail = writes[0] + 1 if writes else len(op.segments)
        return RuntimeOp(
            compile_operation(op, binding, effects, guards),
            compile_batch_operation(
                op, binding, effects, guards, batch_effects=batch_effects, batch_guards=batch_guards
            ),
            tuple(seg.lock for seg in op.segments),
            tail,
        )

    join = spec.ops["join"].segments[0]
    if not join.wait or join.raises is None or join.raises not in guards:
        raise SpecError(f"{spec.origin}: operation join must wait for an event and raise on a guard")
    return ControllerOps(
        register=make("save", lock="state", project=True),
        reserve=make("save", lock="none"),
        dispatch=make("save", lock="controller"),
        refund=make("abandon_save", lock="none", project=True),
        escalate=make("escalate"),
        claim=make("committer_claim"),
        copy=make("committer_copy"),
        write=make("committer_write"),
        eager=make("eager_run"),
        fail=make("fail"),
        join=make("join"),
        shutdown=make("shutdown", project=True),
        join_event=join.wait,
        join_raises=guards[join.raises],
    )
