"""The protocol tests' engine adapter and tenure oracle.

``EventEngine`` plays what vLLM-Omni's scheduler adapter hands the manager:
each ``ServingModel`` step becomes a ``PrefixCacheStep`` of owned events
(STARTED with the lookup, EXTENDED, RESUMED with the hit the resumed request
found, FINISHED or ABORTED of the owner that ended, REPLACED controls), with
an increasing step sequence. It also makes the events a real adapter drops
before the manager sees them (an older owner's, a replayed step), so the
manager's own guards are what the tests judge.

``TenureOracle`` is the reference for the request lifecycle and delivery:
one ``OracleTenure`` per (request id, owner), updated from the events the
engine sent, the saves and the acknowledgements, with no cache at all. It
says where a materialized output must start (a RESUMED hit recovers from the
lowest watermark of the consumers the manager has seen) and, per consumer, what
each view must hold.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
)
from omni_prefix_cache.spec_decode import draft_counts
from omni_prefix_cache.testing.serving_model import ModelRequest, SchedOut, ServingModel

K = PrefixCacheEventKind
Owner = PrefixCacheRequestOwner
# talker: takes every output when it is materialized; client: lags behind.
CONSUMERS = ("talker", "client")


@dataclass(eq=False)
class OracleTenure:
    """What the reference knows of one tenure: the highest token end saved
    and served from the cache, each consumer's watermark and the manager's
    own tenure object."""

    rid: str
    owner: Owner
    admitted: bool = False  # ADMITTED: opened by a control, lookup pending
    finished: bool = False
    retired: bool = False
    saved: int = 0
    served: int = 0
    wm: dict[str, int] = field(default_factory=dict)
    runtime: Any = None

    def lowest(self, consumers: set[str]) -> int:
        """Where a recovered hit starts: the least any consumer received,
        every consumer the manager has seen (``consumers``) counting."""
        return min((self.wm.get(c, 0) for c in consumers | {c for c, w in self.wm.items() if w}), default=0)

    def bound(self) -> int:
        """No watermark may pass this: what was saved or served."""
        return max(self.saved, self.served)

    def __repr__(self) -> str:
        state = "RETIRED" if self.retired else "FINISHED" if self.finished else "open"
        return f"<{self.rid} owner {self.owner.admission_id}.{self.owner.generation} {state} wm={self.wm}>"


class TenureOracle:
    """Tenures by request id (the current or last finished one) and every
    tenure ever opened (``every``), moved as the spec says the events move
    them; ``consumers``: every consumer that asked for a delivery view."""

    def __init__(self) -> None:
        self.current: dict[str, OracleTenure] = {}
        self.every: list[OracleTenure] = []
        self.consumers: set[str] = set()

    def _open(self, rid: str, owner: Owner) -> OracleTenure:
        old = self.current.get(rid)
        if old is not None:
            old.retired = True
        tenure = OracleTenure(rid, owner)
        self.current[rid] = tenure
        self.every.append(tenure)
        return tenure

    def _install(self, tenure: OracleTenure, hit_end: int) -> int | None:
        """A lookup: the hit serves ``[lowest, hit_end)``; returns its start
        when it serves anything."""
        tenure.admitted = False
        start = tenure.lowest(self.consumers)
        tenure.served = max(tenure.served, hit_end)
        return start if hit_end > start else None

    def apply(self, events: tuple[PrefixCacheRequestEvent, ...]) -> dict[str, int]:
        """Apply one step's events (terminal ones first, as the manager
        does); returns the recovery start of every hit that serves rows."""
        ordered = [e for e in events if e.kind in (K.FINISHED, K.ABORTED)]
        ordered += [e for e in events if e.kind not in (K.FINISHED, K.ABORTED)]
        hits: dict[str, int] = {}
        for e in ordered:
            cur = self.current.get(e.req_id)
            if cur is not None and e.owner is not None and e.owner < cur.owner:
                continue  # an older owner moves nothing
            if e.kind in (K.FINISHED, K.ABORTED):
                if cur is not None and not cur.finished and not cur.retired and e.owner == cur.owner:
                    cur.finished = True
                continue
            if e.kind in (K.STARTED, K.REPLACED):
                if cur is None or cur.finished or cur.retired or e.owner != cur.owner:
                    cur = self._open(e.req_id, e.owner)  # type: ignore[arg-type]
                    cur.admitted = True
                if e.lookup_complete and cur.admitted:
                    start = self._install(cur, int(e.hit_end))
                    if start is not None:
                        hits[e.req_id] = start
            elif e.kind is K.RESUMED and cur is not None and not cur.finished and not cur.retired:
                start = self._install(cur, int(e.hit_end))
                if start is not None:
                    hits[e.req_id] = start
        return hits


class EventEngine:
    """Owners, sequences and events for a ``ServingModel`` run (see the
    module docstring). ``kinds`` says how an ended request ends (default
    ABORTED); ``controls`` are REPLACED events sent with the next step."""

    def __init__(self, model: ServingModel, oracle: TenureOracle) -> None:
        self.model = model
        self.oracle = oracle
        self._owner_of: dict[str, tuple[ModelRequest, Owner]] = {}
        # Model requests whose first schedule was announced (STARTED).
        self._admitted: weakref.WeakSet[ModelRequest] = weakref.WeakSet()
        self.announced: dict[str, Owner] = {}  # the owner the manager's current tenure has
        self.seen: dict[str, list[Owner]] = {}  # every owner each id was opened under, oldest first
        self._admissions = itertools.count(1)
        self.sequence = 0
        self.last: PrefixCacheStep | None = None
        self.controls: list[PrefixCacheRequestEvent] = []
        self.kinds: dict[str, PrefixCacheEventKind] = {}

    def owner(self, rid: str) -> Owner:
        """The owner of the model's current request ``rid`` (a new request
        object is a new admission, unless a replacement named its owner)."""
        req = self.model.requests[rid]
        known = self._owner_of.get(rid)
        if known is None or known[0] is not req:
            known = self._owner_of[rid] = (req, Owner(next(self._admissions)))
        return known[1]

    def replace(self, rid: str, prefix: int, tail: list[int]) -> None:
        """``rid``'s content is replaced: the model's request ends (its
        finish is never announced) and new content arrives under the next
        generation of the owner; the REPLACED control goes with the next step."""
        old = self.owner(rid)
        self.model.end(rid)
        self.model.finished_pending.discard(rid)
        self.model.arrive(prefix, tail, rid=rid)
        new = Owner(old.admission_id, old.generation + 1)
        self._owner_of[rid] = (self.model.requests[rid], new)
        self.controls.append(PrefixCacheRequestEvent(rid, K.REPLACED, owner=new, lookup_complete=False))

    def _opened(self, rid: str, owner: Owner) -> None:
        owners = self.seen.setdefault(rid, [])
        if owner not in owners:
            owners.append(owner)
        self.announced[rid] = owner

    def stale_ids(self) -> list[str]:
        """Ids opened under two owners or more: the first is older than the id's latest."""
        return sorted(rid for rid, owners in self.seen.items() if len(owners) > 1)

    def _seal(
        self,
        events: list[PrefixCacheRequestEvent],
        scheduled: dict[str, int],
        drafts: dict[str, list[int]] | None = None,
    ) -> PrefixCacheStep:
        self.sequence += 1
        step = PrefixCacheStep(
            tuple(events), tuple(scheduled.items()), self.sequence, draft_tokens=draft_counts(drafts or {})
        )
        self.last = step
        return step

    def _terminal(self, finished: set[str]) -> list[PrefixCacheRequestEvent]:
        events = []
        for rid in sorted(finished):
            owner = self.announced.pop(rid, None)
            kind = self.kinds.pop(rid, K.ABORTED)
            if owner is not None:
                events.append(PrefixCacheRequestEvent(rid, kind, owner=owner))
        return events

    def _controls(self) -> list[PrefixCacheRequestEvent]:
        events, self.controls = self.controls, []
        for e in events:
            assert e.owner is not None
            self._opened(e.req_id, e.owner)
        return events

    def step(self, out: SchedOut, resumable: set[str]) -> PrefixCacheStep:
        """The events of one scheduled step. ``resumable``: the live
        requests that were waiting (preempted) before it was scheduled."""
        events = self._controls() + self._terminal(set(out.finished_req_ids))
        sched = dict(out.num_scheduled_tokens)
        new_ids = set()
        for nr in out.scheduled_new_reqs:
            rid = nr.req_id
            new_ids.add(rid)
            owner = self.owner(rid)
            req = self.model.requests[rid]
            blocks = tuple(tuple(int(b) for b in group) for group in nr.block_ids)
            if rid in resumable:
                kind = K.RESUMED
            elif req not in self._admitted:
                kind = K.STARTED
                self._opened(rid, owner)
            else:
                kind = K.EXTENDED
            self._admitted.add(req)
            events.append(
                PrefixCacheRequestEvent(rid, kind, 0, nr.num_computed_tokens, blocks, sched.get(rid, 0), owner=owner)
            )
        for rid, n in sched.items():
            if rid not in new_ids:
                events.append(PrefixCacheRequestEvent(rid, K.EXTENDED, scheduled_tokens=n, owner=self.owner(rid)))
        return self._seal(events, sched, out.scheduled_spec_decode_tokens)

    def optimistic_resume(self, rid: str, hit_end: int, blocks: list[int], tokens: int) -> PrefixCacheStep:
        """A step resuming ``rid`` (its current owner) with a hit over
        ``blocks`` up to ``hit_end``, scheduling ``tokens``: what a runner
        whose computed count skipped vLLM's rollback of rejected drafts (an
        optimistic count) would report after a preemption; its hit then
        covers rejected drafts' rows."""
        event = PrefixCacheRequestEvent(
            rid, K.RESUMED, 0, hit_end, (tuple(blocks),), tokens, owner=self.announced.get(rid)
        )
        return self._seal(self._controls() + [event], {rid: tokens})

    def entry(self, finished: set[str]) -> PrefixCacheStep:
        """A step with nothing scheduled: controls and terminal events only."""
        return self._seal(self._controls() + self._terminal(finished), {})

    def stale(self, rid: str, kind: PrefixCacheEventKind) -> PrefixCacheStep:
        """A step carrying one event of an older owner of ``rid`` (a real
        adapter drops it; the manager must ignore it)."""
        owner = self.seen[rid][0]
        lookup = kind is not K.REPLACED
        return self._seal([PrefixCacheRequestEvent(rid, kind, owner=owner, lookup_complete=lookup)], {})


def resumable(model: ServingModel) -> set[str]:
    """Live requests waiting to be scheduled again: preempted ones."""
    return {r.rid for r in model.waiting() if r.live}
