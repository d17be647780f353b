"""The engine loop: schedule, drive the manager through one step, check every row.

Per step, on the engine thread: the scheduler decides; the view gets the new
batch; ``new_step_starts``; a fake forward produces rows that are a function
of each position's token prefix; ``save_outputs``. Then the step is either
materialized (and every returned row checked by the oracle) or discarded.
``api``: ``"events"`` (default; adapter, write layouts, two consumers:
``event_driver``, ``delivery_oracle``) or ``"seed"`` (``oracle``).
With ``lag`` the materialize runs on a separate thread one step behind, as
vLLM's async output builder does. Steps that schedule no tokens call only
``new_step_starts`` (vLLM's runner returns before the forward).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.tools.simulate.batch import PersistentBatch, SimGroupView
from omni_prefix_cache.tools.simulate.delivery_oracle import DeliveryOracle
from omni_prefix_cache.tools.simulate.event_driver import EventDriver
from omni_prefix_cache.tools.simulate.lagged import LaggedWorker
from omni_prefix_cache.tools.simulate.oracle import Oracle, RowExpectation
from omni_prefix_cache.tools.simulate.probe import manager_stats, probe_leaks, wait_quiescent
from omni_prefix_cache.tools.simulate.rows import rows_from_hashes
from omni_prefix_cache.tools.simulate.scheduler import Scheduler, SchedulerOutput, SimScheduler, StepPlan
from omni_prefix_cache.tools.simulate.workload import WorkloadConfig, generate_trace

IMMEDIATE_KEY = "talker.h"  # token-major, padded like hidden: cached at the next step
DEFERRED_KEY = "codes.audio"  # token-major, unpadded: deferred until finish/abort or budget
LEFTOVER_KEY = "codes.ref"  # a list, not token-major: snapshotted at save, passed whole to each request

ProgressFn = Callable[[int, int, SimScheduler, "SimResult"], None]


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on; the same config and seed give the same trace."""

    seed: int = 0
    steps: int = 2000  # hard cap; live requests are aborted when it is reached
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_blocks: int = 96
    block_size: int = 16
    token_budget: int = 256
    max_num_seqs: int = 16
    hidden_size: int = 64
    cache_hidden: bool = True  # False: the hidden opt-out (Qwen3-TTS / Higgs talker style)
    immediate_width: int = 16
    deferred_width: int = 4
    dtype: str = "float32"
    pad_multiple: int = 8  # CUDA-graph style padding of small steps
    pad_max_tokens: int = 64
    staging_depth: int = 4
    gpu_staging_bytes: int = 24 * 1024
    discard_prob: float = 0.03
    eager: bool = True
    lag: bool | None = None  # materialize one step behind on a thread; default: on when threaded
    trace_path: str | None = None  # record the run's trace there (docs/trace.md)
    api: str = "events"  # "events": adapter, write layouts, two consumers; "seed": the seed-era scheduler output
    replace_prob: float = 0.02  # events: chance per step that a running request's content is replaced
    local_ack_every: int = 3  # events: the local consumer views and acknowledges every this many outputs
    local_drop_prob: float = 0.1  # events: chance the local consumer drops a view unacknowledged
    spec_tokens: int = 0  # events: speculative decoding, up to this many drafts per decode step (0: off)

    @property
    def lagged(self) -> bool:
        return (not self.eager) if self.lag is None else self.lag

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def widths(self) -> dict[str, int]:
        """Row width of every key the oracle checks (hidden only when it is cached)."""
        out = {HIDDEN_KEY: self.hidden_size} if self.cache_hidden else {}
        return out | {IMMEDIATE_KEY: self.immediate_width, DEFERRED_KEY: self.deferred_width}

    def prefix_cache_config(self) -> PrefixCacheConfig:
        return PrefixCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            gpu_staging_bytes=self.gpu_staging_bytes,
            staging_depth=self.staging_depth,
            staging_capacity_tokens=max(self.token_budget, self.pad_max_tokens),
            trace_path=self.trace_path,
        )


@dataclass
class SimResult:
    """Counters, timings and the verdict of one run."""

    config: dict[str, Any]
    mode: str
    steps: int = 0
    saved_steps: int = 0
    materialized_steps: int = 0
    discarded_steps: int = 0
    tokens: int = 0
    rows_checked: int = 0
    rows_from_cache: int = 0
    engine_us: list[float] = field(default_factory=list)
    materialize_us: list[float] = field(default_factory=list)
    mismatches: int = 0
    mismatch_details: list[str] = field(default_factory=list)
    leaks: dict[str, int | None] = field(default_factory=dict)
    scheduler: dict[str, int] = field(default_factory=dict)
    allocator: dict[str, int] = field(default_factory=dict)
    manager_stats: dict[str, Any] | None = None
    view_off_thread_calls: int = 0
    aborted_at_end: int = 0
    torch_threads: int = 0
    log_warnings: dict[str, int] = field(default_factory=dict)
    delivery: dict[str, Any] = field(default_factory=dict)  # events: the delivery oracle's counts
    wall_s: float = 0.0
    error: str | None = None

    def extra_rows(self) -> list[tuple[str, str]]:
        """Engine-specific rows of the summary table (none for the look-alike engine)."""
        return []

    def extra_summary(self) -> dict[str, Any]:
        """Engine-specific entries of the JSON summary."""
        return {}

    @property
    def leaked(self) -> bool:
        return any(v for v in self.leaks.values())

    @property
    def ok(self) -> bool:
        return self.error is None and self.mismatches == 0 and not self.leaked and not self.checked_nothing

    @property
    def checked_nothing(self) -> bool:
        """No materialized row was compared with the oracle (e.g. every step discarded)."""
        return self.rows_checked == 0


class LogCounter(logging.Handler):
    """Counts the package's warnings by kind during a run.

    Attached to the package logger, it also keeps Python's last-resort
    handler from printing each warning to stderr (``--verbose`` prints them).
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.flushes = 0
        self.unmatch = 0
        self.other = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "flush" in msg:
            self.flushes += 1
        elif "unmatch" in msg:
            self.unmatch += 1
        else:
            self.other += 1


class Simulation:
    """One run of the engine loop against a manager."""

    def __init__(
        self,
        cfg: SimConfig,
        *,
        manager_factory: Callable[[PrefixCacheConfig, Any, bool], Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.cfg = cfg
        self.progress = progress
        self._factory = manager_factory or _default_manager
        self.sched: SimScheduler = Scheduler(
            generate_trace(cfg.workload, cfg.seed),
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            token_budget=cfg.token_budget,
            max_num_seqs=cfg.max_num_seqs,
            seed=cfg.seed,
            vocab=cfg.workload.vocab,
            events=cfg.api == "events",
            replace_prob=cfg.replace_prob if cfg.api == "events" else 0.0,
            spec_tokens=cfg.spec_tokens if cfg.api == "events" else 0,
        )
        if cfg.spec_tokens and cfg.api != "events":
            raise ValueError("SimConfig.spec_tokens needs the event API (speculative decoding needs write layouts)")
        self.view = SimGroupView(cfg.block_size)
        self.batch = PersistentBatch()
        self.oracle = Oracle(cfg.widths(), cfg.torch_dtype, expect_no_hidden=not cfg.cache_hidden)
        self.events: EventDriver | None = None
        self.delivery = DeliveryOracle(cfg.widths(), cfg.torch_dtype)
        if cfg.api not in ("events", "seed"):
            raise ValueError(f"SimConfig.api must be 'events' or 'seed', got {cfg.api!r}")
        every, drop = cfg.local_ack_every, cfg.local_drop_prob
        if cfg.api == "events":
            self.events = EventDriver(self.delivery, seed=cfg.seed, local_ack_every=every, local_drop_prob=drop)
        self.rng = random.Random(cfg.seed ^ 0x5A5A)
        self.result = SimResult(config=_config_dict(cfg), mode="eager" if cfg.eager else "threaded")
        self._stats_lock = threading.Lock()
        self._bufs: dict[str, torch.Tensor] = {}
        self._tag = torch.zeros(3, dtype=torch.float32)  # the leftover entry, overwritten in place each step

    # ------------------------------------------------------------ forward

    def _static(self, key: str, width: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None:
            cap = max(self.cfg.token_budget, self.cfg.pad_max_tokens)
            buf = self._bufs[key] = torch.empty((cap, width), dtype=self.cfg.torch_dtype)
        return buf

    def _forward(self, order: list[str], plan: StepPlan[Any]) -> tuple[torch.Tensor, dict[str, Any], int, int]:
        """Rows of this step written into static output buffers, as a CUDA-graph forward does.

        The next forward overwrites them in place, so a manager that kept a
        view instead of a copy serves the wrong rows under a lagging materialize.
        """
        hashes = torch.cat([_step_hashes(e) for e in _in_order(order, plan)])
        n = int(hashes.numel())
        cfg = self.cfg
        padded = n
        if n <= cfg.pad_max_tokens:
            padded = -(-n // cfg.pad_multiple) * cfg.pad_multiple
        dt = cfg.torch_dtype

        def make(key: str, width: int, rows: int) -> torch.Tensor:
            buf = self._static(key, width)
            buf[:n] = rows_from_hashes(hashes, key, width, dt)
            buf[n:rows] = -7.0  # padding rows: never a legitimate answer
            return buf[:rows]

        hidden = make(HIDDEN_KEY, cfg.hidden_size, padded)
        mm: dict[str, Any] = {IMMEDIATE_KEY: make(IMMEDIATE_KEY, cfg.immediate_width, padded)}
        mm[DEFERRED_KEY] = make(DEFERRED_KEY, cfg.deferred_width, n)
        # Leftover (not token-major): a list passes through whole to every request.
        self._tag.copy_(torch.tensor([plan.step, n, padded], dtype=torch.float32))
        mm[LEFTOVER_KEY] = [self._tag]
        return hidden, mm, n, padded

    def _expectations(self, order: list[str], plan: StepPlan[Any]) -> list[RowExpectation]:
        by_id = {e.req.req_id: e for e in plan.entries}
        out = []
        for r in order:
            e = by_id[r]
            start = 0 if e.manager_hit else e.start
            end = e.start + e.n
            out.append(RowExpectation(r, start, end, e.manager_hit, e.req.hashes.span(start, end).clone()))
        return out

    # ------------------------------------------------------------ consume

    def _consume(self, job: tuple[Any, ...]) -> None:
        mgr, step, step_id, req_ids, exps, leftover, discard, accepted = job
        spec = {} if accepted is None else {"accepted_rows": accepted}  # plain decoding passes nothing
        if discard:
            mgr.discard_step(step_id, **spec)
            with self._stats_lock:
                self.result.discarded_steps += 1
            return
        t0 = time.perf_counter_ns()
        outs = mgr.materialize(step_id, req_ids, **spec)
        dt = (time.perf_counter_ns() - t0) / 1000.0
        if self.events is not None:
            self.events.deliver(mgr, step, step_id, exps, outs, leftover)
        else:
            self.oracle.check(step, step_id, exps, outs, leftover)
        with self._stats_lock:
            self.result.materialize_us.append(dt)
            self.result.materialized_steps += 1
            if self.events is None:
                self.result.rows_from_cache += sum(e.hit for e in exps)

    # ------------------------------------------------------------ run

    def run(self) -> SimResult:
        cfg, res = self.cfg, self.result
        started = time.perf_counter()
        counter = LogCounter()
        logging.getLogger("omni_prefix_cache").addHandler(counter)
        if self.events is not None and not getattr(self.sched, "events", False):
            self.events, res.config["api"] = None, "seed"  # a scheduler (vLLM's driver) without the event form
        # The event API needs no group view: the write layout says where each row goes.
        mgr = self._factory(self._prefix_cache_config(), None if self.events else self.view, cfg.eager)
        mgr.register_policy(
            ModelCachePolicy(needs_full_hidden_states=cfg.cache_hidden, deferred_keys=frozenset({DEFERRED_KEY}))
        )
        worker = LaggedWorker(self._consume) if cfg.lagged else None
        if worker is not None:
            worker.start()
        step = 0
        try:
            while step < cfg.steps and not self.sched.idle:
                self._one_step(mgr, step, worker)
                step += 1
                if self.progress is not None:
                    self.progress(step, cfg.steps, self.sched, res)
            if res.saved_steps == 0:
                raise RuntimeError("no step scheduled a token (is the KV cache too small for the trace?)")
            res.aborted_at_end = len(self.sched.live_requests())
            self.sched.abort_all(step)
            # Tell the manager about the last finishes/aborts (an empty step: no save).
            plan = self.sched.schedule(step)
            self.view.set_step([], {}, {})
            self._timed_new_step(mgr, plan.output)
            step += 1
            if worker is not None:
                worker.finish()
            if self.events is not None:
                self.events.drain_local(mgr, may_drop=False)
                self.delivery.finish()
            res.leaks = wait_quiescent(mgr, timeout_s=5.0)
            res.manager_stats = manager_stats(mgr)
        except Exception as exc:
            res.error = f"step {step}: {type(exc).__name__}: {exc}"
            if worker is not None:
                worker.abandon()
            res.leaks = probe_leaks(mgr)
        finally:
            try:
                mgr.shutdown()
            except Exception as exc:
                res.error = res.error or f"shutdown: {type(exc).__name__}: {exc}"
        res.steps = step
        oracle: Oracle | DeliveryOracle = self.oracle if self.events is None else self.delivery
        res.mismatches = oracle.mismatches
        res.rows_checked = oracle.checked_rows
        res.mismatch_details = [str(m) for m in oracle.details]
        if self.events is not None:
            res.delivery = asdict(self.delivery.counts)
            res.rows_from_cache = self.delivery.counts.rows_from_cache
        res.scheduler = asdict(self.sched.stats)
        res.allocator = asdict(self.sched.alloc.stats)
        res.view_off_thread_calls = self.view.off_thread_calls
        res.wall_s = time.perf_counter() - started
        res.torch_threads = torch.get_num_threads()
        res.log_warnings = {"budget_flush": counter.flushes, "unmatch": counter.unmatch, "other": counter.other}
        logging.getLogger("omni_prefix_cache").removeHandler(counter)
        return res

    def _prefix_cache_config(self) -> PrefixCacheConfig:
        """The manager's config (the vLLM driver keys it by the group its stage gate picked)."""
        return self.cfg.prefix_cache_config()

    def _timed_new_step(self, mgr: Any, out: SchedulerOutput) -> float:
        t0 = time.perf_counter_ns()
        if self.events is not None:
            self.events.new_step(mgr, out)  # the adapter's translation is the engine's cost too
        else:
            mgr.new_step_starts(out)
        return (time.perf_counter_ns() - t0) / 1000.0

    def _batch_order(self, plan: StepPlan[Any]) -> list[str]:
        """Update the input batch for ``plan``; return its row order (what the forward's rows follow)."""
        order = self.batch.update([e.req.req_id for e in plan.entries])
        self.view.set_step(
            order,
            {e.req.req_id: e.req.blocks for e in plan.entries},
            {e.req.req_id: e.start for e in plan.entries},
        )
        return order

    def _one_step(self, mgr: Any, step: int, worker: LaggedWorker | None) -> None:
        res = self.result
        plan = self.sched.schedule(step)
        order = self._batch_order(plan)
        engine_us = self._timed_new_step(mgr, plan.output)
        if not plan.entries:
            self.sched.update(plan)
            return
        hidden, mm, n, padded = self._forward(order, plan)
        events = self.events
        exps: list[Any] = self._expectations(order, plan) if events is None else events.expectations(order, plan)
        t0 = time.perf_counter_ns()
        if events is None:
            step_id = mgr.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded)
        else:
            step_id = events.save(mgr, self.view, hidden, mm, n, padded)
        engine_us += (time.perf_counter_ns() - t0) / 1000.0
        res.engine_us.append(engine_us)
        res.saved_steps += 1
        res.tokens += n
        rot = step % len(order)
        req_ids = order[rot:] + order[:rot]  # materialize maps by id, not by position
        leftover = {LEFTOVER_KEY: [torch.tensor([step, n, padded], dtype=torch.float32)]}
        discard = self.rng.random() < self.cfg.discard_prob
        if events is not None:
            # The scheduler applies the step first: whether it may be discarded depends on who finished.
            self.sched.update(plan)
            discard = events.after_update(self.sched, plan, exps, discard)
        # Speculative decoding: the runner's len(sampled_token_ids[i]) of each drafted request.
        accepted = {e.req.req_id: e.sampled for e in plan.entries if e.drafts} or None
        job = (mgr, step, step_id, req_ids, exps, leftover, discard, accepted)
        if worker is None:
            self._consume(job)
        else:
            worker.submit(job)
        if events is None:
            self.sched.update(plan)


def _in_order(order: list[str], plan: StepPlan[Any]) -> list[Any]:
    by_id = {e.req.req_id: e for e in plan.entries}
    return [by_id[r] for r in order]


def _step_hashes(e: Any) -> torch.Tensor:
    """The prefix hashes of the tokens one request's rows of the step are
    computed on: its own, then (speculative decoding) its draft tokens,
    right or wrong, so a rejected draft's row differs from the position's."""
    if not e.drafts:
        own: torch.Tensor = e.req.hashes.span(e.start, e.start + e.n)
        return own
    verified = e.start + e.n - len(e.drafts)
    return torch.cat([e.req.hashes.span(e.start, verified), e.req.hashes.chained(e.drafts)])


def _default_manager(config: PrefixCacheConfig, view: Any, eager: bool) -> Any:
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(config, view, eager=eager)


def _config_dict(cfg: SimConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["lag"] = cfg.lagged
    return d


def run_simulation(
    cfg: SimConfig,
    *,
    manager_factory: Callable[[PrefixCacheConfig, Any, bool], Any] | None = None,
    progress: ProgressFn | None = None,
) -> SimResult:
    """Run one simulation and return its result (never raises for manager errors; see ``error``)."""
    return Simulation(cfg, manager_factory=manager_factory, progress=progress).run()
