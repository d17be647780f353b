"""The controller's private names that upstream tests read or wrap (the
seed suite, the racing tests): aliases of the components that now own them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import Tid
from omni_prefix_cache.writes.budget import GpuBudget
from omni_prefix_cache.writes.committer import Committer
from omni_prefix_cache.writes.copy_queues import CopyQueues
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.write_task import WriteTask


class UpstreamSeams:
    """Mixin of OmniPrefixCacheController: ``_queue_hi`` and friends."""

    queues: CopyQueues
    eager: bool
    _host: HostRows
    _budget: GpuBudget
    _committer: Committer
    _tasks: dict[Tid, WriteTask]
    fail_task: Callable[[WriteTask, BaseException | None], bool]

    @property
    def _queue_hi(self) -> deque[Tid]:
        return self.queues.high

    @property
    def _queue_lo(self) -> deque[Tid]:
        return self.queues.low

    @property
    def _claimed(self) -> deque[Tid]:
        return self.queues.claimed

    @property
    def _blocked(self) -> list[Tid]:
        return self.queues.blocked

    @property
    def _eager(self) -> bool:
        return self.eager

    @_eager.setter
    def _eager(self, value: bool) -> None:
        self.eager = value

    @property
    def _engine(self) -> CopyEngine:
        return self._host.engine

    @_engine.setter
    def _engine(self, engine: CopyEngine) -> None:
        self._host.engine = engine

    @property
    def _staged_bytes(self) -> int:
        return self._budget.staged_bytes

    def _release_staged_bytes(self, task: WriteTask) -> None:
        """Effect ``unpin_budget`` for ``task``."""
        self._budget.unpin(task)

    def _fail_task(self, tid: Tid | None) -> None:
        """Operation ``fail`` by tid, with no cause."""
        task = self._tasks.get(tid) if tid is not None else None
        if task is not None:
            self.fail_task(task, None)

    def _scatter_host_ready(self) -> list[Tid]:
        """Operation ``committer_write`` (``Committer.write``)."""
        return self._committer.write()
