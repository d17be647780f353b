"""``simulate --engine vllm`` on the event API (the default; ``--api seed``
keeps the seed-era loop of :mod:`vllm_engine`).

Per step, as a vLLM model runner with the engine helper does it: vLLM's
real ``schedule()``; ``PrefixCacheEngineHelper.begin_step`` (the adapter
turns the real ``SchedulerOutput`` into events, owners declared per
admission) before the runner's ``_update_states``; the real ``InputBatch``
updated; the fake forward; ``helper.save`` (write layout from
``build_write_layout`` over the real InputBatch's ``FullAttentionGroupView``);
``update_from_output``. The step's output builder (materialize, the
``output`` consumer's delivery view, ``commit_output``) runs inline or on
an output thread one step behind, in step order; a second consumer
(``talker``) views and acknowledges the same outputs in lagging bursts.

A discarded step is never delivered, so its requests are preempted in the
real scheduler right after it: each comes back as a RESUMED event whose
hit recovers what its consumers missed. Real preemptions (a full KV
cache) resume the same way. ``DeliveryOracle`` checks every position of
every incarnation reaches each consumer exactly once, in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestOwner, accepted_rows_of
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper, SavedStep
from omni_prefix_cache.interface import ModelCachePolicy, StageCacheOutputs
from omni_prefix_cache.tools.simulate.engine import (
    DEFERRED_KEY,
    LEFTOVER_KEY,
    LogCounter,
    ProgressFn,
    SimConfig,
    SimResult,
)
from omni_prefix_cache.tools.simulate.lagged import LaggedWorker
from omni_prefix_cache.tools.simulate.oracle import RowExpectation
from omni_prefix_cache.tools.simulate.probe import manager_stats, probe_leaks, wait_quiescent
from omni_prefix_cache.tools.simulate.scheduler import StepPlan
from omni_prefix_cache.tools.simulate.vllm_delivery import DeliveryOracle, LaggingConsumer
from omni_prefix_cache.tools.simulate.vllm_engine import VllmSimResult, VllmSimulation, run_vllm_seed_simulation
from omni_prefix_cache.tools.simulate.vllm_scheduler import DriverRequest
from omni_prefix_cache.tools.simulate.vllm_setup import VllmOptions, preempt_request
from omni_prefix_cache.tools.simulate.workload import RequestSpec

__all__ = ["VllmEventSimulation", "run_vllm_simulation"]

OUTPUT, TALKER = "output", "talker"
K = PrefixCacheEventKind


class VllmEventSimulation(VllmSimulation):
    """The vLLM driver through the adapter, the engine helper and two consumers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.result, VllmSimResult)
        self.result.api = "events"
        self.tenure_oracle = DeliveryOracle(self.cfg.widths(), self.cfg.torch_dtype, (OUTPUT, TALKER))
        self._final: dict[int, tuple[str, int]] = {}  # finished incarnation -> (id, last position)
        self._fenced: set[int] = set()
        self._discarded: set[int] = set()  # incarnations preempted after a discarded step
        self._counts_lock = threading.Lock()
        self.talker: LaggingConsumer | None = None

    # ------------------------------------------------------------ one step

    def _owners(self, so: Any) -> None:
        """Declare owners as an omni engine does (one admission per incarnation); under Model
        Runner V2, name the resumed requests among the new ones: those the runner still holds."""
        reqs = self.sched.reqs
        so.prefix_cache_owners = {r: PrefixCacheRequestOwner(reqs[r].incarnation) for r in so.num_scheduled_tokens}
        if self.opts.resumed_as_new:
            held, gone = self.runner.requests, so.finished_req_ids
            so.prefix_cache_resumed_req_ids = {
                n.req_id for n in so.scheduled_new_reqs if n.req_id in held and n.req_id not in gone
            }

    def _event_step(self, helper: PrefixCacheEngineHelper, step: int, out: LaggedWorker | None) -> None:
        plan = self.sched.schedule(step)
        so = plan.output
        self._owners(so)
        t0 = time.perf_counter_ns()
        begun = helper.begin_step(so)  # before _update_states: finished requests are still known
        engine_us = (time.perf_counter_ns() - t0) / 1000.0
        resumed = self._count_events(begun.events, so)
        order = self._batch_order(plan)  # the runner's _update_states on the real InputBatch
        if not plan.entries:
            self.sched.update(plan)
            return
        hidden, mm, n, padded = self._forward(order, plan)
        t0 = time.perf_counter_ns()
        saved = helper.save(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded)
        self.result.engine_us.append(engine_us + (time.perf_counter_ns() - t0) / 1000.0)
        if saved is None or list(saved.req_ids) != order:
            raise AssertionError(f"step {step}: saved rows {saved} are not the input batch's {order}")
        res = self.result
        res.saved_steps += 1
        res.tokens += n
        reqs = {e.req.req_id: e.req for e in plan.entries}
        # With speculative drafts a request's rows end at its accepted end; the rows before its drafts end
        # at its verified end (where a tenure retired before the materialize ends).
        spans = {e.req.req_id: (e.start, e.accepted_end) for e in plan.entries}
        self.sched.update(plan)  # update_from_output: the rejected drafts' rollback and finishes are decided here
        # The runner's accepted rows, right after its rejection sampler: len(sampled_token_ids[i]).
        accepted = accepted_rows_of(self.sched.last_output) if saved.drafts else None
        finished = [r for r in plan.entries if self.sched.sched.requests.get(r.req.req_id) is not r.req.vreq]
        for e in finished:
            self._final[e.req.incarnation] = (e.req.req_id, e.accepted_end)
        discard = not finished and self.rng.random() < self.cfg.discard_prob
        if discard:
            res.discarded_steps += 1
            self._preempt(plan)
            job: Callable[[], Any] = helper.discard_builder(saved, accepted_rows=accepted)
        else:
            job = self._builder(helper, step, saved, reqs, spans, resumed, (step, n, padded), accepted)
        if out is None:
            job()
        else:
            out.submit(job)

    def _count_events(self, events: Any, so: Any) -> set[str]:
        c = self.tenure_oracle.counts
        finished = {e.req_id for e in events if e.kind in (K.FINISHED, K.ABORTED)}
        resumed = set()
        for e in events:
            if e.kind is K.RESUMED:
                resumed.add(e.req_id)
                c.resumed += 1
                c.resumed_with_hit += e.hit_end > 0
                c.resumed_unaligned += e.hit_end % self.cfg.block_size != 0
            elif e.kind is K.STARTED and e.req_id in finished:
                c.same_step_reuse_events += 1
        return resumed

    def _preempt(self, plan: StepPlan[DriverRequest]) -> None:
        """Preempt the discarded step's requests in vLLM (its rows reached no consumer)."""
        sched = self.sched.sched
        for e in plan.entries:
            vreq = e.req.vreq
            if vreq in sched.running:
                preempt_request(sched, vreq, time.monotonic())
                self.tenure_oracle.counts.discard_preemptions += 1
                self._discarded.add(e.req.incarnation)

    def _builder(
        self,
        helper: PrefixCacheEngineHelper,
        step: int,
        saved: SavedStep,
        reqs: dict[str, DriverRequest],
        spans: dict[str, tuple[int, int]],
        resumed: set[str],
        tag: tuple[int, int, int],
        accepted: dict[str, int] | None,
    ) -> Callable[[], None]:
        import torch

        published: list[frozenset[str]] = []

        def build(view: StageCacheOutputs) -> StageCacheOutputs:
            return view  # the payload: the view itself (a real builder copies it into the runner output)

        def publish(payload: StageCacheOutputs, live: frozenset[str]) -> None:
            published.append(live)

        # The accepted rows: given with the builder inline (a synchronous runner has them right after its
        # rejection sampler), or to the builder on the output thread (an async runner's get_output).
        late = self.cfg.lagged
        ordered = helper.output_builder(saved, build, publish, accepted_rows=None if late else accepted)

        def run() -> None:
            t0 = time.perf_counter_ns()
            done = ordered(accepted_rows=accepted) if late and accepted is not None else ordered()
            dt = (time.perf_counter_ns() - t0) / 1000.0
            outputs = done.outputs
            tensor = torch.tensor(list(tag), dtype=torch.float32)
            self._check_raw(step, saved, outputs, reqs, spans, tensor)
            self._count_output(outputs, done.view, reqs, spans, resumed)
            for rid in set(saved.req_ids) - done.live:
                if self.sched.reqs.get(rid) is reqs[rid]:
                    raise AssertionError(f"step {step}: commit_output filtered {rid!r}, whose owner is current")
                self._fenced.add(reqs[rid].incarnation)
            with self._counts_lock:
                self.tenure_oracle.counts.fenced += len(saved.req_ids) - len(done.live)
                self.result.materialize_us.append(dt)
                self.result.materialized_steps += 1
            self.tenure_oracle.delivered(OUTPUT, step, done.view, reqs, done.live)
            assert self.talker is not None
            self.talker.put((step, outputs, reqs))

        return run

    def _check_raw(
        self,
        step: int,
        saved: SavedStep,
        outputs: StageCacheOutputs,
        reqs: dict[str, DriverRequest],
        spans: dict[str, tuple[int, int]],
        tag: Any,
    ) -> None:
        """The materialized rows themselves: ``token_ranges`` end at the step's
        (accepted) end, start at or before its start, and hold the row function's rows."""
        exps = []
        for rid in saved.req_ids:
            start, end = outputs.token_ranges[rid]
            s0, e0 = spans[rid]
            if end != e0 or start > s0 or outputs.scheduled_token_ranges.get(rid) != (s0, e0):
                raise AssertionError(
                    f"step {step}: {rid!r} token range {(start, end)} / scheduled "
                    f"{outputs.scheduled_token_ranges.get(rid)}, the step computed [{s0}, {e0})"
                )
            exps.append(RowExpectation(rid, start, end, s0 - start, reqs[rid].hashes.span(start, end).clone()))
        self.oracle.check(step, saved.step_id, exps, outputs, {LEFTOVER_KEY: [tag]})
        with self._counts_lock:
            self.result.rows_from_cache += sum(e.hit for e in exps)

    def _count_output(
        self,
        outputs: StageCacheOutputs,
        view: StageCacheOutputs,
        reqs: dict[str, DriverRequest],
        spans: dict[str, tuple[int, int]],
        resumed: set[str],
    ) -> None:
        c = self.tenure_oracle.counts
        with self._counts_lock:
            for rid in resumed:
                if rid not in view.token_ranges:
                    continue  # retired before its builder ran: the helper's view leaves it out
                start, _ = outputs.token_ranges[rid]
                s0, _ = spans[rid]
                vs, _ = view.token_ranges[rid]
                if start < s0:
                    c.recovered += 1
                    c.recovered_positions += s0 - start
                    c.recovered_after_discard += reqs[rid].incarnation in self._discarded
                if vs > s0:
                    c.shrinking += 1
                    c.replayed_positions += vs - s0

    # ------------------------------------------------------------ run

    def run(self) -> SimResult:
        try:
            res = self._run_events()
        finally:
            self.sched.close()
        self.sched.stats.reordered_steps = self.runner.reordered
        res.scheduler = asdict(self.sched.stats)
        return res

    def _run_events(self) -> SimResult:
        cfg, res = self.cfg, self.result
        started = time.perf_counter()
        counter = LogCounter()
        import logging

        import torch

        logging.getLogger("omni_prefix_cache").addHandler(counter)
        mgr = self._factory(self._prefix_cache_config(), None, cfg.eager)
        mgr.register_policy(
            ModelCachePolicy(needs_full_hidden_states=cfg.cache_hidden, deferred_keys=frozenset({DEFERRED_KEY}))
        )
        helper = PrefixCacheEngineHelper(mgr, self.view, consumer=OUTPUT)
        self.talker = LaggingConsumer(
            TALKER, mgr.delivery_view, mgr.ack_delivery, self.tenure_oracle, cfg.seed, threaded=cfg.lagged
        )
        out = LaggedWorker(_run_job, name="sim-async-output") if cfg.lagged else None
        if out is not None:
            out.start()
        step = 0
        try:
            while step < cfg.steps and not self.sched.idle:
                self._event_step(helper, step, out)
                step += 1
                if self.progress is not None:
                    self.progress(step, cfg.steps, self.sched, res)
            if res.saved_steps == 0:
                raise RuntimeError("no step scheduled a token (is the KV cache too small for the trace?)")
            res.aborted_at_end = len(self.sched.live_requests())
            self.sched.abort_all(step)
            plan = self.sched.schedule(step)  # the last finishes and aborts: an empty step
            self._owners(plan.output)
            helper.begin_step(plan.output)
            self.runner.update_states(plan.output)
            step += 1
            if out is not None:
                out.finish()
            self.talker.close()
            if self.talker.error is not None:
                raise self.talker.error
            self.tenure_oracle.check_complete(self._final, self._fenced)
            res.leaks = wait_quiescent(mgr, timeout_s=5.0)
            res.manager_stats = manager_stats(mgr)
        except Exception as exc:
            res.error = f"step {step}: {type(exc).__name__}: {exc}"
            if out is not None:
                out.abandon()
            res.leaks = probe_leaks(mgr)
        finally:
            try:
                mgr.shutdown()
            except Exception as exc:
                res.error = res.error or f"shutdown: {type(exc).__name__}: {exc}"
        res.steps = step
        res.mismatches = self.oracle.mismatches + self.tenure_oracle.mismatches
        res.rows_checked = self.oracle.checked_rows
        res.mismatch_details = [str(m) for m in self.oracle.details] + self.tenure_oracle.details()
        res.allocator = asdict(self.sched.alloc.stats)
        res.view_off_thread_calls = self.view.off_thread_calls
        res.wall_s = time.perf_counter() - started
        res.torch_threads = torch.get_num_threads()
        res.log_warnings = {"budget_flush": counter.flushes, "unmatch": counter.unmatch, "other": counter.other}
        logging.getLogger("omni_prefix_cache").removeHandler(counter)
        assert isinstance(res, VllmSimResult)
        res.events = asdict(self.tenure_oracle.counts)
        return res


def run_vllm_simulation(
    cfg: SimConfig,
    opts: VllmOptions | None = None,
    *,
    manager_factory: Callable[..., Any] | None = None,
    progress: ProgressFn | None = None,
    trace: list[RequestSpec] | None = None,
    api: str = "events",
) -> VllmSimResult:
    """Run one simulation on vLLM's scheduler and InputBatch, on the event API or (``api="seed"``)
    the seed-era loop. Never raises for manager errors (see ``error``); ValueError for another api."""
    if api == "seed":
        return run_vllm_seed_simulation(cfg, opts, manager_factory=manager_factory, progress=progress, trace=trace)
    if api != "events":
        raise ValueError(f"run_vllm_simulation: api must be 'events' or 'seed', got {api!r}")
    sim = VllmEventSimulation(cfg, opts, manager_factory=manager_factory, progress=progress, trace=trace)
    res = sim.run()
    assert isinstance(res, VllmSimResult)
    return res


def _run_job(job: Callable[[], None]) -> None:
    """The async output thread's job: a step's prepared builder."""
    job()
