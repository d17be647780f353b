"""The manager's private names that upstream's test suites read, call or
wrap (tests/test_seed_suite.py keeps the upstream spelling): thin aliases of
the components that now own each piece, built on read. Nothing in the
runtime calls these."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any
from weakref import WeakValueDictionary

import torch

from omni_prefix_cache.compat.controller_seams import request_write_ids
from omni_prefix_cache.interface import ModelCachePolicy, ReqId, StepId, TensorName, Tid
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.requests.tenure import Tenure
from omni_prefix_cache.steps.request_tasks import RequestTasks
from omni_prefix_cache.steps.step_context import StepTable
from omni_prefix_cache.steps.step_layout import StepLayout, StepOutputs
from omni_prefix_cache.steps.write_ledger import WriteLedger


class RequestTasksView:
    """``RequestTasks`` as upstream's tests read it, one write per request:
    ``tasks[req]`` holds the id of every undrained write with the request's
    rows, by tid order (its deferred writes, and its share of each step's
    write: a view id, ``request_write_ids``); ``deferred`` and ``opened``
    are the ledger's own tables. Built on each read, off the hot path."""

    def __init__(self, ledger: WriteLedger) -> None:
        requests: RequestTasks = ledger.requests
        self.deferred = requests.deferred
        self.opened = requests.opened
        self.tasks: dict[ReqId, dict[Tid, None]] = {}
        for tid in sorted(ledger.records):
            for rid, view_tid in request_write_ids(ledger.records[tid].task):
                self.tasks.setdefault(rid, {})[view_tid] = None


class ManagerSeams:
    """Mixin of OmniPrefixCacheManager: ``_request_tasks``, ``_slot_ref`` and friends."""

    _ledger: WriteLedger
    _reads: HitReads
    _layout: StepLayout
    _policy: ModelCachePolicy
    _requests: RequestTable
    _hits: HitPlanner
    _steps: StepTable
    _finish_escalations: tuple[StepId, list[Tid]]

    @property
    def _request_progress(self) -> dict[ReqId, Tenure]:
        """Each request id's current tenure (its ``PrefixCacheRequestProgress``),
        the request table's own dict (read it under the state lock)."""
        return self._requests.current

    @property
    def _finished_progress(self) -> WeakValueDictionary[ReqId, Tenure]:
        """Each id's most recent finished tenure, while an output or a step
        still holds it (weak values: nothing here keeps it alive)."""
        return self._requests.finished

    @property
    def _hit_spans(self) -> dict[ReqId, tuple[int, list[int]]]:
        """The hits registered since the last save, as ``(cached rows, keyed-group
        block ids)`` per request (a copy: the pending hits are the planner's)."""
        return {rid: (hit.num_computed, list(hit.block_ids)) for rid, hit in self._hits.pending.items()}

    @property
    def _hit_prefetch(self) -> dict[ReqId, dict[TensorName, Future[torch.Tensor]]]:
        """The prefetches of those hits, per request and key: each hit's own
        dict of futures, empty while none is planned (a hit on rows its own
        step computes is planned at save, not at new_step_starts)."""
        return {rid: hit.futures for rid, hit in self._hits.pending.items()}

    @property
    def _join_finished_tids(self) -> set[Tid]:
        """The writes finish, abort and retire escalated since the last save
        (upstream joins them at that save; here the escalation alone moves
        them up, eager ones run at once)."""
        step, tids = self._finish_escalations
        return set(tids) if step == self._steps.next_id else set()

    @property
    def _commit_drained_writes(self) -> Callable[[], None]:
        """Settle the drained completion and failure records (state lock
        held): the ledger's ``commit_drained_locked``, which the facade
        calls directly."""
        return self._ledger.commit_drained_locked

    @_commit_drained_writes.setter
    def _commit_drained_writes(self, drain: Callable[[], None]) -> None:
        # Upstream wraps the facade's drain on the instance; the wrapper now
        # shadows the ledger's method on that one ledger, so every drain the
        # facade runs goes through it and nothing is looked up per call.
        self._ledger.commit_drained_locked = drain  # type: ignore[method-assign]

    @property
    def _request_tasks(self) -> RequestTasksView:
        """Upstream's per-request table: each request's share of a step's
        write under its own view id (built on each read, off the hot path)."""
        return RequestTasksView(self._ledger)

    @property
    def _join_next_step_tids(self) -> list[Tid]:
        """The save barrier's writes, one id per request (view ids of the
        previous step's write; see ``request_write_ids``)."""
        ledger = self._ledger
        ids: list[Tid] = []
        for tid in ledger.previous_step_writes:
            rec = ledger.records.get(tid)
            ids.extend([tid] if rec is None else [view for _, view in request_write_ids(rec.task)])
        return ids

    @property
    def _pending_reads(self) -> set[PlannedRead]:
        return self._reads.pending

    def _slot_ref(self, slots: torch.Tensor, key: TensorName, req_id: ReqId) -> PlannedRead:
        return self._reads.plan(slots, key, req_id)

    def _fetch_source(self, src: PlannedRead, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._reads.fetch(src, out)

    def _ensure_not_reassigned(self, slots: torch.Tensor, key: TensorName, **kw: Any) -> Any:
        return self._reads.ensure_not_overwritten(slots, key, **kw)

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
