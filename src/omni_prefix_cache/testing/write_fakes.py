"""Fakes of the write path's stages for the harnesses: a copy stage and a
pool-write stage that raise for the tasks a predicate names (fault
injection) and otherwise run the controller's own stage, and a probe of
the controller's joins. Installed through the controller's public API
(``stages.use``, and ``join`` / ``join_host_ready`` shadowed on the
instance), so the runtime keeps its own batched paths."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import Tid
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.writes.host_rows import CopyStage
from omni_prefix_cache.writes.pool_writer import PoolWriteStage
from omni_prefix_cache.writes.write_task import WriteTask

Poisoned = Callable[[WriteTask], bool]


class FailingCopyStage:
    """Effect ``copy_to_host``: raises for a task ``poisoned`` names (before
    any row is copied), else runs ``inner``. ``copying``: the tids whose copy
    stage is running now (a checker's single-claim evidence)."""

    def __init__(self, inner: CopyStage, poisoned: Poisoned) -> None:
        self.inner = inner
        self.poisoned = poisoned
        self.copying: set[Tid] = set()

    def copy_task(self, task: WriteTask) -> None:
        if self.poisoned(task):
            raise RuntimeError(f"injected copy failure (task {task.tid})")
        self.copying.add(task.tid)
        try:
            self.inner.copy_task(task)
        finally:
            self.copying.discard(task.tid)

    def copy_batch(self, batch: Batch) -> None:
        # Task by task, staging views included: a poisoned view fails too.
        guarded_each(batch, self.copy_task)


class FailingPoolWriteStage:
    """Effect ``pool_write``: raises for a task ``poisoned`` names (before it
    joins any pool-write batch), else runs ``inner``."""

    def __init__(self, inner: PoolWriteStage, poisoned: Poisoned) -> None:
        self.inner = inner
        self.poisoned = poisoned

    def write(self, task: WriteTask) -> None:
        if self.poisoned(task):
            raise RuntimeError(f"injected pool write failure (task {task.tid})")
        self.inner.write(task)

    def write_batch(self, batch: Batch) -> None:
        guarded_each(batch, self.write)


def install_failing_stages(
    ctrl: OmniPrefixCacheController, copy: Poisoned, write: Poisoned
) -> tuple[FailingCopyStage, FailingPoolWriteStage]:
    """Wrap the controller's copy and pool-write stages so they raise for
    the tasks ``copy`` / ``write`` name; returns the installed fakes."""
    current = ctrl.parts.stages
    stages = FailingCopyStage(current.copy, copy), FailingPoolWriteStage(current.pool_write, write)
    current.use(copy=stages[0], pool_write=stages[1])
    return stages


def probe_joins(ctrl: OmniPrefixCacheController, probe: Callable[[list[Tid], str], Any]) -> None:
    """Call ``probe(tids, event)`` at the start of every join of ``ctrl``
    (``join``: its event; ``join_host_ready``: "host_ready"), then the join
    the controller had: the manager and the budget flush join through the
    controller's attributes, so every join is seen."""
    join, join_host_ready, event = ctrl.join, ctrl.join_host_ready, ctrl.ops.join_event

    def probed_join(tids: list[Tid]) -> None:
        probe(tids, event)
        join(tids)

    def probed_join_host_ready(tids: list[Tid]) -> None:
        probe(tids, "host_ready")
        join_host_ready(tids)

    ctrl.join = probed_join  # type: ignore[method-assign]
    ctrl.join_host_ready = probed_join_host_ready  # type: ignore[method-assign]
