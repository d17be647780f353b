"""Benchmarks: what the manager costs the engine thread and the output builder per step.

Each scenario is scheduled ahead of time by the simulator's scheduler, so the
timed loop runs only the manager calls (``new_step_starts`` + ``save_outputs``
for the engine thread; ``materialize`` for the output builder). Next to every
timed call the same loop times a memcpy floor: a torch clone of the same
bytes (the step's saved rows for the engine; the rows materialize returned,
as one contiguous tensor per key, for the builder). Targets are ratios to
that floor, so they travel between machines.

Scenarios:

- ``decode``: 64 requests x 1 token per step, hidden 2048 bf16, one
  token-major mm key.
- ``prefill_hits``: 512-token prompts sharing a 256-token system prompt,
  block size 16, 2048-token steps; later arrivals hit the system prompt.
- ``deferred``: a deferred mm key; two-turn conversations whose second turn
  hits the first turn's prompt and answer.
- ``decode_256``: ``decode`` at 256 requests.
- ``decode_mm4``: ``decode`` with four token-major mm keys.
- ``sweep``: ``decode`` at 16, 64 and 256 requests (engine us per request).

Every scenario runs in eager and threaded mode (``--mode``). Targets (issue
"batched write path") are checked per (scenario, mode) and printed with
their verdicts; with a baseline file (the previous release's report, kept as
``docs/bench_baseline.json``) every row also shows its floor-normalised
ratio to the baseline's.

Each (scenario, mode) also reports the step total: engine plus materialize
wall time of the same step (p50 of the per-step sums). In threaded mode the
committer thread's pass for a step overlaps that step's materialize (the
bench has no forward pass between steps to hide it behind), and the two
threads share the GIL, so work moved off the engine thread can show up as
materialize wall time; the step total is what the engine loop pays for both.
It is compared with the baseline as raw wall time against the sum of the
baseline's two medians (the baseline keeps medians, not per-step sums).
Threaded rows also report the committer thread's CPU time inside each
timed call (read from its thread CPU clock, where the platform has one).

``--forward-us N`` (default 0) simulates the forward pass a real engine runs
between ``new_step_starts`` and ``save_outputs``: the engine thread sleeps N
us there (releasing the GIL, as a wait on the GPU does), outside the timed
engine span. Without it the hit prefetches ``new_step_starts`` starts run
inside ``save_outputs``, on a machine with fewer free cores than threads.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.tools.simulate.batch import PersistentBatch, SimGroupView
from omni_prefix_cache.tools.simulate.scheduler import Scheduler, SchedulerOutput
from omni_prefix_cache.tools.simulate.workload import FollowupSpec, RequestSpec

MM_KEY = "talker.h"
DEFERRED_KEY = "codes.audio"
BASELINE_PATH = "docs/bench_baseline.json"
# A scenario may not get slower than the baseline by more than this (floor-normalised).
BASELINE_SLACK = 1.05
STEP_SIDE = "engine+materialize"


# ---------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """A bench scenario: a trace plus the model's output shapes."""

    name: str
    trace: Callable[[random.Random], list[RequestSpec]]
    block_size: int = 16
    token_budget: int = 2048
    max_num_seqs: int = 256
    num_blocks: int = 2048
    hidden: int = 2048
    mm_width: int = 128
    deferred: bool = False
    dtype: torch.dtype = torch.bfloat16
    warmup: int = 10
    iters: int = 100
    mm_keys: int = 1  # token-major mm keys per step (talker.h, talker.h1, ...)
    targets: tuple[Target, ...] = ()


@dataclass(frozen=True)
class Target:
    """A bench target: ``metric(result) <= limit(result)`` in ``modes``."""

    name: str
    metric: Callable[[ScenarioResult], float]
    limit: Callable[[ScenarioResult], float]
    describe: str
    modes: tuple[str, ...] = ("eager", "threaded")
    # Same-run context printed beside the verdict (e.g. the floor the
    # target sits against), or None.
    context: Callable[[ScenarioResult], str] | None = None


def _mm_key(i: int) -> str:
    return MM_KEY if i == 0 else f"{MM_KEY}{i}"


DECODE_TARGETS = (
    Target(
        "engine us/request",
        lambda r: r.engine_us_per_request,
        lambda r: 5.0,
        "<= 5 us",
        ("eager",),
        # The data movement alone, per request: no bookkeeping can go under it.
        lambda r: f"staging copy + pool index_copy_ alone {r.move_floor_us / max(r.requests_per_step, 1e-9):.2f} us",
    ),
    Target("materialize / floor", lambda r: r.materialize_ratio, lambda r: 20.0, "<= 20x", ("eager",)),
)
PREFILL_TARGETS = (
    Target(
        "engine / data movement",
        lambda r: r.engine_us_p50 / r.move_floor_us if r.move_floor_us > 0 else float("inf"),
        lambda r: 2.0,
        "<= 2x (staging copy + pool index_copy_)",
        ("eager",),
    ),
    Target(
        "engine - staging copy",
        lambda r: r.engine_us_p50 - r.staging_copy_us,
        lambda r: 150.0,
        "<= 150 us",
        ("threaded",),
    ),
    Target("materialize / floor", lambda r: r.materialize_ratio, lambda r: 2.5, "<= 2.5x", ("eager", "threaded")),
)


def _toks(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(32000) for _ in range(n))


def _decode_trace(num_reqs: int, prompt: int, steps: int) -> Callable[[random.Random], list[RequestSpec]]:
    def make(rng: random.Random) -> list[RequestSpec]:
        return [RequestSpec(f"d{i}", 0, (_toks(rng, prompt),), max_output=steps + 8) for i in range(num_reqs)]

    return make


def _prefill_hits_trace(steps: int, per_step: int = 8) -> Callable[[random.Random], list[RequestSpec]]:
    def make(rng: random.Random) -> list[RequestSpec]:
        system = _toks(rng, 256)
        return [
            RequestSpec(f"p{s}_{i}", s, (system + _toks(rng, 256),), max_output=1)
            for s in range(steps)
            for i in range(per_step)
        ]

    return make


def _deferred_trace(steps: int, per_step: int = 2) -> Callable[[random.Random], list[RequestSpec]]:
    def make(rng: random.Random) -> list[RequestSpec]:
        return [
            RequestSpec(
                f"c{s}_{i}",
                s,
                (_toks(rng, 256),),
                max_output=16,
                followup=FollowupSpec(delay=0, extra=_toks(rng, 64), max_output=16),
            )
            for s in range(steps)
            for i in range(per_step)
        ]

    return make


def decode_scenario(num_reqs: int = 64, *, warmup: int = 20, iters: int = 200, mm_keys: int = 1) -> Scenario:
    steps = warmup + iters + 2
    prompt = 16
    blocks = num_reqs * (-(-(prompt + steps + 8) // 16) + 1)
    name = "decode" if num_reqs == 64 else f"decode_{num_reqs}"
    return Scenario(
        name=name if mm_keys == 1 else f"{name}_mm{mm_keys}",
        trace=_decode_trace(num_reqs, prompt, steps),
        token_budget=max(2048, num_reqs * prompt),
        max_num_seqs=num_reqs,
        num_blocks=blocks,
        warmup=warmup,
        iters=iters,
        mm_keys=mm_keys,
        targets=DECODE_TARGETS if num_reqs == 64 and mm_keys == 1 else (),
    )


def prefill_hits_scenario(*, warmup: int = 5, iters: int = 40) -> Scenario:
    return Scenario(
        name="prefill_hits",
        trace=_prefill_hits_trace(warmup + iters + 8),
        num_blocks=1024,
        warmup=warmup,
        iters=iters,
        targets=PREFILL_TARGETS,
    )


def deferred_scenario(*, warmup: int = 20, iters: int = 150) -> Scenario:
    return Scenario(
        name="deferred",
        trace=_deferred_trace(warmup + iters + 8),
        num_blocks=2048,
        deferred=True,
        warmup=warmup,
        iters=iters,
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "decode": decode_scenario,
    "decode_256": lambda **kw: decode_scenario(256, **{"iters": 100, **kw}),
    "decode_mm4": lambda **kw: decode_scenario(64, mm_keys=4, **kw),
    "prefill_hits": prefill_hits_scenario,
    "deferred": deferred_scenario,
}
MODES = ("eager", "threaded")
SWEEP_SIZES = (16, 64, 256)
SWEEP_TARGET = 1.30  # max/min engine us per request across the sweep


# ---------------------------------------------------------------- planning


@dataclass
class StepInput:
    """Everything one replayed step needs, computed before timing starts."""

    output: SchedulerOutput
    order: list[str]
    blocks: dict[str, list[int]]
    computed: dict[str, int]
    n: int


def plan_steps(sc: Scenario, total: int, seed: int = 0) -> list[StepInput]:
    """Run the scenario's scheduler ahead of time; keep steps that schedule tokens."""
    sched = Scheduler(
        sc.trace(random.Random(seed)),
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        token_budget=sc.token_budget,
        max_num_seqs=sc.max_num_seqs,
        seed=seed,
    )
    batch = PersistentBatch()
    out: list[StepInput] = []
    step = 0
    while len(out) < total and not sched.idle:
        plan = sched.schedule(step)
        step += 1
        if plan.entries:
            order = batch.update([e.req.req_id for e in plan.entries])
            out.append(
                StepInput(
                    output=plan.output,
                    order=order,
                    blocks={e.req.req_id: list(e.req.blocks) for e in plan.entries},
                    computed={e.req.req_id: e.start for e in plan.entries},
                    n=sum(e.n for e in plan.entries),
                )
            )
        sched.update(plan)
    if len(out) < total:
        raise RuntimeError(f"scenario {sc.name}: trace ran out after {len(out)} of {total} steps")
    return out


# ---------------------------------------------------------------- running


@dataclass
class TargetVerdict:
    name: str
    describe: str
    value: float
    limit: float
    met: bool
    context: str = ""  # same-run context (Target.context), "" when none


@dataclass
class ScenarioResult:
    """Medians/p90s of one scenario in one mode, its floors and target verdicts."""

    name: str
    mode: str
    steps: int
    requests_per_step: float
    tokens_per_step: float
    engine_us_p50: float
    engine_us_p90: float
    materialize_us_p50: float
    materialize_us_p90: float
    engine_floor_us: float
    materialize_floor_us: float
    engine_ratio: float
    materialize_ratio: float
    tokens_per_s: float
    engine_us_per_request: float
    materialize_us_per_request: float = 0.0
    # The data movement the engine must do, timed in the same loop: a copy of
    # the step's rows into a staging buffer, then index_copy_ of those rows
    # into a pool of the same shape at the step's slots.
    staging_copy_us: float = 0.0
    move_floor_us: float = 0.0
    hit_rows_per_step: float = 0.0
    # Thread CPU time of the calling thread (time another process or thread ran is not counted).
    engine_cpu_us_p50: float = 0.0
    materialize_cpu_us_p50: float = 0.0
    engine_cpu_ratio: float = 0.0
    materialize_cpu_ratio: float = 0.0
    verdicts: list[TargetVerdict] = field(default_factory=list)
    # Engine + materialize wall (and calling-thread CPU) of the same step: p50 of the per-step sums.
    step_us_p50: float = 0.0
    step_cpu_us_p50: float = 0.0
    # The committer thread's CPU time inside the engine / materialize calls, p50 per step
    # (None: no committer thread, or no per-thread CPU clock on this platform).
    committer_cpu_engine_us_p50: float | None = None
    committer_cpu_materialize_us_p50: float | None = None
    # Floor-normalised ratio to the baseline report's same row (None: no baseline row).
    engine_vs_baseline: float | None = None
    materialize_vs_baseline: float | None = None
    # Raw wall ratios to the baseline row's medians (the step total: to the sum of its two medians),
    # and the baseline's materialize floor, so a floor that moved can be told from a slower call.
    engine_wall_vs_baseline: float | None = None
    materialize_wall_vs_baseline: float | None = None
    step_vs_baseline: float | None = None
    baseline_materialize_floor_us: float | None = None
    # Simulated forward pass between new_step_starts and save_outputs (us, not timed; 0: none).
    forward_us: float = 0.0
    # Minor page faults the engine thread took per step (p50) inside the engine
    # calls and inside materialize (None: no per-thread usage on this OS).
    engine_faults_p50: float | None = None
    materialize_faults_p50: float | None = None

    def judge(self, targets: tuple[Target, ...]) -> None:
        """Evaluate ``targets`` that apply to this result's mode."""
        self.verdicts = []
        for t in targets:
            if self.mode in t.modes:
                value, limit = t.metric(self), t.limit(self)
                context = t.context(self) if t.context is not None else ""
                self.verdicts.append(TargetVerdict(t.name, t.describe, value, limit, value <= limit, context))

    @property
    def met(self) -> bool | None:
        """All of this row's targets met (None: it has none)."""
        return None if not self.verdicts else all(v.met for v in self.verdicts)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100.0 * (len(s) - 1))))]


def _floor_us(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """Wall and thread-CPU microseconds of cloning ``tensors``."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for t in tensors:
        t.clone()
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return (t1 - t0) / 1000.0, (c1 - c0) / 1000.0


def _move_floor_us(
    srcs: list[torch.Tensor], staging: list[torch.Tensor], pools: list[torch.Tensor], slots: torch.Tensor
) -> tuple[float, float]:
    """Wall microseconds of (copying ``srcs`` into ``staging``; that copy plus
    ``index_copy_`` of the staged rows into ``pools`` at ``slots``)."""
    t0 = time.perf_counter_ns()
    for src, stage in zip(srcs, staging):
        stage[: src.shape[0]].copy_(src)
    t1 = time.perf_counter_ns()
    for src, stage, pool in zip(srcs, staging, pools):
        n = src.shape[0]
        pool.index_copy_(0, slots[:n], stage[:n])
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1000.0, (t2 - t0) / 1000.0


# Minor page faults of the calling thread (Linux); None where the OS has no
# per-thread usage.
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _thread_faults() -> int:
    """Minor page faults the calling thread has taken so far (0 without
    per-thread usage): a first write to a page of a fresh pool slab or
    output buffer costs one, and the floors' warm buffers take none."""
    return 0 if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD).ru_minflt


def _committer_clock(before: set[threading.Thread]) -> Callable[[], int] | None:
    """The CPU clock (ns) of the committer thread started since ``before``
    was taken, or None (eager, another manager, no ``pthread_getcpuclockid``)."""
    started = [t.ident for t in threading.enumerate() if t not in before and "committer" in t.name]
    ident = started[0] if len(started) == 1 else None
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    clock = time.pthread_getcpuclockid(ident)
    return lambda: time.clock_gettime_ns(clock)


def _returned_rows(outs: Any) -> dict[str, int]:
    rows: dict[str, int] = {}
    if outs.hidden_states is not None:
        rows[HIDDEN_KEY] = sum(int(t.shape[0]) for t in outs.hidden_states.values())
    for key, per_req in outs.mm_outputs.items():
        rows[key] = sum(int(t.shape[0]) for t in per_req.values() if isinstance(t, torch.Tensor))
    return rows


def run_scenario(
    sc: Scenario,
    *,
    eager: bool = True,
    iters: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    profiler: cProfile.Profile | None = None,
    manager_factory: Callable[[PrefixCacheConfig, Any, bool], Any] | None = None,
    on_step: Callable[[], None] | None = None,
    forward_us: float = 0.0,
) -> ScenarioResult:
    """Replay ``sc`` against a fresh manager; time the facade calls and the memcpy floors.
    ``on_step`` is called after every step (warmup included), outside the timed spans.
    ``forward_us``: the engine thread sleeps that long between ``new_step_starts`` and
    ``save_outputs`` (a forward pass), not counted in the engine time."""
    iters = sc.iters if iters is None else iters
    warmup = sc.warmup if warmup is None else warmup
    steps = plan_steps(sc, warmup + iters, seed)
    max_n = max(s.n for s in steps)
    cfg = PrefixCacheConfig(
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        staging_capacity_tokens=max(sc.token_budget, max_n),
    )
    view = SimGroupView(sc.block_size)
    threads_before = set(threading.enumerate())
    if manager_factory is None:
        from omni_prefix_cache.manager import OmniPrefixCacheManager

        mgr = OmniPrefixCacheManager(cfg, view, eager=eager)
    else:
        mgr = manager_factory(cfg, view, eager)
    committer_cpu = _committer_clock(threads_before)
    keys = frozenset({DEFERRED_KEY}) if sc.deferred else frozenset()
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=keys))
    gen = torch.Generator().manual_seed(seed)
    # Static forward buffers, as with CUDA graphs: each step's outputs are views of them.
    hidden_buf = torch.randn((max_n, sc.hidden), generator=gen).to(sc.dtype)
    mm_bufs = {_mm_key(i): torch.randn((max_n, sc.mm_width), generator=gen).to(sc.dtype) for i in range(sc.mm_keys)}
    widths = {HIDDEN_KEY: sc.hidden, **{k: sc.mm_width for k in mm_bufs}}
    if sc.deferred:
        widths[DEFERRED_KEY] = 16
        def_buf = torch.randn((max_n, 16), generator=gen).to(sc.dtype)
    floor_src = {k: torch.randn((max(4 * max_n, 8192), w), generator=gen).to(sc.dtype) for k, w in widths.items()}
    pool_rows = sc.num_blocks * sc.block_size
    move_keys = list(widths)
    staging = [torch.empty((max_n, widths[k]), dtype=sc.dtype) for k in move_keys]
    pools = [torch.zeros((pool_rows, widths[k]), dtype=sc.dtype) for k in move_keys]
    move_slots = torch.randperm(pool_rows, generator=gen)[:max_n]
    stage_copy: list[float] = []
    move_floor: list[float] = []
    eng: list[float] = []
    mat: list[float] = []
    eng_floor: list[float] = []
    mat_floor: list[float] = []
    eng_cpu: list[float] = []
    mat_cpu: list[float] = []
    eng_floor_cpu: list[float] = []
    mat_floor_cpu: list[float] = []
    com_eng: list[float] = []
    com_mat: list[float] = []
    eng_faults: list[float] = []
    mat_faults: list[float] = []
    k0 = k1 = k2 = 0
    reqs = tokens = hit_rows = 0
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i, st in enumerate(steps):
            view.set_step(st.order, st.blocks, st.computed)
            n = st.n
            mm = {k: b[:n] for k, b in mm_bufs.items()}
            if sc.deferred:
                mm[DEFERRED_KEY] = def_buf[:n]
            timed = i >= warmup
            if timed and profiler is not None:
                profiler.enable()
            if committer_cpu is not None:
                k0 = committer_cpu()
            f0 = _thread_faults()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            mgr.new_step_starts(st.output)
            if forward_us > 0:
                fa, ca = time.perf_counter_ns(), time.thread_time_ns()
                ka = committer_cpu() if committer_cpu is not None else 0
                time.sleep(forward_us / 1e6)
                kb = committer_cpu() if committer_cpu is not None else 0
                # The forward is not engine time: shift the span's start by its length.
                cb, fb = time.thread_time_ns(), time.perf_counter_ns()
                t0, c0, k0 = t0 + (fb - fa), c0 + (cb - ca), k0 + (kb - ka)
            sid = mgr.save_outputs(hidden_buf[:n], mm, num_tokens_unpadded=n, num_tokens_padded=n)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            if committer_cpu is not None:
                # Read between the two timed calls: materialize's span starts after it.
                k1 = committer_cpu()
                c1, t1m = time.thread_time_ns(), time.perf_counter_ns()
            else:
                t1m = t1
            f1 = _thread_faults()
            outs = mgr.materialize(sid, st.order)
            t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
            f2 = _thread_faults()
            if committer_cpu is not None:
                k2 = committer_cpu()
            if timed and profiler is not None:
                profiler.disable()
            if on_step is not None:
                on_step()
            if not timed:
                continue
            eng.append((t1 - t0) / 1000.0)
            mat.append((t2 - t1m) / 1000.0)
            com_eng.append((k1 - k0) / 1000.0)
            com_mat.append((k2 - k1) / 1000.0)
            eng_cpu.append((c1 - c0) / 1000.0)
            mat_cpu.append((c2 - c1) / 1000.0)
            eng_faults.append(float(f1 - f0))
            mat_faults.append(float(f2 - f1))
            wall, cpu = _floor_us([hidden_buf[:n], *mm.values()])
            eng_floor.append(wall)
            eng_floor_cpu.append(cpu)
            srcs = [hidden_buf[:n], *(mm[k] for k in move_keys[1:])]
            staged, moved = _move_floor_us(srcs, staging, pools, move_slots)
            stage_copy.append(staged)
            move_floor.append(moved)
            returned = _returned_rows(outs)
            wall, cpu = _floor_us([floor_src[k][:r] for k, r in returned.items() if k in floor_src])
            mat_floor.append(wall)
            mat_floor_cpu.append(cpu)
            reqs += len(st.order)
            tokens += n
            hit_rows += returned.get(HIDDEN_KEY, n) - n
    finally:
        if gc_was:
            gc.enable()
        mgr.shutdown()
    e50, m50 = _pct(eng, 50), _pct(mat, 50)
    step_sum = [e + m for e, m in zip(eng, mat)]
    step_cpu = [e + m for e, m in zip(eng_cpu, mat_cpu)]
    ef, mf = _pct(eng_floor, 50), _pct(mat_floor, 50)
    ec, mc = _pct(eng_cpu, 50), _pct(mat_cpu, 50)
    efc, mfc = _pct(eng_floor_cpu, 50), _pct(mat_floor_cpu, 50)
    total_s = (sum(eng) + sum(mat)) / 1e6
    per_step = reqs / len(eng)
    result = ScenarioResult(
        name=sc.name,
        mode="eager" if eager else "threaded",
        steps=len(eng),
        requests_per_step=reqs / len(eng),
        tokens_per_step=tokens / len(eng),
        engine_us_p50=e50,
        engine_us_p90=_pct(eng, 90),
        materialize_us_p50=m50,
        materialize_us_p90=_pct(mat, 90),
        engine_floor_us=ef,
        materialize_floor_us=mf,
        engine_ratio=e50 / ef if ef > 0 else float("inf"),
        materialize_ratio=m50 / mf if mf > 0 else float("inf"),
        tokens_per_s=tokens / total_s if total_s > 0 else 0.0,
        engine_us_per_request=e50 / per_step,
        materialize_us_per_request=m50 / per_step,
        staging_copy_us=_pct(stage_copy, 50),
        move_floor_us=_pct(move_floor, 50),
        hit_rows_per_step=hit_rows / len(eng),
        engine_cpu_us_p50=ec,
        materialize_cpu_us_p50=mc,
        engine_cpu_ratio=ec / efc if efc > 0 else float("inf"),
        materialize_cpu_ratio=mc / mfc if mfc > 0 else float("inf"),
        step_us_p50=_pct(step_sum, 50),
        step_cpu_us_p50=_pct(step_cpu, 50),
        committer_cpu_engine_us_p50=None if committer_cpu is None else _pct(com_eng, 50),
        committer_cpu_materialize_us_p50=None if committer_cpu is None else _pct(com_mat, 50),
        forward_us=float(forward_us),
        engine_faults_p50=_pct(eng_faults, 50) if _RUSAGE_THREAD is not None else None,
        materialize_faults_p50=_pct(mat_faults, 50) if _RUSAGE_THREAD is not None else None,
    )
    result.judge(sc.targets)
    return result


@dataclass
class BenchReport:
    modes: tuple[str, ...]
    torch_threads: int
    results: list[ScenarioResult]
    sweep: list[ScenarioResult]
    sweep_spread: float | None = None  # max/min engine us per request across the sweep (wall p50)
    sweep_cpu_spread: float | None = None  # the same from thread CPU time
    sweep_target: float = SWEEP_TARGET
    baseline: str | None = None  # where the baseline came from
    baseline_slack: float = BASELINE_SLACK

    @property
    def mode(self) -> str:
        return "+".join(self.modes)

    @property
    def sweep_met(self) -> bool | None:
        return None if self.sweep_spread is None else self.sweep_spread <= self.sweep_target

    @property
    def sweep_fit(self) -> tuple[float, float] | None:
        """``(fixed us per step, us per request)``: least squares of the
        sweep's engine p50 against its requests per step (None with fewer
        than two batch sizes). Splits what the spread target is about: the
        fixed part is what small batches cannot amortize."""
        return linear_fit([(r.requests_per_step, r.engine_us_p50) for r in self.sweep])

    @property
    def sweep_fixed_allowed_us(self) -> float | None:
        """The largest fixed per-step cost that would meet the spread target
        at the fitted per-request cost, across the sweep's smallest and
        largest batch (None without a fit or with a non-positive
        per-request cost)."""
        fit = self.sweep_fit
        if fit is None:
            return None
        sizes = [r.requests_per_step for r in self.sweep]
        return fixed_cost_allowed(fit[1], min(sizes), max(sizes), self.sweep_target)

    def baseline_verdicts(self) -> list[tuple[ScenarioResult, str, float, bool]]:
        """(row, side, ratio to baseline, within slack) for every row the baseline has: engine and
        materialize floor-normalised, the step total (``engine+materialize``) as raw wall time."""
        out = []
        for r in self.results:
            sides = (
                ("engine", r.engine_vs_baseline),
                ("materialize", r.materialize_vs_baseline),
                (STEP_SIDE, r.step_vs_baseline),
            )
            for side, ratio in sides:
                if ratio is not None:
                    out.append((r, side, ratio, ratio <= self.baseline_slack))
        return out

    @property
    def all_met(self) -> bool:
        verdicts = [r.met for r in self.results] + [self.sweep_met]
        verdicts += [ok for *_, ok in self.baseline_verdicts()]
        return all(v is not False for v in verdicts)

    def to_dict(self) -> dict[str, Any]:
        def one(r: ScenarioResult) -> dict[str, Any]:
            d = asdict(r)
            d["met"] = r.met
            return d

        return {
            "mode": self.mode,
            "modes": list(self.modes),
            "torch_threads": self.torch_threads,
            "results": [one(r) for r in self.results],
            "sweep": [one(r) for r in self.sweep],
            "sweep_spread": self.sweep_spread,
            "sweep_cpu_spread": self.sweep_cpu_spread,
            "sweep_target": self.sweep_target,
            "sweep_met": self.sweep_met,
            "sweep_fit": None if self.sweep_fit is None else list(self.sweep_fit),
            "sweep_fixed_allowed_us": self.sweep_fixed_allowed_us,
            "baseline": self.baseline,
            "all_met": self.all_met,
        }


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b * x``: ``(a, b)``; None when fewer than two
    distinct x values."""
    if len({x for x, _ in points}) < 2:
        return None
    b, a = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return a, b


def fixed_cost_allowed(per_request: float, n_min: float, n_max: float, target: float) -> float | None:
    """The largest fixed per-step cost ``a`` for which the per-request cost
    ``a / n + per_request`` varies at most ``target``-fold between ``n_min``
    and ``n_max`` requests per step: infinite when the batch sizes are
    within ``target`` of each other (any fixed cost is), None for a
    non-positive per-request cost."""
    denom = 1.0 / n_min - target / n_max
    if per_request <= 0 or denom <= 0:
        return None if per_request <= 0 else float("inf")
    return per_request * (target - 1.0) / denom


def load_baseline(path: str) -> dict[tuple[str, str], dict[str, float]]:
    """(scenario, mode) -> the baseline row's ``engine_ratio`` / ``materialize_ratio``
    (floor-normalised, so they compare across runs better than raw times) and
    its raw medians and materialize floor (``*_us``). Raises ValueError naming
    the file when it is not a bench ``--json`` report."""
    try:
        with open(path) as f:
            data = json.load(f)
        rows = data["results"]
        return {
            (r["name"], r["mode"]): {
                "engine": float(r["engine_ratio"]),
                "materialize": float(r["materialize_ratio"]),
                "engine_us": float(r["engine_us_p50"]),
                "materialize_us": float(r["materialize_us_p50"]),
                "materialize_floor_us": float(r["materialize_floor_us"]),
            }
            for r in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"baseline {path}: not a bench --json report ({exc})") from exc


def _over(value: float, base: float) -> float | None:
    return value / base if base > 0 else None


def run_bench(
    names: list[str] | None = None,
    *,
    eager: bool | None = None,
    modes: tuple[str, ...] | None = None,
    iters: int | None = None,
    warmup: int | None = None,
    sweep: bool = True,
    baseline: str | None = None,
    manager_factory: Callable[[PrefixCacheConfig, Any, bool], Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    forward_us: float = 0.0,
) -> BenchReport:
    """Run the named scenarios (default all) in each of ``modes`` (default
    both; ``eager`` picks one, for old callers), then the decode sweep
    (eager). ``baseline``: a bench ``--json`` report to compare with.
    ``progress(done, total)`` is called after every step of every run.
    ``forward_us``: a simulated forward pass per step (see ``run_scenario``)."""
    names = list(SCENARIOS) if not names else names
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    if modes is None:
        modes = MODES if eager is None else ("eager" if eager else "threaded",)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    base = load_baseline(baseline) if baseline else None
    plan = [SCENARIOS[n]() for n in names]
    sweep_plan = [decode_scenario(r, iters=100) for r in SWEEP_SIZES] if sweep else []
    total = sum(
        (sc.warmup if warmup is None else warmup) + (sc.iters if iters is None else iters)
        for sc in [*[p for p in plan for _ in modes], *sweep_plan]
    )
    done = 0

    def step_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    kw: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "manager_factory": manager_factory,
        "on_step": step_done if progress is not None else None,
        "forward_us": forward_us,
    }
    # Modes side by side per scenario, so their ratios share the machine's state.
    results = [run_scenario(sc, eager=mode == "eager", **kw) for sc in plan for mode in modes]
    if base is not None:
        for r in results:
            row = base.get((r.name, r.mode))
            if row is not None:
                r.engine_vs_baseline = r.engine_ratio / row["engine"] if row["engine"] > 0 else None
                r.materialize_vs_baseline = r.materialize_ratio / row["materialize"] if row["materialize"] > 0 else None
                r.engine_wall_vs_baseline = _over(r.engine_us_p50, row["engine_us"])
                r.materialize_wall_vs_baseline = _over(r.materialize_us_p50, row["materialize_us"])
                r.step_vs_baseline = _over(r.step_us_p50, row["engine_us"] + row["materialize_us"])
                r.baseline_materialize_floor_us = row["materialize_floor_us"]
    sweep_results: list[ScenarioResult] = []
    spread = cpu_spread = None
    if sweep:
        sweep_results = [run_scenario(sc, eager=True, **kw) for sc in sweep_plan]
        per_req = [r.engine_us_per_request for r in sweep_results]
        spread = max(per_req) / min(per_req)
        per_req_cpu = [r.engine_cpu_us_p50 / r.requests_per_step for r in sweep_results]
        cpu_spread = max(per_req_cpu) / min(per_req_cpu)
    return BenchReport(
        modes=tuple(modes),
        torch_threads=torch.get_num_threads(),
        results=results,
        sweep=sweep_results,
        sweep_spread=spread,
        sweep_cpu_spread=cpu_spread,
        baseline=baseline,
    )


# ---------------------------------------------------------------- output


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def _vs(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _raw_note(r: ScenarioResult, side: str) -> str:
    """The raw wall ratio behind a floor-normalised baseline verdict (and, for
    materialize, both floors: a floor the committer thread slowed in one run
    moves the normalised ratio without the call changing)."""
    if side == "engine" and r.engine_wall_vs_baseline is not None:
        return f" (raw wall {_vs(r.engine_wall_vs_baseline)})"
    if side == "materialize" and r.materialize_wall_vs_baseline is not None:
        floors = ""
        if r.baseline_materialize_floor_us is not None:
            floors = f"; floor {r.materialize_floor_us:.0f} us here, {r.baseline_materialize_floor_us:.0f} us there"
        return f" (raw wall {_vs(r.materialize_wall_vs_baseline)}{floors})"
    return ""


def format_report(rep: BenchReport) -> str:
    """The bench tables: one row per (scenario, mode, side), the targets with
    their verdicts, the sweep, and the comparison with the baseline.

    ``ratio`` is wall p50 / floor p50; ``cpu ratio`` the same with the calling
    thread's CPU time, which a busy machine disturbs less; ``us/req`` the p50
    per request; ``vs base`` the ratio divided by the baseline report's.
    """
    head = (
        f"{'scenario':<13} {'mode':<8} {'side':<11} {'p50 us':>9} {'p90 us':>9} {'floor us':>9} {'ratio':>7} "
        f"{'cpu us':>9} {'cpu ratio':>9} {'us/req':>8} {'req/step':>8} {'vs base':>7}"
    )
    lines = [f"modes: {', '.join(rep.modes)} (torch threads: {rep.torch_threads})"]
    forward = {r.forward_us for r in [*rep.results, *rep.sweep]}
    if forward != {0.0} and forward:
        lines.append(
            f"forward: {', '.join(f'{f:.0f}' for f in sorted(forward))} us slept by the engine thread between "
            "new_step_starts and save_outputs (not in engine time)"
        )
    lines += [head, "-" * len(head)]
    for r in rep.results:
        sides = (
            ("engine", r.engine_us_p50, r.engine_us_p90, r.engine_floor_us, r.engine_ratio, r.engine_cpu_us_p50,
             r.engine_cpu_ratio, r.engine_us_per_request, r.engine_vs_baseline),
            ("materialize", r.materialize_us_p50, r.materialize_us_p90, r.materialize_floor_us, r.materialize_ratio,
             r.materialize_cpu_us_p50, r.materialize_cpu_ratio, r.materialize_us_per_request,
             r.materialize_vs_baseline),
        )  # fmt: skip
        for side, p50, p90, floor, ratio, cpu, cpu_ratio, per_req, vs in sides:
            lines.append(
                f"{r.name:<13} {r.mode:<8} {side:<11} {p50:>9.1f} {p90:>9.1f} {floor:>9.1f} {ratio:>6.1f}x "
                f"{cpu:>9.1f} {cpu_ratio:>8.1f}x {per_req:>8.2f} {r.requests_per_step:>8.1f} {_vs(vs):>7}"
            )
        lines.append(
            f"{'':<13} {r.mode:<8} {'floors':<11} staging copy {r.staging_copy_us:.1f} us, "
            f"staging copy + pool index_copy_ {r.move_floor_us:.1f} us"
            + (
                ""
                if r.engine_faults_p50 is None or r.materialize_faults_p50 is None
                else f" (warm pages); page faults per step: engine {r.engine_faults_p50:.0f}, "
                f"materialize {r.materialize_faults_p50:.0f}"
            )
        )
        lines.append(
            f"{'':<13} {r.mode:<8} {'step total':<11} engine + materialize {r.step_us_p50:.1f} us "
            f"(cpu {r.step_cpu_us_p50:.1f} us; p50 of per-step sums)"
            + ("" if r.step_vs_baseline is None else f", {_vs(r.step_vs_baseline)} the baseline's (raw wall)")
        )
        if r.committer_cpu_engine_us_p50 is not None and r.committer_cpu_materialize_us_p50 is not None:
            lines.append(
                f"{'':<13} {r.mode:<8} {'committer':<11} thread cpu inside engine "
                f"{r.committer_cpu_engine_us_p50:.1f} us, inside materialize "
                f"{r.committer_cpu_materialize_us_p50:.1f} us (p50; shares the GIL with both)"
            )
    lines.append("")
    lines.append("targets:")
    for r in rep.results:
        for v in r.verdicts:
            lines.append(
                f"  {r.name:<13} {r.mode:<8} {v.name:<24} {v.value:>9.2f} (target {v.describe}): {_verdict(v.met)}"
                + (f"; {v.context}" if v.context else "")
            )
    if rep.sweep:
        lines.append("")
        lines.append("decode sweep, eager (engine us per request per step, p50):")
        for r in rep.sweep:
            cpu_per_req = r.engine_cpu_us_p50 / r.requests_per_step
            lines.append(
                f"  {int(round(r.requests_per_step)):>4} requests: {r.engine_us_per_request:7.2f} us/request "
                f"(engine p50 {r.engine_us_p50:.1f} us; cpu {cpu_per_req:.2f} us/request; "
                f"floor ratio {r.engine_ratio:.1f}x)"
            )
        assert rep.sweep_spread is not None
        lines.append(
            f"  spread max/min {rep.sweep_spread:.2f} (target <= {rep.sweep_target:.2f}): {_verdict(rep.sweep_met)}"
            f"; from cpu time {rep.sweep_cpu_spread:.2f}"
        )
        fit = rep.sweep_fit
        if fit is not None:
            allowed = rep.sweep_fixed_allowed_us
            lines.append(
                f"  fit (least squares of engine p50): {fit[0]:.0f} us fixed per step + {fit[1]:.2f} us per request"
                + ("" if allowed is None else f"; the spread target needs fixed <= {allowed:.0f} us at that cost")
            )
    if rep.baseline:
        lines.append("")
        lines.append(
            f"against the baseline {rep.baseline} (engine, materialize: floor-normalised, raw wall and floors in "
            f"brackets; {STEP_SIDE}: raw wall per step against the sum of the baseline's two medians; "
            f"target <= {rep.baseline_slack:.2f}x):"
        )
        for r, side, ratio, ok in rep.baseline_verdicts():
            lines.append(f"  {r.name:<13} {r.mode:<8} {side:<18} {ratio:.2f}x: {_verdict(ok)}{_raw_note(r, side)}")
    lines.append("all targets met" if rep.all_met else "some targets MISSED")
    return "\n".join(lines)


def profile_scenario(name: str, *, eager: bool = True, top: int = 25, iters: int | None = None) -> str:
    """cProfile the timed steps of one scenario; the top functions by own and cumulative time."""
    if name not in SCENARIOS and not name.startswith("decode_"):
        raise ValueError(f"unknown scenario {name!r}; choose from {sorted(SCENARIOS)} or decode_<requests>")
    sc = SCENARIOS[name]() if name in SCENARIOS else decode_scenario(int(name.split("_", 1)[1]))
    prof = cProfile.Profile()
    res = run_scenario(sc, eager=eager, iters=iters, profiler=prof)
    buf = io.StringIO()
    buf.write(
        f"profile of {name} ({res.mode}, {res.steps} timed steps; engine p50 {res.engine_us_p50:.1f} us, "
        f"materialize p50 {res.materialize_us_p50:.1f} us, profiler overhead included)\n"
    )
    stats = pstats.Stats(prof, stream=buf)
    stats.strip_dirs()
    buf.write("\n== by own time (tottime) ==\n")
    stats.sort_stats("tottime").print_stats(top)
    buf.write("\n== by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main_bench(args: argparse.Namespace) -> int:
    """Entry point of ``omni-prefix-cache bench``."""
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.profile:
        print(profile_scenario(args.profile, eager=args.mode != "threaded", top=args.top, iters=args.iters))
        return 0
    from omni_prefix_cache.tools.progress import StepProgress

    line = StepProgress("step", enabled=False if args.json or args.quiet else None)
    try:
        baseline = args.baseline
        if baseline is None and os.path.isfile(BASELINE_PATH):
            baseline = BASELINE_PATH
        rep = run_bench(
            args.scenario,
            modes=MODES if args.mode == "both" else (args.mode,),
            baseline=baseline or None,
            iters=args.iters,
            warmup=args.warmup,
            sweep=not args.no_sweep,
            progress=line.update,
            forward_us=getattr(args, "forward_us", 0.0),
        )
    finally:
        line.close()
    if args.save_baseline:
        with open(args.save_baseline, "w") as f:
            json.dump(rep.to_dict(), f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print(format_report(rep))
    return 1 if args.strict and not rep.all_met else 0
