"""The manager's private names that the upstream test suite reads, calls or
wraps (tests/test_seed_suite.py keeps the upstream spelling): thin aliases of
the components that now own each piece. Nothing in the runtime calls these
except ``_commit_drained_writes``, which stays a facade method so a test can
wrap it on the instance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omni_prefix_cache.interface import ModelCachePolicy, ReqId, TensorName, Tid
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.steps.step_layout import StepLayout, StepOutputs
from omni_prefix_cache.steps.write_ledger import RequestTasks, WriteLedger


class UpstreamSeams:
    """Mixin of OmniPrefixCacheManager: ``_request_tasks``, ``_slot_ref`` and friends."""

    _ledger: WriteLedger
    _reads: HitReads
    _layout: StepLayout
    _policy: ModelCachePolicy

    def _commit_drained_writes(self) -> None:
        """Settle the drained completion and failure records (state lock held)."""
        self._ledger.commit_drained_locked()

    @property
    def _request_tasks(self) -> RequestTasks:
        return self._ledger.requests

    @property
    def _join_next_step_tids(self) -> list[Tid]:
        return self._ledger.previous_step_writes

    @property
    def _pending_reads(self) -> set[PlannedRead]:
        return self._reads.pending

    def _slot_ref(self, slots: torch.Tensor, key: TensorName, req_id: ReqId) -> PlannedRead:
        return self._reads.plan(slots, key, req_id)

    def _fetch_source(self, src: PlannedRead, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._reads.fetch(src, out)

    def _ensure_not_reassigned(self, slots: torch.Tensor, key: TensorName, **kw: Any) -> Any:
        return self._reads.ensure_not_reassigned(slots, key, **kw)

    def _split_step_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        n: int,
        padded: int,
        *,
        slots_cpu: torch.Tensor,
        req_order: Sequence[ReqId],
        num_sched: Mapping[ReqId, int],
        query_start: Mapping[ReqId, int] | None = None,  # upstream's argument; the routing does not need it
    ) -> StepOutputs:
        return self._layout.split(
            self._policy, hidden, mm, n, padded, slots_cpu=slots_cpu, req_order=req_order, num_sched=num_sched
        )
