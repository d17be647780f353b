"""A whole bench run: the scenarios in each mode side by side, the decode
sweep, the baseline comparison, and the ``omni-prefix-cache bench`` entry."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.tools.bench.event_api import format_event_api, run_event_api, spec_verdicts
from omni_prefix_cache.tools.bench.goals import judge_report, unjudged, unjudged_rows
from omni_prefix_cache.tools.bench.measure import ManagerFactory, TimedHook, run_scenario
from omni_prefix_cache.tools.bench.pool_write import time_pool_writes
from omni_prefix_cache.tools.bench.profiling import profile_scenario
from omni_prefix_cache.tools.bench.report import format_report
from omni_prefix_cache.tools.bench.results import (
    BASELINE_PATH,
    BenchReport,
    MetricsPair,
    ScenarioResult,
    ScrapePair,
    apply_baseline,
    load_baseline,
)
from omni_prefix_cache.tools.bench.scenarios import MODES, SCENARIOS, SPEC_SCENARIOS, Scenario, decode_scenario
from omni_prefix_cache.tools.bench.sides import METRICS_CHOICES, run_pair, run_scrape_pair, with_metrics
from omni_prefix_cache.tools.bench.sweep import SWEEP_SIZES, spread
from omni_prefix_cache.tools.bench.tier_fill import time_tier_fill
from omni_prefix_cache.tools.bench.vllm_step import DEFAULT_VENV_PYTHON, scheduler_step_us
from omni_prefix_cache.tools.bench.wake_probe import probe_wake


def _check_choices(names: list[str], modes: tuple[str, ...], metrics: str, scrape_hz: float) -> None:
    """ValueError naming what is unknown among ``names``, ``modes`` and
    ``metrics``, or a ``scrape_hz`` that is not a finite number >= 0."""
    if not 0 <= scrape_hz < math.inf:
        raise ValueError(f"scrape rate must be a finite number of Hz >= 0, got {scrape_hz}")
    if scrape_hz > 0 and importlib.util.find_spec("prometheus_client") is None:
        raise ValueError("scraping needs prometheus_client: pip install 'omni-prefix-cache[metrics]'")
    if metrics not in METRICS_CHOICES:
        raise ValueError(f"unknown metrics {metrics!r}; choose from {list(METRICS_CHOICES)}")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {list(MODES)}")


def _step_counter(total: int, progress: Callable[[int, int], None] | None) -> Callable[[], None] | None:
    """An ``on_step`` that reports ``(done, total)`` to ``progress`` (None without one)."""
    if progress is None:
        return None
    done = 0

    def step_done() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    return step_done


def _one_run(
    sc: Scenario, mode: str, kw: dict[str, Any]
) -> Callable[[ManagerFactory | None, TimedHook | None], ScenarioResult]:
    """``sc`` in ``mode`` as one side of a ``--metrics both`` or ``--scrape``
    pair: run with the factory and the timed-steps hook it is handed."""

    def run(factory: ManagerFactory | None, hook: TimedHook | None) -> ScenarioResult:
        return run_scenario(sc, eager=mode == "eager", manager_factory=factory, during_timed=hook, **kw)

    return run


def median_run(runs: list[ScenarioResult]) -> ScenarioResult:
    """Of ``runs`` of one (scenario, mode), the run of the median engine p50
    (the lower middle one when there are an even number), whole: its other
    fields are that run's, so a row stays one run's measurement."""
    return sorted(runs, key=lambda r: r.engine_us_p50)[(len(runs) - 1) // 2]


def median_pair(pairs: list[MetricsPair]) -> MetricsPair:
    """Of ``pairs`` of one (scenario, mode), the pair of the median engine
    on/off ratio (the lower middle one when there are an even number)."""
    return sorted(pairs, key=lambda p: p.ratio("engine_us_p50") or 0.0)[(len(pairs) - 1) // 2]


def run_bench(
    names: list[str] | None = None,
    *,
    eager: bool | None = None,
    modes: tuple[str, ...] | None = None,
    iters: int | None = None,
    warmup: int | None = None,
    sweep: bool = True,
    baseline: str | None = None,
    manager_factory: ManagerFactory | None = None,
    progress: Callable[[int, int], None] | None = None,
    forward_us: float = 0.0,
    metrics: str = "off",
    scrape_hz: float = 0.0,
    warm: bool = False,
    pool_write: bool = False,
    wake_probe: bool = False,
    vllm_python: str | None = None,
    repeat: int = 1,
) -> BenchReport:
    """Run the named scenarios (default all but ``SPEC_SCENARIOS``, which
    only the event-API table runs) in each of ``modes`` (default
    both; ``eager`` picks one, for old callers), then the decode sweep
    in each of ``modes``. ``baseline``: a bench ``--json`` report to compare with.
    ``warm``: every run's pool slabs are written once before its first step
    (``measure.warm_pool``). ``pool_write``: also time the pool write's
    paths alone (``pool_write.time_pool_writes``, a fraction of a second)
    and the host tier's fill and restore (``tier_fill.time_tier_fill``, ~2 s).
    ``wake_probe``: also measure what waking an idle thread once a step
    costs the engine thread here (``wake_probe.probe_wake``, a few seconds).
    ``vllm_python``: a vLLM venv's interpreter; with the sweep, vLLM's own
    decode scheduler step is measured there at the sweep's sizes, right
    after the sweep (``vllm_step``, ~15 s), and judged against (``goals``).
    ``repeat``: every scenario row, metrics pair and sweep row is run that
    many times and the median run kept (``median_run``, ``median_pair``);
    the scrape pairs run once.
    ``progress(done, total)`` is called after every step of every run.
    ``forward_us``: a simulated forward pass per step (see ``run_scenario``).
    ``metrics``: ``off`` (managers as ``manager_factory`` builds them; the
    process's metrics switch is left alone), ``on`` (built with
    ``PrefixCacheConfig.metrics``), or ``both``: every (scenario, mode) off
    and on back to back (``sides``), the report's ``results`` being the off
    side and ``metrics_pairs`` both; the sweep runs off; the switch is
    restored after. Raises ValueError on an unknown scenario, mode or
    ``scrape_hz`` > 0: after those runs, every (scenario, mode) again
    without and with a thread scraping the collector ``scrape_hz`` times a
    second across its timed steps (``sides.run_scrape_pair``; both sides with
    metrics on, whatever ``metrics`` says), in ``scrape_pairs``; the switch
    is restored after. Raises ValueError on an unknown scenario, mode or
    metrics choice, a negative or non-finite ``scrape_hz`` (or a positive
    one without ``prometheus_client``), or a baseline that is not a bench
    report."""
    names = [n for n in SCENARIOS if n not in SPEC_SCENARIOS] if not names else names
    if modes is None:
        modes = MODES if eager is None else ("eager" if eager else "threaded",)
    _check_choices(names, modes, metrics, scrape_hz)
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    base = load_baseline(baseline) if baseline else None
    # Speculative scenarios run in the event-API table only (``run_event_api``).
    plan = [SCENARIOS[n]() for n in names if n not in SPEC_SCENARIOS]
    sweep_plan = [decode_scenario(r, iters=100) for r in SWEEP_SIZES] if sweep else []
    sweep_modes = [mode for mode in MODES if mode in modes]
    sides = (2 if metrics == "both" else 1) * repeat + (2 if scrape_hz > 0 else 0)

    def steps_of(sc: Scenario) -> int:
        return (sc.warmup if warmup is None else warmup) + (sc.iters if iters is None else iters)

    runs_planned = [p for p in plan for _ in modes for _ in range(sides)]
    sweep_runs = [sc for sc in sweep_plan for _ in sweep_modes for _ in range(repeat)]
    total = sum(steps_of(sc) for sc in [*runs_planned, *sweep_runs])
    kw: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "on_step": _step_counter(total, progress),
        "forward_us": forward_us,
        "warm": warm,
    }
    factory = with_metrics(manager_factory) if metrics == "on" else manager_factory
    was_recording = TELEMETRY.enabled
    pairs: list[MetricsPair] = []
    scrape_pairs: list[ScrapePair] = []
    runs = [(sc, mode) for sc in plan for mode in modes]

    def median_of(sc: Scenario, mode: str) -> ScenarioResult:
        eager = mode == "eager"
        return median_run([run_scenario(sc, eager=eager, manager_factory=factory, **kw) for _ in range(repeat)])

    try:
        # Modes side by side per scenario, so their ratios share the machine's state.
        if metrics == "both":
            pairs = [
                median_pair([run_pair(_one_run(sc, mode, kw), i * repeat + k, manager_factory) for k in range(repeat)])
                for i, (sc, mode) in enumerate(runs)
            ]
            results = [p.off for p in pairs]
        else:
            results = [median_of(sc, mode) for sc, mode in runs]
        if base is not None:
            apply_baseline(results, base)
        if scrape_hz > 0:
            scrape_pairs = [
                run_scrape_pair(_one_run(sc, mode, kw), i, manager_factory, scrape_hz)
                for i, (sc, mode) in enumerate(runs)
            ]
        sweeps: dict[str, list[ScenarioResult]] = {
            mode: [median_of(sc, mode) for sc in sweep_plan] for mode in sweep_modes
        }
        sweep_results = sweeps.get("eager", [])
        sweep_spread = cpu_spread = None
        if sweep_results:
            sweep_spread = spread([r.engine_us_per_request for r in sweep_results])
            cpu_spread = spread([r.engine_cpu_us_p50 / r.requests_per_step for r in sweep_results])
        vllm_step = scheduler_step_us(vllm_python if sweep else None, SWEEP_SIZES, gap_us=forward_us)
    finally:
        if metrics == "both" or scrape_hz > 0:
            TELEMETRY.disable()  # fresh series when it was on: the pairs' runs replaced them
            if was_recording:
                TELEMETRY.enable()
    rep = BenchReport(
        modes=tuple(modes),
        torch_threads=torch.get_num_threads(),
        results=results,
        sweep=sweep_results,
        sweep_spread=sweep_spread,
        sweep_cpu_spread=cpu_spread,
        baseline=baseline,
        metrics_sides=("off", "on") if metrics == "both" else (metrics,),
        metrics_pairs=pairs,
        scrape_pairs=scrape_pairs,
        sweep_threaded=sweeps.get("threaded", []),
        pool_write=[t.to_dict() for t in time_pool_writes()] if pool_write else [],
        tier_fill=time_tier_fill().to_dict() if pool_write else None,
        warm_pool=warm,
        wake_probe=probe_wake().to_dict() if wake_probe else None,
        vllm_step_us=vllm_step.back_to_back_us,
        vllm_step_gap_us=vllm_step.with_gap_us,
        vllm_gap_us=vllm_step.gap_us,
        vllm_step_note=vllm_step.note,
    )
    rep.report_verdicts = judge_report(rep)
    targets = {name: make().targets for name, make in SCENARIOS.items()}
    rep.report_unjudged = unjudged(rep) + unjudged_rows(rep, targets)
    return rep


def _vllm_python(arg: str | None) -> str | None:
    """``--vllm-python``: as given ('' for none), else the checkout's .venv-vllm when it is there."""
    if arg is not None:
        return arg or None
    return DEFAULT_VENV_PYTHON if os.path.exists(DEFAULT_VENV_PYTHON) else None


def main_bench(args: argparse.Namespace) -> int:
    """Entry point of ``omni-prefix-cache bench`` (its arguments:
    ``tools.commands.bench``); the exit status."""
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.profile:
        print(
            profile_scenario(
                args.profile,
                eager=args.mode != "threaded",
                top=args.top,
                iters=args.iters,
                clock=getattr(args, "profile_clock", "wall"),
                forward_us=getattr(args, "forward_us", 0.0),
                metrics=getattr(args, "metrics", "off") == "on",
            )
        )
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
            metrics=getattr(args, "metrics", "off"),
            scrape_hz=getattr(args, "scrape", 0.0),
            warm=getattr(args, "warm_pool", False),
            pool_write=True,
            wake_probe=True,
            vllm_python=_vllm_python(getattr(args, "vllm_python", None)),
            repeat=getattr(args, "repeat", 1),
        )
    finally:
        line.close()
    modes = MODES if args.mode == "both" else (args.mode,)
    event_api = [] if getattr(args, "no_event_api", False) else run_event_api(args.scenario, modes, iters=args.iters)
    if args.save_baseline:
        with open(args.save_baseline, "w") as f:
            json.dump(rep.to_dict(), f, indent=2)
            f.write("\n")
    spec = spec_verdicts(event_api)
    if args.json:
        report = {**rep.to_dict(), "metrics": TELEMETRY.summary(), "event_api": [p.to_dict() for p in event_api]}
        report["event_api_targets"] = [asdict(v) for v in spec]
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(rep))
        if event_api:
            print()
            print(format_event_api(event_api))
    return 1 if args.strict and not (rep.all_met and all(v.met for v in spec)) else 0
