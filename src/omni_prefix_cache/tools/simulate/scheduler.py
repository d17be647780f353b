"""A small vLLM-v1-like scheduler: chunked prefill under a token budget, decode,
preemption under KV pressure, streaming continuations, finishes and aborts.

It owns request state and the block allocator and emits, per step, what the
prefix cache reads from vLLM's scheduler output. The seed-era form
(``events=False``) has three fields (``scheduled_new_reqs``,
``finished_req_ids``, ``num_scheduled_tokens``); a preempted request re-enters
the new-request list. The event form (``events=True``) is the newest upstream
scheduler's: running and resumed requests are in ``scheduled_cached_reqs``
(``resumed_req_ids``, ``new_block_ids``, ``num_computed_tokens``), every
scheduled request's owner in ``prefix_cache_owners`` (a fresh admission id per
arrival, a new generation per replacement), ``prefix_cache_replacements``
(REPLACED controls), ``prefix_cache_terminal_owners``, ``aborted_req_ids`` and
``prefix_cache_step_sequence``. It also says what the oracle needs to know
(which rows each request must get back).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheRequestOwner
from omni_prefix_cache.tools.simulate.blocks import BlockAllocator
from omni_prefix_cache.tools.simulate.plan import Scheduled, SchedulerStats, SimScheduler, StepPlan
from omni_prefix_cache.tools.simulate.request import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    SimRequest,
    Status,
)
from omni_prefix_cache.tools.simulate.workload import RequestSpec

__all__ = [
    "CachedRequestData",
    "NewRequestData",
    "Scheduled",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "SimRequest",
    "SimScheduler",
    "Status",
    "StepPlan",
]


@dataclass
class Scheduler:
    """Requests, KV blocks and the per-step scheduling decisions."""

    trace: list[RequestSpec]
    num_blocks: int
    block_size: int
    token_budget: int
    max_num_seqs: int
    seed: int = 0
    vocab: int = 32000
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    events: bool = False  # emit the event form (see the module docstring)
    replace_prob: float = 0.0  # event form: chance per step that one running request's content is replaced
    spec_tokens: int = 0  # event form: speculative decoding with up to this many drafts per decode step

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed ^ 0x7E91ACE)
        self._admissions = 0
        self._replacements: list[PrefixCacheRequestEvent] = []
        self.alloc = BlockAllocator(self.num_blocks, self.block_size)
        self._arrivals: deque[RequestSpec] = deque(sorted(self.trace, key=lambda s: s.arrival_step))
        self._followups: list[RequestSpec] = []
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self._finished_pending: list[SimRequest] = []
        self._spec_rng = random.Random(self.seed ^ 0x5BEC)  # which drafts are right
        self._rejected_blocks: set[int] = set()  # blocks a rejected draft's row once occupied

    # ------------------------------------------------------------ lifecycle

    @property
    def idle(self) -> bool:
        """No request left to arrive, run or report."""
        return not (self._arrivals or self._followups or self.waiting or self.running or self._finished_pending)

    def progress(self) -> float:
        """Share of the requests known so far (trace + second turns) that are done."""
        st = self.stats
        known = len(self.trace) + st.followups
        return (st.finished + st.aborted + st.rejected) / known if known else 1.0

    def live_requests(self) -> list[SimRequest]:
        return [*self.running, *self.waiting]

    def _arrive(self, spec: RequestSpec) -> None:
        if sum(len(seg) for seg in spec.segments) + spec.max_output > self.num_blocks * self.block_size:
            self.stats.rejected += 1  # longer than the whole KV cache: vLLM refuses it at admission
            return
        req = SimRequest(spec, self.block_size, self.seed, self.vocab)
        self._admissions += 1
        req.owner = PrefixCacheRequestOwner(self._admissions)
        self.stats.reused_ids += req.req_id in self.requests
        self.requests[req.req_id] = req
        self.waiting.append(req)
        self.stats.arrived += 1
        self.stats.duplicates += spec.duplicate_of is not None

    def _finish(self, req: SimRequest, *, aborted: bool, step: int) -> None:
        if req.status is Status.DONE:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self.alloc.free(req.blocks)
        req.blocks = []
        req.status = Status.DONE
        self._finished_pending.append(req)
        if aborted:
            req.aborted = True
            self.stats.aborted += 1
            return
        self.stats.finished += 1
        f = req.spec.followup
        if f is not None:
            self._followups.append(
                RequestSpec(
                    req_id=req.req_id if f.reuse_id else f"{req.req_id}.2",
                    arrival_step=step + 1 + f.delay,
                    segments=(tuple(req.tokens) + f.extra,),
                    max_output=f.max_output,
                )
            )
            self.stats.followups += 1

    def abort_all(self, step: int) -> None:
        """Abort every request still alive (end of run)."""
        for req in list(self.live_requests()):
            self._finish(req, aborted=True, step=step)
        self._arrivals.clear()
        self._followups.clear()

    def _unschedule(self, req: SimRequest, *, preempted: bool) -> None:
        """Take a running request off the running list and its blocks: it
        waits again from position 0 and re-enters the new list when scheduled."""
        self.running.remove(req)
        self.alloc.free(req.blocks)
        req.blocks = []
        req.computed = 0
        req.num_cached_blocks = 0
        req.status = Status.WAITING
        req.emit_new = True
        req.preempted = preempted

    def _preempt(self, req: SimRequest) -> None:
        self._unschedule(req, preempted=True)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def rollback(self, reqs: Sequence[SimRequest]) -> None:
        """Event form: the step that computed ``reqs`` was discarded, so the
        engine preempts each one still running; it resumes (RESUMED) and its
        hit recovers what no consumer received."""
        for req in reqs:
            if req.status in (Status.RUNNING, Status.AWAITING_INPUT):
                self._preempt(req)
                self.stats.rollbacks += 1

    def _replace(self, req: SimRequest) -> None:
        """A newer content generation of a running request: the first half of
        its prompt kept, a new tail; requeued to look up its new content."""
        self._unschedule(req, preempted=False)
        req.live = False  # its new tenure's first scheduled step carries the lookup (a new-request entry)
        keep = req.tokens[: max(1, len(req.tokens) // 2)]
        req.replace_content(keep + [self._rng.randrange(self.vocab) for _ in range(self._rng.randint(4, 40))])
        self.waiting.appendleft(req)
        # A control-only event: it fixes the owner; the lookup comes when the request is scheduled.
        self._replacements.append(
            PrefixCacheRequestEvent(req.req_id, PrefixCacheEventKind.REPLACED, owner=req.owner, lookup_complete=False)
        )
        self.stats.replacements += 1

    def _blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _cache_full_blocks(self, req: SimRequest, upto: int, step: int) -> None:
        full = upto // self.block_size
        for i in range(req.num_cached_blocks, full):
            self.alloc.cache(req.blocks[i], req.block_hashes[i], step)
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    # ------------------------------------------------------------ one step

    def _start_step(self, step: int) -> None:
        while self._arrivals and self._arrivals[0].arrival_step <= step:
            self._arrive(self._arrivals.popleft())
        due = [f for f in self._followups if f.arrival_step <= step]
        for f in due:
            self._followups.remove(f)
            self._arrive(f)
        for req in list(self.live_requests()):
            if req.abort_step is not None and req.abort_step <= step:
                self._finish(req, aborted=True, step=step)
            elif req.next_segment_step is not None and req.next_segment_step <= step:
                req.reveal_segment()
                if req.status is Status.AWAITING_INPUT:
                    req.status = Status.RUNNING
                    req.emit_new = True
        if self.events and self.replace_prob and self._rng.random() < self.replace_prob:
            candidates = [r for r in self.running if r.status is Status.RUNNING and r.live and r.computed > 0]
            if candidates:
                self._replace(self._rng.choice(candidates))

    def schedule(self, step: int) -> StepPlan[SimRequest]:
        """Decide this step: running requests first, then admissions (only if nobody was preempted)."""
        self._start_step(step)
        budget = self.token_budget
        entries: list[Scheduled[SimRequest]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.status is not Status.RUNNING or req.pending == 0:
                i += 1
                continue
            n = min(req.pending, budget)
            drafts, good = self._drafts(req, budget)
            n += len(drafts)
            need = self._blocks_needed(req.computed + n) - len(req.blocks)
            while need > self.alloc.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            added = self.alloc.allocate(max(0, need)) or []
            req.blocks.extend(added)
            self._cache_full_blocks(req, req.computed + n - len(drafts), step)  # never over a draft
            new_entry = None
            if req.emit_new:
                new_entry = NewRequestData(req.req_id, req.computed, (list(req.blocks),))
                self.stats.stream_reentries += 1
            entries.append(
                Scheduled(req, n, req.computed, new_entry, 0, new_blocks=added, drafts=drafts, accepted=good)
            )
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_blocks = self.alloc.lookup_prefix(req.block_hashes, len(req.tokens))
            hit = len(hit_blocks) * self.block_size
            n = min(len(req.tokens) - hit, budget)
            need = self._blocks_needed(hit + n) - len(hit_blocks)
            revived = sum(1 for b in hit_blocks if self.alloc.is_free(b))
            if need > self.alloc.num_free - revived:
                break
            same_step = any(self.alloc.cached_step(b) == step for b in hit_blocks)
            self.stats.hits_over_rejected += bool(self._rejected_blocks.intersection(hit_blocks))
            self.alloc.touch(hit_blocks)
            req.blocks = hit_blocks + (self.alloc.allocate(need) or [])
            req.computed = hit
            req.num_cached_blocks = len(hit_blocks)
            self._cache_full_blocks(req, hit + n, step)
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            manager_hit = 0
            if req.preempted:
                self.stats.resumes += 1
                self.stats.resumes_with_hit += hit > 0
            if req.live:
                self.stats.live_prefix_tokens += hit
            elif hit:
                manager_hit = hit
                self.stats.hits += 1
                self.stats.hit_tokens += hit
                self.stats.same_step_hits += same_step
            # Event form: a request the manager still knows resumes through the cached list.
            resumed = self.events and req.live
            entry = None if resumed else NewRequestData(req.req_id, hit, (list(req.blocks),))
            entries.append(Scheduled(req, n, hit, entry, manager_hit, resumed, list(req.blocks)))
            budget -= n
        if not entries:
            self.stats.empty_steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        for e in entries:
            if e.new_entry is not None or e.resumed:
                e.req.live = True
                e.req.emit_new = False
        finished = self._finished_pending
        self._finished_pending = []
        for req in finished:
            req.live = False  # a reused id arriving now is a different object: it stays as decided above
        out = SchedulerOutput(
            scheduled_new_reqs=[e.new_entry for e in entries if e.new_entry is not None],
            finished_req_ids={r.req_id for r in finished},
            num_scheduled_tokens={e.req.req_id: e.n for e in entries},
            scheduled_spec_decode_tokens={e.req.req_id: list(e.drafts) for e in entries if e.drafts},
        )
        if self.events:
            out = self._event_form(step, out, entries, finished)
        return StepPlan(step, entries, out)

    def _event_form(
        self, step: int, out: SchedulerOutput, entries: list[Scheduled[SimRequest]], finished: list[SimRequest]
    ) -> SchedulerOutput:
        """``out`` with the newest upstream scheduler's fields: the cached
        (running and resumed) requests, owners, replacement controls, the
        terminal owners and aborted ids, and the step sequence."""
        cached = [e for e in entries if e.new_entry is None]
        controls, self._replacements = tuple(self._replacements), []
        return replace(
            out,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[e.req.req_id for e in cached],
                resumed_req_ids={e.req.req_id for e in cached if e.resumed},
                new_block_ids=[(list(e.new_blocks),) if e.new_blocks else None for e in cached],
                num_computed_tokens=[e.start for e in cached],
                num_output_tokens=[e.req.num_output for e in cached],
            ),
            prefix_cache_owners={e.req.req_id: e.req.owner for e in entries},
            prefix_cache_replacements=controls,
            prefix_cache_terminal_owners={r.req_id: r.owner for r in finished},
            aborted_req_ids={r.req_id for r in finished if r.aborted},
            prefix_cache_step_sequence=step,
        )

    def _drafts(self, req: SimRequest, budget: int) -> tuple[tuple[int, ...], int]:
        """Speculative decoding (event form): the draft tokens of a request in
        decode (its next tokens, the ones after the first wrong draft wrong
        too) and how many of them are right, drawn so every count occurs."""
        room = min(self.spec_tokens, budget - 1, req.spec.max_output - req.num_output - 1)
        if not (self.events and room > 0 and req.pending == 1 and req.num_output > 0 and not req.more_segments):
            return (), 0
        d = self._spec_rng.randint(1, room)
        good = self._spec_rng.randint(0, d)
        right = [req.next_token(len(req.tokens) + j) for j in range(d)]
        return tuple(t if j < good else (t + 1 + j) % self.vocab for j, t in enumerate(right)), good

    def update(self, plan: StepPlan[SimRequest]) -> None:
        """Apply the forward's results: advance, sample, finish. A step with
        drafts keeps the accepted ones (vLLM's rollback: ``num_computed_tokens
        -= rejected``) and samples the token after them."""
        for e in plan.entries:
            req = e.req
            decode = e.n == 1 and req.num_output > 0 and req.computed == len(req.tokens) - 1
            if e.drafts:
                self._accept(e, plan.step)
                continue
            req.computed += e.n
            if decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += e.n
            if req.computed != len(req.tokens):
                continue
            if req.more_segments:
                req.status = Status.AWAITING_INPUT
                req.next_segment_step = plan.step + 1 + req.spec.segment_gap
                continue
            req.sample()
            if req.num_output >= req.spec.max_output:
                self._finish(req, aborted=False, step=plan.step)

    def _accept(self, e: Scheduled[SimRequest], step: int) -> None:
        """A drafted decode step's result: the accepted drafts are the
        request's next tokens, the token after them is sampled, and the
        blocks of the rejected ones' rows are noted (hits on them count)."""
        req = e.req
        for _ in range(e.accepted):
            req.sample()
        req.computed = e.accepted_end
        st = self.stats
        st.draft_steps += 1
        st.drafts += len(e.drafts)
        st.drafts_accepted += e.accepted
        st.decode_tokens += 1 + e.accepted
        bs = self.block_size
        for pos in range(e.accepted_end, e.start + e.n):
            self._rejected_blocks.add(req.blocks[pos // bs])
        req.sample()
        if req.num_output >= req.spec.max_output:
            self._finish(req, aborted=False, step=step)
