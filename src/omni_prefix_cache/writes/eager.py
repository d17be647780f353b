"""Eager dispatch: operation ``eager_run`` (spec/protocol.yaml) for each of
a dispatch's tasks on the calling thread, with the pool written once per key
for the whole dispatch (effect ``pool_write`` joins the open batch of the
``PoolWriter``)."""

from __future__ import annotations

from collections.abc import Callable

from omni_prefix_cache.specs.composition import CompiledOperation
from omni_prefix_cache.specs.runner import SegmentRunner
from omni_prefix_cache.writes.pool_writer import PoolWriter
from omni_prefix_cache.writes.write_errors import write_error
from omni_prefix_cache.writes.write_task import WriteTask

# Operation ``fail`` for each of the tasks, with their cause (the controller's fail_tasks).
FailTasks = Callable[[list[WriteTask], BaseException | None], None]
# Operation ``eager_run`` for a task or a dispatch's tasks (``EagerRun``).
RunEager = Callable[[WriteTask | list[WriteTask]], None]


class EagerRun:
    """Operation ``eager_run`` for the tasks its entry admits, as one batch
    (``SegmentRunner.run_batch``) on the calling thread. Inside a dispatch (a
    pool-write batch open on this thread) it stops at the pool write (the
    batch's ``land`` finishes the writes) and hands the batch the first task
    that failed; on its own it runs to the end and raises that task's
    exception."""

    def __init__(self, runner: SegmentRunner, op: CompiledOperation, writer: PoolWriter) -> None:
        self._runner = runner
        self._op = op
        self._writer = writer

    def __call__(self, tasks: WriteTask | list[WriteTask]) -> None:
        op = self._op
        items = tasks if isinstance(tasks, list) else [tasks]
        run = self._runner.run_batch(op, items, stop="publish", truncate=True)
        if run.errors:
            outer = self._writer.open_batch()
            if outer is None:
                raise run.errors[0][1]
            outer.errors.extend(run.errors)


class EagerDispatch:
    """Runs ``eager_run`` for a controller's dispatched tasks through
    ``run`` (an ``EagerRun``) inside one pool-write batch of ``writer``, and
    applies the dispatch's failure rule through ``fail_tasks``."""

    def __init__(self, run: RunEager, writer: PoolWriter, op: CompiledOperation, fail_tasks: FailTasks) -> None:
        self._run = run
        self._writer = writer
        self._op = op
        self._fail_tasks = fail_tasks

    @property
    def run(self) -> RunEager:
        """What the dispatch runs its tasks' ``eager_run`` through."""
        return self._run

    def dispatch(self, tasks: list[WriteTask]) -> None:
        """``eager_run`` for the tasks, batched; if one fails, every task of
        the dispatch not yet written fails too before the error (naming the
        failed task, its cause as ``__cause__``) propagates. Tasks before it
        in dispatch order keep their rows, as if run one by one. Never call
        under the manager's state lock."""
        writer = self._writer
        # A task listed twice runs once (its entry move admits it once).
        tasks = list(dict.fromkeys(tasks))
        batch = writer.open(self._op)
        try:
            self._run(tasks)
        except BaseException as exc:
            # Raised outside any one task's steps: no task to name.
            writer.close(batch)
            writer.land(batch)
            self._fail_tasks(tasks, exc)
            raise
        writer.close(batch)
        if batch.errors:
            current, cause = batch.errors[0]
            # Tasks written before the failure keep their rows; the rest
            # fail (releasing budget and staging holds) before the error
            # reaches the caller.
            writer.land(batch)
            error = write_error(current, cause, "copy")
            self._fail_tasks(tasks, error)
            raise error
        try:
            writer.land(batch, reraise=True)
        except BaseException as exc:
            self._fail_tasks(tasks, exc)
            raise
