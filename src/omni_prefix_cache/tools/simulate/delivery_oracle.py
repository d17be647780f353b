"""The event API's oracle: every position of every tenure reaches every
consumer exactly once, in order, with the reference row of its content.

A *tenure* here is one request object under one content generation (a new
admission of a reused id is a new request object; a replacement bumps the
generation), keyed by :func:`tenure_key`. The oracle keeps, per tenure, the
prefix hashes of its content and, per consumer, how far it has delivered.

- ``check_output``: a materialized output covers ``[start, end)`` with
  ``end`` the step's computed end and ``start`` at or before the step's
  first computed position; every row equals the reference row.
- ``check_view``: a consumer's view starts exactly where that consumer's
  delivery stands (or at the output's start, past it) and ends at the
  output's end: nothing skipped, nothing twice; its rows are the reference's.
- ``delivered``: what the consumer took (the live requests of a commit, or
  the whole acknowledged view) moves its delivery to the view's end.
- ``finish``: at the end, a finished tenure reached each consumer through
  its last computed position, unless that consumer's commit filtered the
  tenure out (a retired owner).

Discarded steps are noted (``note_discard``); one counts as recovered when
every consumer has received past its end. Threading: the engine thread
registers tenures and discards, the consumer thread checks; one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY
from omni_prefix_cache.tools.simulate.oracle import Mismatch, same_payload
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, rows_from_hashes

CONSUMERS = ("builder", "local")  # the output builder (commit_output) and a lagging local consumer (ack_delivery)


def tenure_key(req: Any) -> tuple[int, int]:
    """The oracle's key of ``req``'s current tenure (object identity and content generation)."""
    return (id(req), int(getattr(req, "generation", 0)))


@dataclass(frozen=True)
class EventExpectation:
    """One request of one saved step: positions ``[start, end)`` computed, under ``key``."""

    req_id: str
    key: tuple[int, int]
    start: int
    end: int  # the accepted end with speculative drafts (the rejected drafts' rows are never returned)
    resumed: bool  # the step's event was RESUMED (the hit may recover delivered-to-nobody rows)


@dataclass
class _Tenure:
    req: Any  # held so its id() is never reused while the oracle runs
    req_id: str
    hashes: PrefixHashes
    delivered: dict[str, int] = field(default_factory=dict)
    filtered: set[str] = field(default_factory=set)
    final: int | None = None  # the last computed position + 1, once the request finished (not aborted)
    discards: list[int] = field(default_factory=list)  # ends of its discarded steps not yet recovered
    # Reference rows of positions [0, n) per key, grown as checks need them (a position's row never changes).
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class DeliveryCounts:
    """What the event API's run did (the report's counts)."""

    resumes_growing: int = 0  # a RESUMED hit served rows some consumer never received, from the cache
    resumes_shrinking: int = 0  # a RESUMED hit at or below the lowest watermark: replayed rows, clipped
    recovered_discards: int = 0  # a discarded step's positions later reached every consumer
    rows_from_cache: int = 0
    delivered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONSUMERS, 0))
    views_dropped: int = 0  # views taken and thrown away unacknowledged (delivered again later)
    filtered: int = 0  # (request, output) pairs a commit filtered (a retired owner)
    finished_checked: int = 0


class DeliveryOracle:
    """Per-tenure, per-consumer delivery checks (see the module docstring)."""

    def __init__(self, widths: dict[str, int], dtype: torch.dtype, *, max_details: int = 20) -> None:
        self.widths = widths
        self.dtype = dtype
        self.max_details = max_details
        self.mismatches = 0
        self.checked_rows = 0
        self.details: list[Mismatch] = []
        self.counts = DeliveryCounts()
        self._tenures: dict[tuple[int, int], _Tenure] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------- engine thread

    def expect(self, req: Any, start: int, end: int, resumed: bool) -> EventExpectation:
        """Register ``req``'s tenure (its content hashes) and return the
        step's expectation: positions ``[start, end)`` (with speculative
        drafts ``end`` is the accepted end)."""
        key = tenure_key(req)
        with self._lock:
            if key not in self._tenures:
                self._tenures[key] = _Tenure(req, req.req_id, req.hashes)
        return EventExpectation(req.req_id, key, start, end, resumed)

    def note_discard(self, exps: list[EventExpectation]) -> None:
        with self._lock:
            for e in exps:
                self._tenures[e.key].discards.append(e.end)

    def finished(self, req: Any) -> None:
        """``req`` finished (not aborted): every consumer must get ``[0, computed)``."""
        with self._lock:
            tenure = self._tenures.get(tenure_key(req))
            if tenure is not None:
                tenure.final = int(req.computed)

    # ----------------------------------------------------- consumer thread

    def _rows(self, tenure: _Tenure, key: str, start: int, end: int) -> torch.Tensor:
        have = tenure.rows.get(key)
        n = 0 if have is None else have.shape[0]
        if end > n:
            grow = max(end, 2 * n)
            more = rows_from_hashes(
                tenure.hashes.span(n, min(grow, len(tenure.hashes))), key, self.widths[key], self.dtype
            )
            have = more if have is None else torch.cat([have, more])
            tenure.rows[key] = have
        assert have is not None
        return have[start:end]

    def _tables(self, outs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in self.widths:
            out[key] = outs.hidden_states if key == HIDDEN_KEY else outs.mm_outputs.get(key)
        return out

    def _check_rows(
        self, step: int, step_id: int, what: str, outs: Any, rid: str, tenure: _Tenure, span: tuple[int, int]
    ) -> list[Mismatch]:
        found: list[Mismatch] = []
        for key, table in self._tables(outs).items():
            got = None if table is None else table.get(rid)
            want = self._rows(tenure, key, *span)
            self.checked_rows += want.shape[0]
            problem = _compare(span, want, got)
            if problem is not None:
                found.append(Mismatch(step, step_id, rid, key, f"{what}: {problem}"))
        return found

    def check_output(
        self, step: int, step_id: int, exps: list[EventExpectation], outs: Any, leftover: dict[str, Any]
    ) -> None:
        """A materialized output's ranges and rows (see the module docstring)."""
        found: list[Mismatch] = []
        with self._lock:
            for e in exps:
                tenure = self._tenures[e.key]
                span = outs.token_ranges.get(e.req_id)
                sched = outs.scheduled_token_ranges.get(e.req_id)
                end = e.end
                if span is None or sched != (e.start, end) or not 0 <= span[0] <= e.start or span[1] != end:
                    detail = f"output range {span} scheduled {sched}, computed [{e.start}, {e.end})"
                    found.append(Mismatch(step, step_id, e.req_id, "token_ranges", detail))
                    continue
                found += self._check_rows(step, step_id, "output", outs, e.req_id, tenure, span)
                self.counts.rows_from_cache += e.start - span[0]
                if e.resumed:
                    if span[0] < e.start:
                        self.counts.resumes_growing += 1
                    else:
                        self.counts.resumes_shrinking += 1
                for key, want in leftover.items():
                    got = outs.mm_outputs.get(key, {}).get(e.req_id)
                    if not same_payload(got, want):
                        found.append(Mismatch(step, step_id, e.req_id, key, f"leftover {got!r}, expected {want!r}"))
            self._record(found)

    def check_view(
        self, step: int, step_id: int, consumer: str, exps: list[EventExpectation], outs: Any, view: Any
    ) -> None:
        """A consumer's view of ``outs``: exactly the positions it has not
        received (a gap must have raised), with the reference rows."""
        found: list[Mismatch] = []
        with self._lock:
            for e in exps:
                tenure = self._tenures[e.key]
                span = view.token_ranges.get(e.req_id)
                start, end = outs.token_ranges[e.req_id]
                seen = tenure.delivered.get(consumer, 0)
                if span != (min(end, max(start, seen)), end) or (start > seen and end > seen):
                    detail = f"view {span} of output [{start}, {end}) for {consumer!r}, which received [0, {seen})"
                    found.append(Mismatch(step, step_id, e.req_id, "delivery", detail))
                    continue
                found += self._check_rows(step, step_id, f"view of {consumer}", view, e.req_id, tenure, span)
            self._record(found)

    def delivered(self, consumer: str, exps: list[EventExpectation], view: Any, live: frozenset[str] | None) -> None:
        """The consumer took ``view`` (only the ``live`` requests of a commit; all when None)."""
        with self._lock:
            for e in exps:
                tenure = self._tenures[e.key]
                if live is not None and e.req_id not in live:
                    tenure.filtered.add(consumer)
                    self.counts.filtered += 1
                    continue
                start, end = view.token_ranges[e.req_id]
                seen = tenure.delivered.get(consumer, 0)
                if end > seen:
                    self.counts.delivered[consumer] += end - max(start, seen)
                    tenure.delivered[consumer] = end
                    if tenure.final is not None and all(tenure.delivered.get(c, 0) >= tenure.final for c in CONSUMERS):
                        tenure.rows.clear()  # delivered everywhere: no later check reads it
                while tenure.discards and all(tenure.delivered.get(c, 0) >= tenure.discards[0] for c in CONSUMERS):
                    tenure.discards.pop(0)
                    self.counts.recovered_discards += 1

    def view_dropped(self) -> None:
        with self._lock:
            self.counts.views_dropped += 1

    # ----------------------------------------------------------- the end

    def finish(self) -> None:
        """Every finished tenure reached every consumer that did not filter it, through its end."""
        found: list[Mismatch] = []
        with self._lock:
            for tenure in self._tenures.values():
                if tenure.final is None:
                    continue
                self.counts.finished_checked += 1
                for consumer in CONSUMERS:
                    got = tenure.delivered.get(consumer, 0)
                    if consumer not in tenure.filtered and got != tenure.final:
                        detail = f"{consumer!r} received [0, {got}) of a finished [0, {tenure.final})"
                        found.append(Mismatch(-1, -1, tenure.req_id, "delivery", detail))
            self._record(found)

    def _record(self, found: list[Mismatch]) -> None:
        self.mismatches += len(found)
        room = self.max_details - len(self.details)
        if room > 0:
            self.details.extend(found[:room])


def _compare(span: tuple[int, int], want: torch.Tensor, got: Any) -> str | None:
    where = f"positions [{span[0]}, {span[1]})"
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor for {where}, got {type(got).__name__}"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)} for {where}"
    if torch.equal(got, want):
        return None
    same = (got == want).all(dim=1)
    if bool(same.all()):
        return None
    bad = int((~same).nonzero()[0, 0])
    return f"first wrong row at position {span[0] + bad}; {int((~same).sum())} wrong rows of {where}"
