"""The manager's operator view: ``stats()`` and ``stats_snapshot()`` (any
thread, takes the state lock briefly), its keyed KV cache group and its
components (a mixin of OmniPrefixCacheManager)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import ReqId, StepId
from omni_prefix_cache.ops.components import ManagerComponents
from omni_prefix_cache.ops.stats import MANAGER_COUNTERS, CacheStats
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.materializer import Materializer
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.reads.tier_fill import TierDesk
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_layout import StepLayout
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.telemetry.registry import TELEMETRY


class ManagerStats:
    """Mixin: the counters, gauges and the controller's snapshot."""

    _state_lock: threading.Lock
    _ledger: WriteLedger
    _counters: Counter[str]
    _live: set[ReqId]
    _step_ctxs: dict[StepId, StepContext]
    _pool: PrefixBlockPool
    _controller: OmniPrefixCacheController
    _requests: RequestTable
    _tier_desk: TierDesk
    _group_index: int
    _slot_status: SlotOccupancy
    _reads: HitReads
    _hits: HitPlanner
    _layout: StepLayout
    _materializer: Materializer

    @property
    def kv_cache_group_index(self) -> int:
        """The KV cache group whose slots key the rows
        (``PrefixCacheConfig.kv_cache_group_index``). Any thread."""
        return self._group_index

    @property
    def components(self) -> ManagerComponents:
        """The components this manager delegates to (diagnostics, tests)."""
        return ManagerComponents(
            controller=self._controller,
            pool=self._pool,
            occupancy=self._slot_status,
            ledger=self._ledger,
            reads=self._reads,
            hits=self._hits,
            layout=self._layout,
            materializer=self._materializer,
            steps=self._step_ctxs,
            requests=self._requests,
            state_lock=self._state_lock,
            tier_desk=self._tier_desk,
        )

    def stats(self) -> dict[str, Any]:
        """Metrics an operator would export, as a dict (any thread; takes the
        state lock briefly): every :class:`CacheStats` field by name, plus
        the historical keys: prefix queries and hits (requests, tokens), steps saved /
        materialized / discarded, tokens saved, rows committed to the pool
        (rows x keys), failed writes, live requests, open steps, and the
        controller's snapshot (tasks by state, queue depths, staged bytes,
        staging holders by kind). A write failure the committer recorded
        counts at once (``failed_writes``, ``sticky_failure``), before any
        serving entry drains it."""
        out = self._raw_stats()
        out.update(CacheStats.from_stats(out).as_dict())
        return out

    def stats_snapshot(self) -> CacheStats:
        """``stats()`` as a typed, frozen snapshot (Prometheus-style names)."""
        return CacheStats.from_stats(self._raw_stats())

    def _raw_stats(self) -> dict[str, Any]:
        """The historical ``stats()`` keys; CacheStats is derived from them."""
        with self._state_lock:
            # Report a failure the committer recorded but no entry drained yet.
            self._ledger.drain_failures_locked()
            out: dict[str, Any] = {name: self._counters.get(name, 0) for name in MANAGER_COUNTERS}
            out["live_requests"] = len(self._live)
            out["open_steps"] = len(self._step_ctxs)
            out["sticky_failure"] = self._ledger.failure is not None
            out["delivery_consumers"] = len(self._requests.consumers)
            out["delivery_consumers_forgotten"] = self._requests.consumers_forgotten
            out.update(self._tier_desk.stats())
        key_bytes = self._pool.key_nbytes()
        out["pool_host_bytes"] = sum(key_bytes.values())  # unpinned
        out.update(self._controller.stats())
        out["pool_key_bytes"] = key_bytes
        out["metrics"] = TELEMETRY.summary()
        return out
