"""The single committer: operations ``committer_claim``, ``committer_copy``
and ``committer_write`` (spec/protocol.yaml) over the copy queues.

Four ways to run the committer:

    threaded  (eager=False)  a daemon thread serves the queues (CUDA lanes
                             where CUDA exists, host copies on CPU).
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
from typing import TYPE_CHECKING, Literal

import torch

from omni_prefix_cache.interface import OmniPrefixCacheJoinTimeoutError, Tid
from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition import ProtocolViolation
from omni_prefix_cache.writes.write_errors import join_error
from omni_prefix_cache.writes.write_task import WriteTask

if TYPE_CHECKING:
    from omni_prefix_cache.controller import OmniPrefixCacheController

logger = logging.getLogger(__name__)

# How often an on_demand join looks for committer work that another joiner
# made visible after this one found none (test modes only).
_ON_DEMAND_RECHECK_S = 0.005


class Committer:
    """One controller's committer stages. Every task and position move is a
    compiled segment of the controller's operations."""

    def __init__(self, ctrl: OmniPrefixCacheController):
        self._ctrl = ctrl
        self._queues = ctrl.queues
        self._ready = ctrl.binding.move("task", "written")[0]
        # Enabled while a claimed task's copy stage has not finished.
        self._copying = ctrl.binding.move("position", "copied")[0]

    def claim(self) -> Tid | None:
        """``committer_claim``: pop the next entry (high first) and claim its
        copy in the critical section escalate uses; a stale entry is
        dropped. Returns the claimed tid, or None when the queues are empty."""
        ctrl, queues = self._ctrl, self._queues
        segment = ctrl.ops.claim.segments[0]
        with ctrl.lock:
            while (tid := queues.head()) is not None:
                task = ctrl.get_task(tid)
                if task is None:
                    raise ProtocolViolation(f"committer_claim: queued task {tid} is not registered")
                claimed = len(queues.claimed)
                segment(task)
                if len(queues.claimed) > claimed:
                    return tid
                if queues.head() == tid:
                    raise ProtocolViolation(f"committer_claim: no alternative moves the entry of task {tid}")
        return None

    def copy(self) -> Tid | None:
        """``committer_copy`` of the oldest claimed task; a failure fails
        only that task. Returns its tid, or None when nothing is claimed."""
        ctrl = self._ctrl
        with ctrl.lock:
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
        ctrl = self._ctrl
        tasks = [task for tid in tids if (task := ctrl.get_task(tid)) is not None]
        if not tasks:
            return
        try:
            batch = ctrl._runner.run_many(ctrl.ops.copy, tasks)
        except BaseException as interrupt:
            # Which task raised is unknown; a task left claimed is on no
            # queue, so no committer would ever copy it, and its joiners
            # would wait out the whole staging timeout.
            with ctrl.lock:
                stranded = [task for task in tasks if self._copying(task)]
            for task in stranded:
                ctrl.fail_task(task, ctrl.write_error(task, interrupt, "copy"))
            raise
        for task, exc in batch.errors:
            logger.error("omni prefix cache: copy failed for task %s (req %s)", task.tid, task.req_id, exc_info=exc)
            ctrl.fail_task(task, ctrl.write_error(task, exc, "copy"))

    def write(self) -> list[Tid]:
        """``committer_write`` for every blocked task whose write the spec
        allows now; a failing pool write fails only its own task. Returns
        the tids tried."""
        ctrl, queues = self._ctrl, self._queues
        # An eager controller writes what a test staged by hand the way its
        # dispatch would (operation eager_run's tail).
        op = ctrl.ops.eager if ctrl.eager else ctrl.ops.write
        pool_write = op.batch.segments[op.tail - 1]
        with ctrl.lock:
            ready = [t for tid in queues.blocked if (t := ctrl.get_task(tid)) is not None and self._ready(t)]
            if ready:
                taken = {t.tid for t in ready}
                queues.blocked[:] = [tid for tid in queues.blocked if tid not in taken]
        if not ready:
            return []
        # The pass's pool writes join one batch: written once per key, then
        # finished together (the segments after the pool write, batched).
        writes = ctrl._eager_dispatch.open(op)
        batch = Batch(list(ready))
        try:
            # The whole pass at once: each task joins the write batch (see
            # the controller's _scatter_tasks); one whose pool write raises
            # leaves the pass with its error, the others go on.
            pool_write(batch)
        except BaseException as exc:
            # Not an Exception (those stay per task): which task raised is
            # unknown, and letting it escape would strand the joins of every
            # task not yet in the write batch, so those fail with it.
            logger.exception("omni prefix cache: pool write pass failed")
            joined = {id(task) for task in writes.tasks}
            batch.errors.extend((task, exc) for task in batch.items if id(task) not in joined)
        finally:
            ctrl._eager_dispatch.close(writes)
        for task, error in batch.errors:
            logger.error("omni prefix cache: pool write failed for task %s", task.tid, exc_info=error)
            ctrl.fail_task(task, ctrl.write_error(task, error, "pool write"))
        ctrl._eager_dispatch.flush(writes)
        return [t.tid for t in ready]

    def claim_many(self) -> int:
        """``committer_claim`` as one batch in one critical section: every
        entry of the high queue (each is the head at its turn), or, when it
        is empty, the head of the low queue alone (a deferred copy is long:
        an immediate write queued meanwhile must not wait for a batch of
        them). Returns how many entries it took off the queues (claimed,
        or dropped as stale)."""
        ctrl, queues = self._ctrl, self._queues
        segment = ctrl.ops.claim.batch.segments[0]
        with ctrl.lock:
            tids = list(queues.high) if queues.high else list(queues.low)[:1]
            if not tids:
                return 0
            tasks = [ctrl.get_task(tid) for tid in tids]
            missing = [tid for tid, task in zip(tids, tasks) if task is None]
            if missing:
                raise ProtocolViolation(f"committer_claim: queued tasks {missing} are not registered")
            batch = Batch(tasks)
            segment(batch)
            if batch.errors:
                raise batch.errors[0][1]
            if queues.head() in tids:
                raise ProtocolViolation(f"committer_claim: no alternative moves the entry of task {queues.head()}")
            return len(tids)

    def copy_many(self) -> None:
        """``committer_copy`` of every claimed task, as one batch."""
        ctrl = self._ctrl
        with ctrl.lock:
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
        ctrl = self._ctrl
        with ctrl.wake:
            ctrl.stopping = True
            ctrl.wake.notify_all()
        if worker is not None:
            worker.join(timeout=5.0)
        elif not ctrl.eager:
            while self.step() is not None:
                pass
        for task in ctrl.registered():
            ctrl.fail_task(task, None)

    def loop(self) -> None:
        """The committer thread: serve the queues until shutdown and empty."""
        # A dead committer would strand every join, so nothing escapes this
        # loop: each unit attributes its own failure to its own task.
        ctrl, queues = self._ctrl, self._queues
        while True:
            with ctrl.wake:
                while not ctrl.stopping and not queues.has_work():
                    ctrl.wake.wait()
                if ctrl.stopping and not queues.has_work():
                    return
            try:
                with torch.inference_mode():
                    self.step()
            except BaseException:  # a stage that raises has already failed its tasks
                logger.exception("omni prefix cache committer step failed")

    def wait(self, tids: list[Tid], event: Literal["done", "host_ready"]) -> None:
        """Operation ``join``'s wait (``event`` of each task) and its raise
        (guard ``task_failed``): an on_demand joiner first runs committer
        steps itself. Raises the write-failed (or shutdown) error if a task
        failed, ``OmniPrefixCacheJoinTimeoutError`` if one does not reach
        ``event`` within ``staging_claim_timeout_s``."""
        ctrl = self._ctrl
        timeout = ctrl.config.staging_claim_timeout_s
        deadline = time.monotonic() + timeout
        raises = ctrl.ops.join_raises
        for tid in tids:
            task = ctrl.get_task(tid)
            if task is None:
                continue  # drained: already written
            if ctrl.committer_mode == "on_demand" and not ctrl.eager:
                self.step_until(task, event, deadline)
            if not getattr(task, event).wait(max(0.0, deadline - time.monotonic())):
                raise OmniPrefixCacheJoinTimeoutError(
                    f"task {tid} ({task.schedule.value}) did not reach {event} within {timeout:g}s "
                    f"(state={task.state.name}, in_flight_tasks={ctrl.in_flight_tasks()})"
                )
            if raises(task):
                # The one-shot failure record may already be drained
                # elsewhere, so the joiner raises too.
                error = join_error(task, event, ctrl.failure_of(tid), ctrl.stopping)
                raise error from error.__cause__

    def step_until(self, task: WriteTask, event: Literal["done", "host_ready"], deadline: float) -> None:
        """on_demand joins: run committer steps on this thread until the event
        fires. An idle step does not mean the task is stuck: another joiner may
        be mid-copy of it (claimed, not yet queued for its write), so look
        again after a short wait instead of waiting out the whole timeout."""
        done = getattr(task, event)
        with torch.inference_mode():
            while not done.is_set():
                # Through the facade: a test may watch the steps a join takes.
                if self._ctrl.committer_step() is not None:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                done.wait(min(_ON_DEMAND_RECHECK_S, remaining))
