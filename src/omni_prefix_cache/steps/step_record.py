"""A step's requests: the prefix ``Hit`` from lookup to materialize, and
the ``StepRecord`` a save leaves for its materialize.

One ``Hit`` object carries a prefix hit through every stage: the lifecycle
effect ``install_lookup`` creates it (request, tenure, recovery range and
the event's block ids), new_step validates its blocks and registers it with
the hit planner (slots, prefetches), save hands it to its step context and
materialize serves it. ``StepRecord`` is one step's requests as parallel
lists, indexed once by request id.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from omni_prefix_cache.interface import ReqId, TensorName

if TYPE_CHECKING:
    from omni_prefix_cache.requests.tenure import Tenure

__all__ = ["Accepted", "Hit", "StepRecord"]

_NO_SLOTS = torch.empty((0,), dtype=torch.int64)  # never written: a hit not registered yet


@dataclass(eq=False, slots=True)
class Hit:
    """A prefix hit: serve the cached positions ``[hit_start, hit_end)`` of
    ``req_id`` under ``tenure`` (the tenure the event installed it on).

    ``hit_start`` is the recovery start, the lowest consumer watermark of
    the tenure (0 for a fresh one); ``hit_end`` the event's ``hit_end``.
    ``block_ids`` holds the event's per-group block ids until new_step
    validates them (``HitPlanner.hit_blocks``), then the keyed group's ids of the
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


@dataclass(eq=False, slots=True)
class StepRecord:
    """One step's requests, a struct of arrays: entry ``i`` of every list
    is request ``req_ids[i]``, and ``index`` maps each request to its entry.

    The first ``scheduled`` entries are the requests the step computed, in
    row order: rows ``[row_starts[i], row_starts[i] + row_counts[i])`` of
    the step (their slots are the save's to take tenancy with; materialize
    never reads them). After them come the hit requests the step did not
    schedule (no rows: start 0, count 0), each hit carrying its own slots.

    Save fills it under the state lock, in stages: the rows (``of_rows``,
    from the routing), ``hits`` (``add_hits``: each entry's Hit, else None;
    ``any_hit`` says whether one is not None), then ``token_ranges`` and
    ``tenures`` (``record_saved``: the positions ``[start, end)`` the
    step's rows cover, an empty range at the hit end for an unscheduled
    hit, and the tenure, with its owner, each was saved under). Read-only
    once the step is published.

    Speculative decoding: ``drafts`` (request -> its draft rows, the last
    ones of its span) and ``draft_slots`` (their KV slots) for each
    scheduled request with drafts, ``tenancy`` (the save's, slot occupancy)
    and ``saves`` (whether it wrote cached keys): what a materialize or a
    discard needs to reject the rows past each request's accepted end."""

    req_ids: list[ReqId]
    row_starts: list[int]
    row_counts: list[int]
    index: dict[ReqId, int]
    scheduled: int
    hits: list[Hit | None]
    any_hit: bool = False
    token_ranges: list[tuple[int, int]] = field(default_factory=list)
    tenures: list[Tenure] = field(default_factory=list)
    drafts: dict[ReqId, int] = field(default_factory=dict)
    draft_slots: dict[ReqId, torch.Tensor] = field(default_factory=dict)
    tenancy: int = -1
    saves: bool = True

    @classmethod
    def of_rows(cls, req_ids: list[ReqId], spans: dict[ReqId, tuple[int, int]]) -> StepRecord:
        """The scheduled requests ``req_ids`` (row order) with their
        ``(first row, rows)`` spans, as routed (``StepLayout.request_spans``)."""
        k = len(req_ids)
        starts = [spans[r][0] for r in req_ids]
        counts = [spans[r][1] for r in req_ids]
        return cls(list(req_ids), starts, counts, dict(zip(req_ids, range(k))), k, [None] * k)

    def add_hits(self, hits: dict[ReqId, Hit]) -> None:
        """Attach the save's hits (``HitPlanner.attach_to_step``): a hit of
        a scheduled request lands on its entry, any other gets an entry of
        its own, with no rows."""
        if not hits:
            return
        self.any_hit = True
        index, out = self.index, self.hits
        for rid, hit in hits.items():
            i = index.get(rid)
            if i is None:
                index[rid] = len(self.req_ids)
                self.req_ids.append(rid)
                self.row_starts.append(0)
                self.row_counts.append(0)
                out.append(hit)
            else:
                out[i] = hit

    def scheduled_counts(self) -> list[int]:
        """The rows of each scheduled request, in row order."""
        counts = self.row_counts
        return counts if len(counts) == self.scheduled else counts[: self.scheduled]

    def span(self, rid: ReqId) -> tuple[int, int]:
        """``(first row, rows)`` of ``rid`` in the step (KeyError outside it)."""
        i = self.index[rid]
        return self.row_starts[i], self.row_counts[i]

    def hit_of(self, rid: ReqId) -> Hit | None:
        """The hit this step serves ``rid``, else None."""
        return self.hits[self.index[rid]] if self.any_hit else None

    def accepted(self, counts: Mapping[ReqId, int] | None) -> list[Accepted]:
        """Each drafted request's verdict under ``counts`` (request ->
        ``len(sampled_token_ids[i])``: its accepted drafts plus one; None:
        nothing accepted, as a discard without counts): where its valid rows
        end and the slots of the rows past that. A request without a count
        accepts none of its drafts (materialize refuses that beforehand)."""
        out: list[Accepted] = []
        if not self.drafts:
            return out
        for rid, drafts in self.drafts.items():
            i = self.index[rid]
            end = self.token_ranges[i][1] if i < len(self.token_ranges) else 0
            count = 0 if counts is None else counts.get(rid, 0)
            kept = min(max(count - 1, 0), drafts)  # the drafts it accepted
            out.append(Accepted(rid, i, end - drafts + kept, end, self.draft_slots[rid][kept:]))
        return out

    def refused_counts(self, counts: Mapping[ReqId, int] | None, *, need_drafts: bool) -> str:
        """Why ``counts`` do not fit this step ("" when they do): a request
        the step did not save, a count past a request's drafts plus one, or
        (``need_drafts``: materialize) a drafted request without a count.
        Counts are ints of at least 0 already (``validation.as_accepted_rows``)."""
        problems: list[str] = []
        if counts:
            unknown = [r for r in counts if r not in self.index]
            if unknown:
                problems.append(f"requests {unknown[:8]} are not in the step")
            over = [
                f"{r!r}: {k} (drafts {self.drafts.get(r, 0)})"
                for r, k in counts.items()
                if r in self.index and k > self.drafts.get(r, 0) + 1
            ]
            if over:
                problems.append(
                    "more accepted rows than the request's drafts plus one (len(sampled_token_ids[i]) is at most "
                    f"its drafts plus one): {', '.join(over[:8])}"
                )
        if need_drafts:
            missing = [r for r in self.drafts if counts is None or r not in counts]
            if missing:
                problems.append(
                    f"requests {missing[:8]} have speculative drafts this step but no accepted rows (pass "
                    "accepted_rows: len(ModelRunnerOutput.sampled_token_ids[i]) per request; without it rows "
                    "past the accepted end would be served)"
                )
        return "; ".join(problems)


@dataclass(frozen=True, slots=True)
class Accepted:
    """One drafted request's verdict: its entry in the step, where its
    valid rows end (``accepted_end``: the rows before its drafts plus the
    drafts it accepted), its token end as scheduled, and the slots of its
    rejected rows ``[accepted_end, end)``."""

    req_id: ReqId
    index: int
    accepted_end: int
    end: int
    rejected_slots: torch.Tensor
