"""The manager's components, named for diagnostics and test harnesses."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import StepId
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.materializer import Materializer
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.reads.tier_fill import TierDesk
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_layout import StepLayout
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.tier.store import HostTier

__all__ = ["ManagerComponents"]


@dataclass(frozen=True)
class ManagerComponents:
    """The manager's components, for diagnostics and the test harnesses
    (``testing/``, ``tools/``): an engine never needs them. Their tables
    are covered by ``state_lock`` (see the module docstring)."""

    controller: OmniPrefixCacheController
    pool: PrefixBlockPool
    occupancy: SlotOccupancy
    ledger: WriteLedger
    reads: HitReads
    hits: HitPlanner
    layout: StepLayout
    materializer: Materializer
    steps: dict[StepId, StepContext]
    requests: RequestTable
    state_lock: threading.Lock
    tier_desk: TierDesk  # the host tier (``tier_desk.tier``: None until tier metadata arrives)

    @property
    def tier(self) -> HostTier | None:
        """The host tier, once a step carried tier metadata."""
        return self.tier_desk.tier
