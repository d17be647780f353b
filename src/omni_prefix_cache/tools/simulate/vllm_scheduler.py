"""The simulation's scheduler interface over vLLM's real v1 ``Scheduler``
(``simulate --engine vllm``): the trace's requests admitted, aborted and
resubmitted, two-turn follow-ups queued, a fake ``ModelRunnerOutput`` fed
back each step, and what the real scheduler did counted for the report.
"""

from __future__ import annotations

import random
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omni_prefix_cache.tools.simulate import vllm_setup as setup
from omni_prefix_cache.tools.simulate.engine import SimConfig
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, chain_hash, mix64
from omni_prefix_cache.tools.simulate.scheduler import Scheduled, SchedulerStats, StepPlan
from omni_prefix_cache.tools.simulate.vllm_setup import VllmOptions
from omni_prefix_cache.tools.simulate.workload import RequestSpec, generate_trace


@dataclass
class VllmSchedulerStats(SchedulerStats):
    """The simulation's counters plus what only the real vLLM reports."""

    resumed_in_cached: int = 0  # resumed requests reported via scheduled_cached_reqs.resumed_req_ids
    resumed_in_new: int = 0  # ... reported among scheduled_new_reqs (Model Runner V2)
    same_step_id_reuse: int = 0  # an id both in finished_req_ids and scheduled_new_reqs of one step
    abort_resubmits: int = 0  # aborted requests resubmitted under the same id
    reordered_steps: int = 0  # steps whose batch the decode-first reorder changed
    chunked_prefill_steps: int = 0  # request-steps that returned no token (prefill not done)
    # Hits whose blocks in a group other than the keyed one include vLLM's null block:
    # hits longer than a sliding window (or past a Mamba group's kept state).
    hits_past_window: int = 0


class DriverRequest:
    """One incarnation of a request id: its spec, its vLLM request and its prefix hashes."""

    def __init__(self, spec: RequestSpec, vreq: Any, seed: int, incarnation: int) -> None:
        self.spec = spec
        self.req_id = spec.req_id
        self.vreq = vreq
        self.incarnation = incarnation
        self.salt = chain_hash(seed + 1 + incarnation, spec.req_id.encode())
        self.hashes = PrefixHashes(len(spec.prompt) + spec.max_output + 8)
        self.abort_step = None if spec.abort_after is None else spec.arrival_step + spec.abort_after
        self.preempted = False

    def hash_upto(self, end: int) -> None:
        """Extend the prefix hashes to position ``end`` from vLLM's own token ids."""
        have = len(self.hashes)
        if end > have:
            self.hashes.extend(self.vreq.all_token_ids[have:end])


class VllmScheduler:
    """The simulation's scheduler interface over vLLM's real v1 Scheduler.

    Admits the trace's requests (a streamed prompt arrives whole), aborts
    them (resubmitting the prompt under the same id in the same step),
    queues two-turn follow-ups (some under the finished turn's id), and
    feeds a fake ``ModelRunnerOutput`` back each step.
    """

    def __init__(
        self, cfg: SimConfig, opts: VllmOptions, v: SimpleNamespace, trace: list[RequestSpec] | None = None
    ) -> None:
        """``trace`` replaces the workload generated from ``cfg`` (directed tests)."""
        self.cfg, self.opts, self.v = cfg, opts, v
        self.stats = VllmSchedulerStats()
        self.alloc = SimpleNamespace(stats=setup.KvBlockStats())
        self.block_size = cfg.block_size
        self._model_dir = tempfile.TemporaryDirectory(prefix="omni-vllm-model-")
        self.vllm_config = setup.vllm_config(v, cfg, opts, self._model_dir.name)
        self.kv_cache_config = setup.kv_cache_config(v, cfg, opts.kv_layout, self.vllm_config)
        self.sched = setup.scheduler(v, cfg, opts, self.vllm_config, self.kv_cache_config)
        self._hasher = setup.block_hasher(v, cfg, self.vllm_config, self.kv_cache_config)
        # The stage gate on vLLM's own configs: it admits the layout and picks the keyed group.
        self.prefix_cache_config = setup.stage_config(self.vllm_config, self.kv_cache_config)
        self.group = self.prefix_cache_config.kv_cache_group_index
        setup.EvictionCounter.install(self.sched, self.alloc.stats)
        if trace is None:
            trace = generate_trace(cfg.workload, cfg.seed)
        self._arrivals: deque[RequestSpec] = deque(sorted(trace, key=_arrival))
        self._later: list[RequestSpec] = []  # follow-ups
        self._retries: list[RequestSpec] = []  # aborted requests resubmitted in the abort's step
        self.reqs: dict[str, DriverRequest] = {}
        self._incarnations = 0
        self._manager_live: set[str] = set()  # mirrors the manager's rule: new and not yet finished
        self._owner: dict[int, int] = {}  # block id -> incarnation that last got it fresh
        self._capacity = (cfg.num_blocks - 1) * cfg.block_size  # block 0 is vLLM's null block
        self.on_sampled: Callable[[dict[str, list[int]]], None] | None = None  # the runner's bookkeeping
        self.last_output: Any = None  # the ModelRunnerOutput of the last update (its sampled_token_ids)
        self._spec_rng = random.Random(cfg.seed ^ 0x5BEC)  # the fake proposer: how many drafts, how many right
        self._rejected_blocks: set[int] = set()  # blocks a rejected draft's row once occupied
        # vLLM 0.33's OffloadingConnector loses an id's state when the id is added again before the
        # connector's metadata reported its finish (KeyError in _update_req_states/_build_store_jobs):
        # behind it, a retry or a follow-up under the same id comes two steps later.
        self._id_reuse_gap = 2 if opts.kv_offload else 0

    def close(self) -> None:
        self._model_dir.cleanup()

    # ------------------------------------------------------------ lifecycle

    @property
    def idle(self) -> bool:
        return not (self._arrivals or self._later or self.sched.requests)

    @property
    def running(self) -> list[Any]:
        return list(self.sched.running)

    @property
    def waiting(self) -> list[Any]:
        return [r for r in self.sched.requests.values() if r not in self.sched.running]

    def progress(self) -> float:
        st = self.stats
        known = st.arrived + st.rejected + len(self._arrivals) + len(self._later)
        return (st.finished + st.aborted + st.rejected) / known if known else 1.0

    def live_requests(self) -> list[DriverRequest]:
        return [self.reqs[r] for r in self.sched.requests]

    def _arrive(self, spec: RequestSpec, priority: int = 0) -> None:
        if len(spec.prompt) + spec.max_output > self._capacity:
            self.stats.rejected += 1  # longer than the whole KV cache
            return
        v = self.v
        params = v.SamplingParams(max_tokens=spec.max_output, ignore_eos=True, temperature=0.0)
        vreq = v.Request(spec.req_id, list(spec.prompt), params, None, priority=priority, block_hasher=self._hasher)
        self._incarnations += 1
        self.stats.reused_ids += spec.req_id in self.reqs
        self.reqs[spec.req_id] = DriverRequest(spec, vreq, self.cfg.seed, self._incarnations)
        self.sched.add_request(vreq)
        self.stats.arrived += 1
        self.stats.duplicates += spec.duplicate_of is not None

    def _next_turn(self, req: DriverRequest, step: int) -> None:
        f = req.spec.followup
        if f is None:
            return
        self._later.append(
            RequestSpec(
                req_id=req.req_id if f.reuse_id else f"{req.req_id}.2",
                arrival_step=step + 1 + f.delay + (self._id_reuse_gap if f.reuse_id else 0),
                segments=(tuple(req.vreq.all_token_ids) + f.extra,),
                max_output=f.max_output,
            )
        )
        self.stats.followups += 1

    def _abort(self, req: DriverRequest, step: int, *, resubmit: bool) -> None:
        self.sched.finish_requests(req.req_id, self.v.RequestStatus.FINISHED_ABORTED)
        self.stats.aborted += 1
        if resubmit:
            # The client retries at once under the same id: in this step's output the id is both
            # finished and (once admitted) new, and the retry hits the blocks the abort just freed.
            retry = RequestSpec(req.req_id, step + self._id_reuse_gap, (req.spec.prompt,), req.spec.max_output)
            (self._later if self._id_reuse_gap else self._retries).append(retry)
            self.stats.abort_resubmits += 1

    def abort_all(self, step: int) -> None:
        for req in self.live_requests():
            self._abort(req, step, resubmit=False)
        self._arrivals.clear()
        self._later.clear()

    def _start_step(self, step: int) -> None:
        for req in self.live_requests():
            if req.abort_step is not None and req.abort_step <= step:
                self._abort(req, step, resubmit=True)
        while self._arrivals and self._arrivals[0].arrival_step <= step:
            self._arrive(self._arrivals.popleft())
        for spec in self._retries:
            self._arrive(spec, priority=-1)  # ahead of the queue, so it is admitted in this step
        self._retries.clear()
        due = [s for s in self._later if s.arrival_step <= step]
        for s in due:
            self._later.remove(s)
            self._arrive(s)

    # ------------------------------------------------------------ one step

    def schedule(self, step: int) -> StepPlan[DriverRequest]:
        """Run vLLM's ``schedule()``; return the entries in scheduling order with what the oracle needs."""
        self._start_step(step)
        so = self.sched.schedule()
        st = self.stats
        finished = set(so.finished_req_ids)
        new_ids = {n.req_id for n in so.scheduled_new_reqs}
        st.same_step_id_reuse += len(finished & new_ids)
        st.preemptions += len(so.preempted_req_ids or ())
        for rid in so.preempted_req_ids or ():
            self.reqs[rid].preempted = True
        cached = so.scheduled_cached_reqs
        starts: dict[str, int] = {n.req_id: int(n.num_computed_tokens) for n in so.scheduled_new_reqs}
        starts.update({r: int(c) for r, c in zip(cached.req_ids, cached.num_computed_tokens)})
        fresh: dict[str, list[int]] = {}
        hit_blocks: dict[str, list[int]] = {}
        g = self.group
        spec = so.scheduled_spec_decode_tokens or {}
        for n in so.scheduled_new_reqs:
            blocks, k = list(n.block_ids[g]), starts[n.req_id] // self.block_size
            hit_blocks[n.req_id], fresh[n.req_id] = blocks[:k], blocks[k:]
            st.hits_past_window += any(b == 0 for i, ids in enumerate(n.block_ids) if i != g for b in ids[:k])
        for rid, nb in zip(cached.req_ids, cached.new_block_ids):
            blocks = [] if nb is None else list(nb[g])
            if rid in cached.resumed_req_ids:  # the resumed row is replaced: its prefix came from the cache
                k = starts[rid] // self.block_size
                hit_blocks[rid], blocks = blocks[:k], blocks[k:]
            fresh[rid] = blocks
        self._count_fresh(fresh, hit_blocks)
        entries: list[Scheduled[DriverRequest]] = []
        by_new = {n.req_id: n for n in so.scheduled_new_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            req, start = self.reqs[rid], starts[rid]
            req.hash_upto(start + n)
            new_entry = by_new.get(rid)
            manager_hit = 0
            resumed = rid in cached.resumed_req_ids
            if new_entry is not None:
                if rid in self._manager_live and rid not in finished:
                    resumed = resumed or req.preempted  # Model Runner V2: resumed among the new
                    st.resumed_in_new += req.preempted
                    st.stream_reentries += not req.preempted
                elif start > 0:
                    manager_hit = start
                    st.hits += 1
                    st.hit_tokens += start
                    others = {b for r, bs in fresh.items() if r != rid for b in bs}
                    st.same_step_hits += any(b in others for b in hit_blocks.get(rid, ()))
            else:
                st.resumed_in_cached += resumed
            if resumed:
                st.resumes += 1
                st.resumes_with_hit += start > 0
                st.live_prefix_tokens += start
                req.preempted = False
            st.hits_over_rejected += start > 0 and bool(self._rejected_blocks.intersection(hit_blocks.get(rid, ())))
            drafts = tuple(int(t) for t in spec.get(rid, ()))
            good = 0  # the fake forward verifies greedily: the drafts that are the tokens it would sample
            while good < len(drafts) and drafts[good] == self._truth(req, start + 1 + good):
                good += 1
            entries.append(Scheduled(req, n, start, new_entry, manager_hit, drafts=drafts, accepted=good))
        self._manager_live -= finished
        self._manager_live |= new_ids
        if not entries:
            st.empty_steps += 1
        st.max_running = max(st.max_running, len(self.sched.running))
        return StepPlan(step, entries, so)

    def _count_fresh(self, fresh: dict[str, list[int]], hits: dict[str, list[int]]) -> None:
        bs = self.alloc.stats
        for rid, blocks in fresh.items():
            inc = self.reqs[rid].incarnation
            for b in blocks:
                bs.fresh_blocks += 1
                bs.recycled += self._owner.get(b, inc) != inc
                self._owner[b] = inc
            bs.null_block_in_table += sum(1 for b in [*blocks, *hits.get(rid, ())] if b == 0)

    def _truth(self, req: DriverRequest, position: int) -> int:
        """The token the fake forward samples at ``position`` (a function of the incarnation and position)."""
        return mix64(req.salt ^ (position * 0x9E3779B1)) % self.opts.vocab

    def sampled_tokens(self, plan: StepPlan[DriverRequest]) -> dict[str, list[int]]:
        """The fake forward's sampled tokens per request that computed all its
        known tokens: the next token, or with drafts (greedy verification)
        the drafts it accepted and the token after them."""
        out: dict[str, list[int]] = {}
        for e in plan.entries:
            vreq = e.req.vreq
            if e.start + e.n - len(e.drafts) < vreq.num_tokens:
                self.stats.chunked_prefill_steps += 1
                continue  # still in chunked prefill: vLLM expects no token
            first = vreq.num_tokens  # the position the first sampled token takes
            out[e.req.req_id] = [self._truth(e.req, first + j) for j in range(e.accepted + 1)]
            if e.drafts:
                st, bs = self.stats, self.block_size
                st.draft_steps += 1
                st.drafts += len(e.drafts)
                st.drafts_accepted += e.accepted
                blocks = self.sched.kv_cache_manager.get_block_ids(e.req.req_id)[0]
                self._rejected_blocks.update(blocks[p // bs] for p in range(e.accepted_end, e.start + e.n))
        return out

    def propose_drafts(self) -> None:
        """The fake proposer, after ``update_from_output`` as vLLM's engine
        core calls it: for each running request in decode, up to
        ``spec_tokens`` drafts (an n-gram proposer finds none now and then),
        the first few right, the rest wrong, never more than its remaining
        output tokens allow."""
        k = self.cfg.spec_tokens
        ids, drafts = [], []
        for vreq in self.sched.running:
            req = self.reqs.get(vreq.request_id)
            room = min(k, vreq.max_tokens - vreq.num_output_tokens - 1)
            if req is None or room <= 0 or vreq.num_computed_tokens != vreq.num_tokens - 1:
                continue
            d = self._spec_rng.randint(0, room)
            good = self._spec_rng.randint(0, d)
            right = [self._truth(req, vreq.num_tokens + j) for j in range(d)]
            ids.append(vreq.request_id)
            drafts.append([t if j < good else (t + 1 + j) % self.opts.vocab for j, t in enumerate(right)])
        if ids:
            self.sched.update_draft_token_ids(self.v.DraftTokenIds(ids, drafts))

    def update(self, plan: StepPlan[DriverRequest]) -> None:
        """Feed the fake ``ModelRunnerOutput`` to ``update_from_output`` (the
        accepted drafts' rollback is vLLM's); propose the next drafts; queue
        follow-ups of finished turns."""
        sampled = self.sampled_tokens(plan)
        if self.on_sampled is not None:
            self.on_sampled(sampled)
        ids = [e.req.req_id for e in plan.entries]
        out = self.v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled.get(r, []) for r in ids],
        )
        self.last_output = out
        if self.opts.kv_offload:  # the fake worker completes the connector's transfer jobs
            out.kv_connector_output = setup.offload_worker_output(plan.output)
        for e in plan.entries:
            if e.start >= e.req.vreq.num_prompt_tokens:
                self.stats.decode_tokens += e.n
            else:
                self.stats.prefill_tokens += e.n
        self.sched.update_from_output(plan.output, out)
        for e in plan.entries:
            if e.drafts:
                e.req.hash_upto(e.accepted_end)  # the accepted drafts are tokens now: the oracle reads their rows
        if self.cfg.spec_tokens:
            self.propose_drafts()
        for e in plan.entries:
            if self.sched.requests.get(e.req.req_id) is not e.req.vreq:
                self.stats.finished += 1
                self._next_turn(e.req, plan.step)


def _arrival(spec: RequestSpec) -> int:
    return spec.arrival_step
