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
- ``sweep``: ``decode`` at 16, 64 and 256 requests (engine us per request).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.simulate.batch import PersistentBatch, SimGroupView
from omni_prefix_cache.simulate.scheduler import Scheduler, SchedulerOutput
from omni_prefix_cache.simulate.workload import FollowupSpec, RequestSpec

MM_KEY = "talker.h"
DEFERRED_KEY = "codes.audio"


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
    engine_target: float | None = None
    materialize_target: float | None = None


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


def decode_scenario(num_reqs: int = 64, *, warmup: int = 20, iters: int = 200) -> Scenario:
    steps = warmup + iters + 2
    prompt = 16
    blocks = num_reqs * (-(-(prompt + steps + 8) // 16) + 1)
    return Scenario(
        name="decode" if num_reqs == 64 else f"decode_{num_reqs}",
        trace=_decode_trace(num_reqs, prompt, steps),
        token_budget=max(2048, num_reqs * prompt),
        max_num_seqs=num_reqs,
        num_blocks=blocks,
        warmup=warmup,
        iters=iters,
        engine_target=120.0 if num_reqs == 64 else None,
        materialize_target=60.0 if num_reqs == 64 else None,
    )


def prefill_hits_scenario(*, warmup: int = 5, iters: int = 40) -> Scenario:
    return Scenario(
        name="prefill_hits",
        trace=_prefill_hits_trace(warmup + iters + 8),
        num_blocks=1024,
        warmup=warmup,
        iters=iters,
        engine_target=8.0,
        materialize_target=2.5,
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
    "prefill_hits": prefill_hits_scenario,
    "deferred": deferred_scenario,
}
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
class ScenarioResult:
    """Medians/p90s of one scenario, floors and verdicts."""

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
    engine_target: float | None = None
    materialize_target: float | None = None
    hit_rows_per_step: float = 0.0
    # Thread CPU time of the calling thread (time another process or thread ran is not counted).
    engine_cpu_us_p50: float = 0.0
    materialize_cpu_us_p50: float = 0.0
    engine_cpu_ratio: float = 0.0
    materialize_cpu_ratio: float = 0.0

    @property
    def engine_met(self) -> bool | None:
        return None if self.engine_target is None else self.engine_ratio <= self.engine_target

    @property
    def materialize_met(self) -> bool | None:
        return None if self.materialize_target is None else self.materialize_ratio <= self.materialize_target


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
) -> ScenarioResult:
    """Replay ``sc`` against a fresh manager; time the facade calls and the memcpy floors.
    ``on_step`` is called after every step (warmup included), outside the timed spans."""
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
    if manager_factory is None:
        from omni_prefix_cache.manager import OmniPrefixCacheManager

        mgr = OmniPrefixCacheManager(cfg, view, eager=eager)
    else:
        mgr = manager_factory(cfg, view, eager)
    keys = frozenset({DEFERRED_KEY}) if sc.deferred else frozenset()
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=keys))
    gen = torch.Generator().manual_seed(seed)
    # Static forward buffers, as with CUDA graphs: each step's outputs are views of them.
    hidden_buf = torch.randn((max_n, sc.hidden), generator=gen).to(sc.dtype)
    mm_buf = torch.randn((max_n, sc.mm_width), generator=gen).to(sc.dtype)
    widths = {HIDDEN_KEY: sc.hidden, MM_KEY: sc.mm_width}
    if sc.deferred:
        widths[DEFERRED_KEY] = 16
        def_buf = torch.randn((max_n, 16), generator=gen).to(sc.dtype)
    floor_src = {k: torch.randn((max(4 * max_n, 8192), w), generator=gen).to(sc.dtype) for k, w in widths.items()}
    eng: list[float] = []
    mat: list[float] = []
    eng_floor: list[float] = []
    mat_floor: list[float] = []
    eng_cpu: list[float] = []
    mat_cpu: list[float] = []
    eng_floor_cpu: list[float] = []
    mat_floor_cpu: list[float] = []
    reqs = tokens = hit_rows = 0
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i, st in enumerate(steps):
            view.set_step(st.order, st.blocks, st.computed)
            n = st.n
            mm = {MM_KEY: mm_buf[:n]}
            if sc.deferred:
                mm[DEFERRED_KEY] = def_buf[:n]
            timed = i >= warmup
            if timed and profiler is not None:
                profiler.enable()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            mgr.new_step_starts(st.output)
            sid = mgr.save_outputs(hidden_buf[:n], mm, num_tokens_unpadded=n, num_tokens_padded=n)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            outs = mgr.materialize(sid, st.order)
            t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
            if timed and profiler is not None:
                profiler.disable()
            if on_step is not None:
                on_step()
            if not timed:
                continue
            eng.append((t1 - t0) / 1000.0)
            mat.append((t2 - t1) / 1000.0)
            eng_cpu.append((c1 - c0) / 1000.0)
            mat_cpu.append((c2 - c1) / 1000.0)
            wall, cpu = _floor_us([hidden_buf[:n], *mm.values()])
            eng_floor.append(wall)
            eng_floor_cpu.append(cpu)
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
    ef, mf = _pct(eng_floor, 50), _pct(mat_floor, 50)
    ec, mc = _pct(eng_cpu, 50), _pct(mat_cpu, 50)
    efc, mfc = _pct(eng_floor_cpu, 50), _pct(mat_floor_cpu, 50)
    total_s = (sum(eng) + sum(mat)) / 1e6
    return ScenarioResult(
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
        engine_us_per_request=e50 / (reqs / len(eng)),
        engine_target=sc.engine_target,
        materialize_target=sc.materialize_target,
        hit_rows_per_step=hit_rows / len(eng),
        engine_cpu_us_p50=ec,
        materialize_cpu_us_p50=mc,
        engine_cpu_ratio=ec / efc if efc > 0 else float("inf"),
        materialize_cpu_ratio=mc / mfc if mfc > 0 else float("inf"),
    )


@dataclass
class BenchReport:
    mode: str
    torch_threads: int
    results: list[ScenarioResult]
    sweep: list[ScenarioResult]
    sweep_spread: float | None = None  # max/min engine us per request across the sweep (wall p50)
    sweep_cpu_spread: float | None = None  # the same from thread CPU time
    sweep_target: float = SWEEP_TARGET

    @property
    def sweep_met(self) -> bool | None:
        return None if self.sweep_spread is None else self.sweep_spread <= self.sweep_target

    @property
    def all_met(self) -> bool:
        verdicts = [r.engine_met for r in self.results] + [r.materialize_met for r in self.results]
        verdicts.append(self.sweep_met)
        return all(v is not False for v in verdicts)

    def to_dict(self) -> dict[str, Any]:
        def one(r: ScenarioResult) -> dict[str, Any]:
            d = asdict(r)
            d["engine_met"] = r.engine_met
            d["materialize_met"] = r.materialize_met
            return d

        return {
            "mode": self.mode,
            "torch_threads": self.torch_threads,
            "results": [one(r) for r in self.results],
            "sweep": [one(r) for r in self.sweep],
            "sweep_spread": self.sweep_spread,
            "sweep_cpu_spread": self.sweep_cpu_spread,
            "sweep_target": self.sweep_target,
            "sweep_met": self.sweep_met,
            "all_met": self.all_met,
        }


def run_bench(
    names: list[str] | None = None,
    *,
    eager: bool = True,
    iters: int | None = None,
    warmup: int | None = None,
    sweep: bool = True,
    manager_factory: Callable[[PrefixCacheConfig, Any, bool], Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """Run the named scenarios (default all) and the decode sweep.
    ``progress(done, total)`` is called after every step of every run."""
    names = list(SCENARIOS) if not names else names
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    plan = [SCENARIOS[n]() for n in names]
    sweep_plan = [decode_scenario(r, iters=100) for r in SWEEP_SIZES] if sweep else []
    total = sum(
        (sc.warmup if warmup is None else warmup) + (sc.iters if iters is None else iters)
        for sc in [*plan, *sweep_plan]
    )
    done = 0

    def step_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    kw: dict[str, Any] = {
        "eager": eager,
        "iters": iters,
        "warmup": warmup,
        "manager_factory": manager_factory,
        "on_step": step_done if progress is not None else None,
    }
    results = [run_scenario(sc, **kw) for sc in plan]
    sweep_results: list[ScenarioResult] = []
    spread = cpu_spread = None
    if sweep:
        sweep_results = [run_scenario(sc, **kw) for sc in sweep_plan]
        per_req = [r.engine_us_per_request for r in sweep_results]
        spread = max(per_req) / min(per_req)
        per_req_cpu = [r.engine_cpu_us_p50 / r.requests_per_step for r in sweep_results]
        cpu_spread = max(per_req_cpu) / min(per_req_cpu)
    return BenchReport(
        mode="eager" if eager else "threaded",
        torch_threads=torch.get_num_threads(),
        results=results,
        sweep=sweep_results,
        sweep_spread=spread,
        sweep_cpu_spread=cpu_spread,
    )


# ---------------------------------------------------------------- output


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def format_report(rep: BenchReport) -> str:
    """The bench table: one row per (scenario, side), then the sweep.

    ``ratio`` (wall p50 / floor p50) carries the verdict; ``cpu ratio`` is the
    same with the calling thread's CPU time, which a busy machine disturbs less.
    """
    head = (
        f"{'scenario':<13} {'side':<11} {'p50 us':>9} {'p90 us':>9} {'floor us':>9} {'ratio':>7} "
        f"{'target':>7} {'verdict':>7} {'cpu us':>9} {'cpu ratio':>9} {'tok/s':>9} {'req/step':>8}"
    )
    lines = [f"mode: {rep.mode} (torch threads: {rep.torch_threads})", head, "-" * len(head)]
    for r in rep.results:
        sides = (
            ("engine", r.engine_us_p50, r.engine_us_p90, r.engine_floor_us, r.engine_ratio, r.engine_target,
             r.engine_met, r.engine_cpu_us_p50, r.engine_cpu_ratio),
            ("materialize", r.materialize_us_p50, r.materialize_us_p90, r.materialize_floor_us, r.materialize_ratio,
             r.materialize_target, r.materialize_met, r.materialize_cpu_us_p50, r.materialize_cpu_ratio),
        )  # fmt: skip
        for side, p50, p90, floor, ratio, target, met, cpu, cpu_ratio in sides:
            tgt = "-" if target is None else f"<={target:g}x"
            lines.append(
                f"{r.name:<13} {side:<11} {p50:>9.1f} {p90:>9.1f} {floor:>9.1f} {ratio:>6.1f}x {tgt:>7} "
                f"{_verdict(met):>7} {cpu:>9.1f} {cpu_ratio:>8.1f}x {r.tokens_per_s:>9.0f} {r.requests_per_step:>8.1f}"
            )
    if rep.sweep:
        lines.append("")
        lines.append("decode sweep (engine us per request per step, p50):")
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
        print(profile_scenario(args.profile, eager=args.eager, top=args.top, iters=args.iters))
        return 0
    from omni_prefix_cache.progress import StepProgress

    line = StepProgress("step", enabled=False if args.json or args.quiet else None)
    try:
        rep = run_bench(
            args.scenario,
            eager=args.eager,
            iters=args.iters,
            warmup=args.warmup,
            sweep=not args.no_sweep,
            progress=line.update,
        )
    finally:
        line.close()
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print(format_report(rep))
    return 1 if args.strict and not rep.all_met else 0
