"""The single committer: operations ``committer_claim``, ``committer_copy``
and ``committer_write`` (spec/protocol.yaml) over the copy queues.

Four ways to run the committer:

    threaded  (eager=False)  a daemon thread serves the queues (CUDA lanes
                             where CUDA exists, host copies on CPU). It runs
                             when kicked (new_step's end, a joiner, shutdown)
                             and, without a kick, once queued work waited a
                             whole linger (operation ``linger``), so an idle
                             engine's last writes land by themselves.
    manual    (eager=False, committer="manual")  no thread; a test drives
                             ``committer_claim`` / ``committer_copy`` /
                             ``committer_write`` to pick the interleaving.
    on_demand (eager=False, committer="on_demand")  as manual, but a join
                             first runs committer steps on the joining
                             thread until the awaited event fires or the
                             committer is idle: single-threaded runs of the
                             whole manager whose interleaving a test picks.
    eager     (eager=True)   ``dispatch`` runs copy and pool write inline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from omni_prefix_cache.interface import OmniPrefixCacheJoinTimeoutError, Tid
from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition import ProtocolViolation
from omni_prefix_cache.specs.runner import SegmentRunner
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.mode import WriteMode
from omni_prefix_cache.writes.operations import ControllerBinding, ControllerOps
from omni_prefix_cache.writes.pool_writer import FailTask, PoolWriter
from omni_prefix_cache.writes.task_registry import TaskRegistry
from omni_prefix_cache.writes.write_errors import join_error, write_error
from omni_prefix_cache.writes.write_task import WriteTask

logger = logging.getLogger(__name__)

# How often an on_demand join looks for committer work that another joiner
# made visible after this one found none (test modes only).
_ON_DEMAND_RECHECK_S = 0.005

Event = Literal["done", "host_ready"]


class Committer:
    """One controller's committer stages over ``queues``. Every task and
    position move is a compiled segment of ``ops``, run by ``runner``;
    written tasks' rows go through ``writer``'s batches; a task whose copy
    or pool write raised goes to ``fail`` with its cause.

    ``wake`` is the condition over the controller lock (``registry.lock``)
    that a kick notifies (new_step's end, a joiner, shutdown) and the committer thread waits on,
    at most ``linger_s`` at a time (see ``loop``).
    ``after_write`` (optional) is what the thread calls, with no lock held,
    after a pass that wrote: the manager's drain.
    """

    def __init__(
        self,
        *,
        registry: TaskRegistry,
        queues: CopyQueues,
        ops: ControllerOps,
        runner: SegmentRunner,
        binding: ControllerBinding,
        writer: PoolWriter,
        mode: WriteMode,
        wake: Any,
        fail: FailTask,
        timeout_s: float,
        linger_s: float = 0.05,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        self._registry = registry
        self._lock = registry.lock
        self._queues = queues
        self._ops = ops
        self._runner = runner
        self._writer = writer
        self._mode = mode
        self._wake = wake
        self._fail = fail
        self._timeout_s = timeout_s
        self._linger_s = float(linger_s)
        self._ready = binding.move("task", "written")[0]
        # Enabled while a claimed task's copy stage has not finished.
        self._copying = binding.move("position", "copied")[0]
        self.stopping = False  # set once by ``drain`` (shutdown), under ``wake``
        # The thread's call after a pass that wrote (no lock held): the
        # manager's operation drain, when its state lock is free.
        self._after_write = after_write

    def claim(self) -> Tid | None:
        """``committer_claim``: pop the next entry (high first) and claim its
        copy in the critical section escalate uses; a stale entry is
        dropped. Returns the claimed tid, or None when the queues are empty."""
        queues, registered = self._queues, self._registry.tasks
        run, claim = self._runner.run, self._ops.claim
        with self._lock:
            while (tid := queues.head()) is not None:
                task = registered.get(tid)
                if task is None:
                    raise ProtocolViolation(f"committer_claim: queued task {tid} is not registered")
                claimed = len(queues.claimed)
                run(claim, "claim", task)
                if len(queues.claimed) > claimed:
                    return tid
                if queues.head() == tid:
                    raise ProtocolViolation(f"committer_claim: no alternative moves the entry of task {tid}")
        return None

    def copy(self) -> Tid | None:
        """``committer_copy`` of the oldest claimed task; a failure fails
        only that task. Returns its tid, or None when nothing is claimed."""
        with self._lock:
            tid = self._queues.take_claimed()
        if tid is not None:
            self._copy([tid])
        return tid

    def _copy(self, tids: list[Tid]) -> None:
        """``committer_copy`` of the claimed ``tids`` as one batch (their
        copy stages already taken off the claimed list); an Exception fails
        only its own task. A BaseException (KeyboardInterrupt, SystemExit)
        stops the pass where it was: every task of it whose copy stage did
        not finish fails with it, then it propagates (the thread's loop
        logs it and serves on)."""
        registered = self._registry.tasks
        tasks = [task for tid in tids if (task := registered.get(tid)) is not None]
        if not tasks:
            return
        try:
            batch = self._runner.run_batch(self._ops.copy, tasks)
        except BaseException as interrupt:
            # Which task raised is unknown; a task left claimed is on no
            # queue, so no committer would ever copy it, and its joiners
            # would wait out the whole staging timeout.
            with self._lock:
                stranded = [task for task in tasks if self._copying(task)]
            for task in stranded:
                self._fail(task, write_error(task, interrupt, "copy"))
            raise
        for task, exc in batch.errors:
            logger.error(
                "omni prefix cache: copy failed for task %s (%s)", task.tid, task.describe_requests(), exc_info=exc
            )
            self._fail(task, write_error(task, exc, "copy"))

    def write(self) -> list[Tid]:
        """``committer_write`` for every blocked task whose write the spec
        allows now; a failing pool write fails only its own task. Returns
        the tids tried."""
        queues, registered, writer = self._queues, self._registry.tasks, self._writer
        # An eager controller writes what a test staged by hand the way its
        # dispatch would (operation eager_run's tail).
        op = self._ops.pool_write_op(self._mode.eager)
        with self._lock:
            ready = [t for tid in queues.blocked if (t := registered.get(tid)) is not None and self._ready(t)]
            if ready:
                taken = {t.tid for t in ready}
                queues.blocked[:] = [tid for tid in queues.blocked if tid not in taken]
        if not ready:
            return []
        # The pass's pool writes join one batch: written once per key, then
        # finished together (the segments after the pool write, batched).
        writes = writer.open(op)
        batch = Batch(list(ready))
        try:
            # The whole pass at once: each task joins the write batch (see
            # PoolWriter.write_batch); one whose pool write raises leaves the
            # pass with its error, the others go on.
            self._runner.run_segment_batch(op, "pool_write", batch)
        except BaseException as exc:
            # Not an Exception (those stay per task): which task raised is
            # unknown, and letting it escape would strand the joins of every
            # task not yet in the write batch, so those fail with it.
            logger.exception("omni prefix cache: pool write pass failed")
            joined = {id(task) for task in writes.tasks}
            batch.errors.extend((task, exc) for task in batch.items if id(task) not in joined)
        finally:
            writer.close(writes)
        for task, error in batch.errors:
            logger.error("omni prefix cache: pool write failed for task %s", task.tid, exc_info=error)
            self._fail(task, write_error(task, error, "pool write"))
        writer.land(writes)
        return [t.tid for t in ready]

    def claim_many(self) -> int:
        """``committer_claim`` as one batch in one critical section: every
        entry of the high queue (each is the head at its turn), or, when it
        is empty, the head of the low queue alone (a deferred copy is long:
        an immediate write queued meanwhile must not wait for a batch of
        them). Returns how many entries it took off the queues (claimed,
        or dropped as stale)."""
        queues, registered = self._queues, self._registry.tasks
        with self._lock:
            tids = list(queues.high) if queues.high else list(queues.low)[:1]
            if not tids:
                return 0
            tasks = [registered.get(tid) for tid in tids]
            missing = [tid for tid, task in zip(tids, tasks) if task is None]
            if missing:
                raise ProtocolViolation(f"committer_claim: queued tasks {missing} are not registered")
            batch = Batch(tasks)
            self._runner.run_segment_batch(self._ops.claim, "claim", batch)
            if batch.errors:
                raise batch.errors[0][1]
            if queues.head() in tids:
                raise ProtocolViolation(f"committer_claim: no alternative moves the entry of task {queues.head()}")
            return len(tids)

    def copy_many(self) -> None:
        """``committer_copy`` of every claimed task, as one batch."""
        with self._lock:
            tids = list(self._queues.claimed)
            self._queues.claimed.clear()
        self._copy(tids)

    def step(self) -> str | None:
        """One unit of committer work on the calling thread: the copy stage
        of every claimed task first, then pending pool writes, else claim
        and copy every queued task (each stage one batch). Returns "copy",
        "write" or None when idle."""
        if self._queues.claimed:
            self.copy_many()
            return "copy"
        if self.write():
            return "write"
        if self.claim_many():
            self.copy_many()
            return "copy"
        return None

    def drain(self, worker: threading.Thread | None) -> None:
        """Effect ``drain_queues``: the committer finishes what is queued
        (the thread drains, or this thread steps), then every task still
        unfinished runs operation ``fail`` so no joiner hangs."""
        with self._wake:
            self.stopping = True
            self._wake.notify_all()
        if worker is not None:
            worker.join(timeout=5.0)
        elif not self._mode.eager:
            while self.step() is not None:
                pass
        for task in self._registry.registered():
            self._fail(task, None)

    def loop(self) -> None:
        """The committer thread: serve the queues until shutdown and empty.
        Kicked, it runs until the queues are empty; without a kick, queued
        work runs once it waited a whole linger (``_await_work``)."""
        # A dead committer would strand every join, so nothing escapes this
        # loop: each unit attributes its own failure to its own task.
        queues, wake = self._queues, self._wake
        # Kicked (or lingered), and the queues have not run empty since. True at the start: a kick that
        # came before the thread first waited found no waiter to notify.
        active = True
        while True:
            with wake:
                active = self._await_work(active)
                if self.stopping and not queues.has_work():
                    return
            try:
                with torch.inference_mode():
                    done = self.step()
                if done == "write" and self._after_write is not None:
                    self._after_write()
            except BaseException:  # a stage that raises has already failed its tasks
                logger.exception("omni prefix cache committer step failed")

    def _await_work(self, active: bool) -> bool:
        """Under ``wake``: wait until there is work the thread may run now,
        or shutdown. Work runs at once when the thread was kicked (``active``,
        or a notify while waiting). A save queues its writes without a kick
        (new_step's end is the kick: the forward is the committer's time), so
        each wait lasts at most ``linger_s``; when one runs out with work
        queued and the next runs out too with work still queued and no kick
        between, the thread wakes itself (operation ``linger``): a write waits
        at most 2 x ``linger_s`` without a following step. Returns whether
        the thread is active."""
        queues, wake, linger = self._queues, self._wake, self._linger_s
        seen = False  # the last wait ran out with work queued
        while not self.stopping:
            if queues.has_work():
                if active:
                    return True
            else:
                active = seen = False
            if wake.wait(linger):
                active = True  # a kick (new_step's end, a joiner)
            elif not queues.has_work():
                seen = False
            elif seen:
                self._runner.run(self._ops.linger, "wake", None)
                active = True
            else:
                seen = True
        return active

    def wait(self, tids: list[Tid], event: Event) -> None:
        """Operation ``join``'s wait (``event`` of each task) and its raise
        (guard ``task_failed``): an on_demand joiner first runs committer
        steps itself. Raises the write-failed (or shutdown) error if a task
        failed, ``OmniPrefixCacheJoinTimeoutError`` if one does not reach
        ``event`` within the staging timeout."""
        registry, mode = self._registry, self._mode
        timeout = self._timeout_s
        deadline = time.monotonic() + timeout
        raises = self._ops.join_raises
        for tid in tids:
            task = registry.tasks.get(tid)
            if task is None:
                continue  # drained: already written
            if mode.committer == "on_demand" and not mode.eager:
                self.step_until(task, event, deadline)
            if not getattr(task, event).wait(max(0.0, deadline - time.monotonic())):
                raise OmniPrefixCacheJoinTimeoutError(
                    f"task {tid} ({task.schedule.value}) did not reach {event} within {timeout:g}s "
                    f"(state={task.state.name}, in_flight_tasks={len(registry.tasks)})"
                )
            if raises(task):
                # The one-shot failure record may already be drained
                # elsewhere, so the joiner raises too.
                error = join_error(task, event, registry.failure_of(tid), self.stopping)
                raise error from error.__cause__
        trace = TELEMETRY.trace
        if trace is not None:  # the save barrier's order is judged from this (docs/trace.md)
            trace.waited(event, tids)

    def step_until(self, task: WriteTask, event: Event, deadline: float) -> None:
        """on_demand joins: run committer steps on this thread until the event
        fires. An idle step does not mean the task is stuck: another joiner may
        be mid-copy of it (claimed, not yet queued for its write), so look
        again after a short wait instead of waiting out the whole timeout."""
        done = getattr(task, event)
        with torch.inference_mode():
            while not done.is_set():
                if self.step() is not None:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                done.wait(min(_ON_DEMAND_RECHECK_S, remaining))
