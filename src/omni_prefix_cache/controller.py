"""The write path's facade: WriteTasks, the staging pool, the GPU-byte
budget, the copy queues and the single committer that writes the CPU block
pool. The manager owns request and slot identity and decides when to
submit; this class runs the writes, on two schedules (``WriteSchedule``):

    JOIN_NEXT_STEP   save already copied the whole step into a staging page
                     (``chunk.host`` views it); the committer waits that
                     copy's event, then writes the pool.
    JOIN_ON_FINISH   rows stay in a device clone; the committer copies them
                     to owned host tensors, then writes the pool.

Every operation is the composition's (spec/protocol.yaml), compiled once per
controller (``writes.operations``; traced by ``writes.op_trace``): a task, its queue
position and its staging hold move only through those compiled segments, each under
the lock it declares. The controller builds its parts and hands each the few it needs:
``task_registry``, ``copy_queues``, ``host_rows`` (copy stage, reads), ``pool_writer``,
``handlers`` (effects, guards), ``committer`` (threaded, manual, on_demand), ``eager``, ``budget``.
It keeps only the operations; the parts its callers use directly (``WriteParts``:
the registry, the budget, the staging pool, the host rows, the committer, the
stages) are in ``parts``, which the manager hands out when it builds its components.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.compat.controller_seams import ControllerSeams
from omni_prefix_cache.compat.controller_seams import controller_module_attr as __getattr__  # noqa: F401 (PEP 562)
from omni_prefix_cache.device import sync
from omni_prefix_cache.device.copy_engine import CopyEngine, default_engine
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    Tid,
    WriteSchedule,
)
from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from omni_prefix_cache.writes.committer import Committer
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.eager import EagerDispatch, EagerRun
from omni_prefix_cache.writes.handlers import WriteHandlers, WriteStages
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.mode import CommitterKind, WriteMode
from omni_prefix_cache.writes.op_trace import compile_controller_ops
from omni_prefix_cache.writes.operations import ControllerBinding, active_protocol, controller_runner
from omni_prefix_cache.writes.pool_writer import PoolWriter
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool, StepD2HClaim
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_task import TaskEvent, TaskState, WriteTask

__all__ = [
    "BudgetTicket",
    "OmniPrefixCacheController",
    "StagingBufferHolder",
    "StagingBufferPool",
    "StepD2HClaim",
    "TaskEvent",
    "TaskState",
    "WriteChunk",
    "WriteParts",
    "WriteSchedule",
    "WriteTask",
]


@dataclass(frozen=True, eq=False)
class WriteParts:
    """The controller's parts its callers hold directly (the manager hands
    each caller the ones it uses): ``registry`` (tasks, completion and
    failure records, under the controller's ``lock``), ``budget``,
    ``staging_pool`` (its own lock), ``host_rows`` (the copy stage, reads of
    unwritten rows, the copy ``engine``), ``committer`` (its units of work,
    for harnesses that step it), ``stages`` (what effects ``copy_to_host``
    and ``pool_write`` call; ``stages.use`` replaces them)."""

    registry: TaskRegistry
    budget: GpuBudget
    staging_pool: StagingBufferPool
    host_rows: HostRows
    committer: Committer
    stages: WriteStages


class OmniPrefixCacheController(ControllerSeams):
    """Staging pool + queues + committer for one manager.

    Locking: ``lock`` (reentrant, shared with the ``wake`` condition) covers
    the task registry, the copy queues, the completion and failure records
    and the budget counter. Never held across a copy, a pool write, a join
    or a budget flush. Each task's own lock covers its state.

    Failures: one record per failure cause (``parts.registry.failures()``),
    not per failed task; records and failed tasks stay until shutdown
    (failure is sticky).
    """

    def __init__(
        self,
        pool: PrefixBlockPool,
        config: PrefixCacheConfig,
        eager: bool | None = None,
        *,
        engine: CopyEngine | None = None,
        committer: CommitterKind = "thread",
        after_write: Callable[[], None] | None = None,
    ):
        if committer not in ("thread", "manual", "on_demand"):
            raise OmniPrefixCacheUnmatchError(f"committer must be 'thread', 'manual' or 'on_demand', got {committer!r}")
        self.pool = pool
        self.config = config
        eager = (not torch.cuda.is_available()) if eager is None else bool(eager)
        self.mode = WriteMode(eager=eager, committer=committer)
        self.lock = sync.RLock()
        self.wake = sync.Condition(self.lock)
        self._registry = TaskRegistry(self.lock)
        self._budget = GpuBudget(config.gpu_staging_bytes, self.lock)
        self._host = HostRows(engine or default_engine(self.mode.eager), config)
        self._staging_pool = StagingBufferPool(
            config.staging_depth,
            config.staging_capacity_tokens,
            engine=self._host.engine,
            claim_timeout_s=config.staging_claim_timeout_s,
        )
        self.queues = CopyQueues()
        self._runner = controller_runner(self.lock, self._staging_pool.lock)
        self._handlers = WriteHandlers(
            registry=self._registry,
            budget=self._budget,
            mode=self.mode,
            wake=self.wake,
            copy_stage=self._host,
            escalate=lambda tids: self.escalate(tids),
            join=lambda tids: self.join(tids),
            drain=lambda: self._committer.drain(self._worker),
            close_staging=self._staging_pool.close,
        )
        self.binding = ControllerBinding(self.queues, self._staging_pool)
        self.ops = compile_controller_ops(active_protocol(), self.binding, self._handlers.tables())
        self._writer = PoolWriter(pool, self._runner, self.ops, self.mode, self.fail_task)
        self._handlers.stages.use(pool_write=self._writer)
        self._eager_dispatch = EagerDispatch(
            EagerRun(self._runner, self.ops.eager, self._writer), self._writer, self.ops.eager, self.fail_tasks
        )
        self._committer = Committer(
            registry=self._registry,
            queues=self.queues,
            ops=self.ops,
            runner=self._runner,
            binding=self.binding,
            writer=self._writer,
            mode=self.mode,
            wake=self.wake,
            fail=self.fail_task,
            timeout_s=config.staging_claim_timeout_s,
            linger_s=config.committer_linger_s,
            after_write=after_write,
        )
        self.parts = WriteParts(
            self._registry, self._budget, self._staging_pool, self._host, self._committer, self._handlers.stages
        )
        self._worker: threading.Thread | None = None
        if not self.mode.eager and committer == "thread":
            self._worker = sync.Thread(target=self._committer.loop, name="omni-prefix-cache-committer", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------ submit

    def register(self, task: WriteTask, queued: bool = True) -> None:
        """Register ``task`` (``save``'s registration, see ``register_many``)."""
        self.register_many([task], queued)

    def register_many(self, tasks: list[WriteTask], queued: bool = True) -> None:
        """Register a step's new writes: operation ``save``'s registration
        steps, per task under one controller and one staging lock. An
        immediate write is queued and binds to its step's staging page; a
        deferred one is queued when ``queued``. Runs no copy (safe under the
        manager's state lock); queued writes then go through ``dispatch``."""
        batch = Batch(list(tasks), truncate=True)
        with self.lock, self._staging_pool.lock:  # save's register segment is under the (caller's) state lock
            self._handlers.registering_queued = queued
            self._runner.run_segment_batch(self.ops.save, "register", batch)
        if batch.errors:
            raise batch.errors[0][1]

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """Hand registered writes to the committer (``save``'s dispatch):
        push and wake; eager, ``eager_run`` inline (never under the manager's
        state lock; see ``EagerDispatch.dispatch`` for its failure rule)."""
        if not tasks:
            return
        batch = Batch(list(tasks), truncate=True)
        inlined = self._handlers.inline
        with self.lock:  # held around the segment's own hold: ``inline`` is read under it
            try:
                self._runner.run_segment_batch(self.ops.save, "dispatch", batch)
            finally:
                inline = inlined.copy()
                inlined.clear()
        if batch.errors:
            raise batch.errors[0][1]
        if inline:
            with torch.inference_mode():
                self._eager_dispatch.dispatch(inline)

    def submit(self, task: WriteTask, queued: bool = True) -> None:
        """``register`` + ``dispatch`` + ``kick`` (a caller driving the
        controller without a manager, not holding the state lock): a queued
        write runs now, not at the next new_step."""
        self.register(task, queued)
        if queued:
            self.dispatch([task])
            self.kick()

    # ------------------------------------------------------------ failure

    def fail_tasks(self, tasks: list[WriteTask], error: BaseException | None) -> None:
        """Operation ``fail`` for every task of ``tasks`` it admits (an eager
        batch, a failed save's registrations), recording ``error`` as the
        cause where it is a write-failed error."""
        for task in tasks:
            self.fail_task(task, error)

    def fail_task(self, task: WriteTask, error: BaseException | None) -> bool:
        """Operation ``fail`` for ``task`` (a no-op once it is terminal, so
        budget is never uncharged twice), ``error`` its recorded cause."""
        self._registry.record_cause(task, error)
        return self._runner.run_all(self.ops.fail, task)

    # ------------------------------------------------------------ budget

    def reserve(self, nbytes: int) -> None:
        """``save``'s budget steps: over budget, flush the oldest unfinished
        tasks (escalate + join) until under budget or none is left; then
        charge ``nbytes``. Blocks: never call under the manager's state lock."""
        self._runner.run(self.ops.save, "budget", nbytes)

    def refund_unpinned(self, tickets: list[BudgetTicket]) -> None:
        """``abandon_save``'s refund: uncharge reservations no task ever pinned
        (a pinned or already freed ticket refunds nothing; its last task does)."""
        self._runner.run(self.ops.abandon_save, "cleanup", tickets)

    # ------------------------------------------------------------ lifecycle

    def escalate(self, tids: list[Tid]) -> None:
        """Operation ``escalate``: put unfinished tasks at the head of the
        high-priority queue. A claimed task is never re-queued: the committer
        claims under the same lock. Eager: ``eager_run`` for the tasks its
        entry admits, inline (outside the manager's state lock)."""
        registered = self._registry.tasks
        tasks = [t for tid in dict.fromkeys(tids) if (t := registered.get(tid)) is not None]  # requests share a step's
        if self.mode.eager:
            if tasks:
                with torch.inference_mode():
                    self._eager_dispatch.dispatch(tasks)
            return
        run, escalate = self._runner.run, self.ops.escalate
        with self.lock:  # one hold; per task in order: each push_head goes before the ones already escalated
            for task in tasks:
                run(escalate, "enqueue", task)

    def kick(self) -> None:
        """new_step's ``kick``: wake the committer, so queued writes run while the forward does. Any thread."""
        self._runner.run(self.ops.new_step, "kick", None)

    def join(self, tids: list[Tid]) -> None:
        """Operation ``join``: kick the committer if a task's pool write is
        not done, then wait for it. Raises if one failed or does not finish
        within ``staging_claim_timeout_s``. Never call under the manager's state lock."""
        self._kick_and_wait(tids, self.ops.join_event)

    def join_host_ready(self, tids: list[Tid]) -> None:
        """Operation ``join`` for a task's host rows (``host_ready``), not its pool write."""
        self._kick_and_wait(tids, "host_ready")

    def _kick_and_wait(self, tids: list[Tid], event: str) -> None:
        registered = self._registry.tasks
        for tid in tids:
            task = registered.get(tid)
            if task is not None and not getattr(task, event).is_set():
                self._runner.run(self.ops.join, "kick", None)
                break
        self._committer.wait(tids, event)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Operation ``shutdown``: close the staging pool (waiting claims
        wake and raise); the committer writes what is queued (threaded: the
        worker drains the queues; manual: drained here); every task still
        unfinished (pending deferred writes, a stuck copy) then fails so no
        joiner hangs."""
        self._runner.run_all(self.ops.shutdown, None)

    # ------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        """Tasks by state, queue depths, staged bytes, holders by kind, records."""
        registry = self._registry
        with self.lock:
            by_state = Counter(t.state.name for t in registry.tasks.values())
            out: dict[str, Any] = {
                "tasks_by_state": {s.name: by_state.get(s.name, 0) for s in TaskState},
                **self.queues.depths(),
                "completed_undrained": len(registry.completed),
                "failed_undrained": len(registry.failed),
                "staged_bytes": self._budget.staged_bytes,
                "budget_flushes": self._budget.flushes,
            }
        out["staging_host_bytes"] = self._staging_pool.host_bytes()
        holders = Counter(h.kind for h in self._staging_pool.holders())
        out["holders"] = {"step": holders.get("step", 0), "task": holders.get("task", 0)}
        out["mode"] = "eager" if self.mode.eager else f"{self.mode.committer}:{self._host.engine.name}"
        return out
