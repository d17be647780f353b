"""A step's requests: the prefix ``Hit`` from lookup to materialize.

One ``Hit`` object carries a prefix hit through every stage: the lifecycle
effect ``install_lookup`` creates it (request, tenure, recovery range and
the event's block ids), new_step validates its blocks and registers it with
the hit planner (slots, prefetches), save hands it to its step context and
materialize serves it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from omni_prefix_cache.interface import ReqId, TensorName

if TYPE_CHECKING:
    from omni_prefix_cache.requests.tenure import Tenure

__all__ = ["Hit"]

_NO_SLOTS = torch.empty((0,), dtype=torch.int64)  # never written: a hit not registered yet


@dataclass(eq=False, slots=True)
class Hit:
    """A prefix hit: serve the cached positions ``[hit_start, hit_end)`` of
    ``req_id`` under ``tenure`` (the tenure the event installed it on).

    ``hit_start`` is the recovery start, the lowest consumer watermark of
    the tenure (0 for a fresh one); ``hit_end`` the event's ``hit_end``.
    ``block_ids`` holds the event's per-group block ids until new_step
    validates them (``HitPlanner.hit_blocks``), then the group-0 ids of the
    prefix blocks. The planner fills the rest under the state lock:
    ``slots`` (the KV slots of ``[hit_start, hit_end)``), ``num_scheduled``
    (rows its step computes behind the prefix) and, per cached key, the
    prefetch ``futures`` of the ``[prefix | empty tail]`` buffer and the
    planned reads behind them (``refs``)."""

    req_id: ReqId
    hit_start: int
    hit_end: int
    block_ids: Any
    tenure: Tenure | None = None
    slots: torch.Tensor = _NO_SLOTS
    num_scheduled: int = 0
    futures: dict[TensorName, Future[torch.Tensor]] = field(default_factory=dict)
    refs: dict[TensorName, Any] = field(default_factory=dict)  # PlannedRead per key

    @property
    def num_computed(self) -> int:
        """Cached rows served: ``hit_end - hit_start``."""
        return self.hit_end - self.hit_start
