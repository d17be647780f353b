"""What a bench run measured and what it is held to: the targets and their
verdicts, one row per (scenario, mode), the whole report (``--json``) and
its comparison with a baseline report (``docs/bench_baseline.json``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_prefix_cache.tools.bench.sweep import SWEEP_TARGET, fixed_cost_allowed, linear_fit

BASELINE_PATH = "docs/bench_baseline.json"
# A scenario may not get slower than the baseline by more than this (floor-normalised).
BASELINE_SLACK = 1.05
STEP_SIDE = "engine+materialize"
# The ScenarioResult fields a ``--metrics both`` pair reports on / off of.
COMPARED = ("engine_us_p50", "materialize_us_p50", "step_us_p50", "engine_cpu_us_p50")


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


@dataclass
class TargetVerdict:
    name: str
    describe: str
    value: float
    limit: float
    met: bool
    context: str = ""  # same-run context (Target.context), "" when none


@dataclass(frozen=True)
class UnjudgedTarget:
    """A target a run could not judge, and why (what did not run)."""

    name: str
    describe: str
    why: str


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
    # The memcpy bound of the step's data movement: 2 x the staging copy (the
    # D2H copy into the staging page, then the same bytes into the pool at
    # memcpy speed), what a pool write at memory bandwidth would cost.
    memcpy_bound_us: float = 0.0
    staging_copy_cpu_us: float = 0.0  # the staging copy's thread CPU time (what the engine's CPU compares with)
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
    # The engine thread off its CPU inside new_step_starts + save_outputs (wall - thread CPU,
    # p50 and p90 per step): a save barrier on the committer, a lock, a staging claim, the GIL,
    # or the core lent to another process (a loaded machine shows up here, eager too).
    # With a simulated forward (``--forward-us``) at least the committer's work it should be ~0.
    engine_wait_us_p50: float = 0.0
    engine_wait_us_p90: float = 0.0
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
    # ``--warm-pool``: every pool slab was opened and written once before the
    # first step, so no pool write takes a first-touch fault (False: cold, the default).
    warm_pool: bool = False

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

    def to_dict(self) -> dict[str, Any]:
        """The row's fields and ``met`` (a row of ``bench --json``)."""
        d = asdict(self)
        d["met"] = self.met
        return d


def ratio(on: float, off: float) -> float | None:
    """``on / off``; None when ``off`` is not positive."""
    return on / off if off > 0 else None


class SidePair:
    """One (scenario, mode) measured two ways back to back: ``sides()`` is
    (the reference side, the other), and each ratio is other / reference."""

    order: tuple[str, str]  # which side ran first

    def sides(self) -> tuple[ScenarioResult, ScenarioResult]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.sides()[0].name

    @property
    def mode(self) -> str:
        return self.sides()[0].mode

    def ratio(self, metric: str) -> float | None:
        """other / reference of the ScenarioResult field ``metric`` (e.g. ``engine_us_p50``)."""
        base, other = self.sides()
        return ratio(float(getattr(other, metric)), float(getattr(base, metric)))

    def common_dict(self) -> dict[str, Any]:
        """The keys every pair's ``to_dict`` starts with."""
        return {
            "name": self.name,
            "mode": self.mode,
            "order": list(self.order),
            "ratios": {metric: self.ratio(metric) for metric in COMPARED},
        }


@dataclass
class MetricsPair(SidePair):
    """One (scenario, mode) measured with metrics off and on, back to back."""

    off: ScenarioResult
    on: ScenarioResult
    order: tuple[str, str]  # ("off", "on") or ("on", "off"): which side ran first
    on_metrics: dict[str, Any] = field(default_factory=dict)  # TELEMETRY.summary() right after the on run

    def sides(self) -> tuple[ScenarioResult, ScenarioResult]:
        return self.off, self.on

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.common_dict(),
            "off": self.off.to_dict(),
            "on": self.on.to_dict(),
            "on_metrics": self.on_metrics,
        }


@dataclass(frozen=True)
class ScrapeStats:
    """What a scrape thread did across one run's timed steps: ``scrapes``
    done at ``hz`` over ``window_s`` seconds, and their duration (us)."""

    hz: float
    scrapes: int
    window_s: float
    us_p50: float | None  # None: no scrape was done
    us_max: float | None

    @property
    def scheduled(self) -> int:
        """The slots of the schedule (``start + k / hz``) inside the window: the most it can do."""
        return int(self.window_s * self.hz) + 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "scheduled": self.scheduled}


@dataclass
class ScrapePair(SidePair):
    """One (scenario, mode) measured without and with a thread scraping the
    collector, back to back, metrics on in both (``bench --scrape``)."""

    without: ScenarioResult
    scraped: ScenarioResult
    order: tuple[str, str]  # ("without", "with") or ("with", "without"): which side ran first
    stats: ScrapeStats  # the scraped side's scrape thread

    def sides(self) -> tuple[ScenarioResult, ScenarioResult]:
        return self.without, self.scraped

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.common_dict(),
            "scrape": self.stats.to_dict(),
            "without": self.without.to_dict(),
            "with": self.scraped.to_dict(),
        }


@dataclass
class BenchReport:
    """A whole run: its rows, the sweep's, and how they compare with the targets and the baseline."""

    modes: tuple[str, ...]
    torch_threads: int
    results: list[ScenarioResult]
    sweep: list[ScenarioResult]
    sweep_spread: float | None = None  # max/min engine us per request across the eager sweep (wall p50)
    sweep_cpu_spread: float | None = None  # the same from thread CPU time
    sweep_target: float = SWEEP_TARGET
    baseline: str | None = None  # where the baseline came from
    baseline_slack: float = BASELINE_SLACK
    # Which metrics switch ``results`` ran with: ("off",), ("on",), or ("off", "on") for
    # ``--metrics both``, where ``results`` are the off side and ``metrics_pairs`` both.
    metrics_sides: tuple[str, ...] = ("off",)
    metrics_pairs: list[MetricsPair] = field(default_factory=list)
    # ``--scrape HZ``: every (scenario, mode) without and with scraping (empty: not asked).
    scrape_pairs: list[ScrapePair] = field(default_factory=list)
    # The decode sweep in threaded mode (``sweep`` is the eager one; empty: not run).
    sweep_threaded: list[ScenarioResult] = field(default_factory=list)
    # The targets judged over several rows (``goals``: the sweep fits, one
    # scenario against another), set by ``run_bench``.
    report_verdicts: list[TargetVerdict] = field(default_factory=list)
    # The targets it could not judge and why (``goals.unjudged``, ``goals.unjudged_rows``).
    report_unjudged: list[UnjudgedTarget] = field(default_factory=list)
    # The pool write's row and block paths timed alone (``pool_write.PoolWriteTiming.to_dict``).
    pool_write: list[dict[str, Any]] = field(default_factory=list)
    # The host tier's fill at reuse and restore (``tier_fill.TierFillTiming.to_dict``; None: not run).
    tier_fill: dict[str, Any] | None = None
    warm_pool: bool = False  # ``--warm-pool``: the scenarios ran on pre-written pools
    # The machine's wake cost (``wake_probe.WakeProbe.to_dict``; None: not run).
    wake_probe: dict[str, Any] | None = None
    # vLLM's own decode scheduler step, median us by requests per step, measured in the
    # same run (``vllm_step``; empty: not measured, ``vllm_step_note`` says why): back to
    # back, and with ``vllm_gap_us`` slept between its two calls (the run's --forward-us;
    # empty without one). The targets compare the engine with the step given the same gap.
    vllm_step_us: dict[int, float] = field(default_factory=dict)
    vllm_step_note: str = ""
    vllm_step_gap_us: dict[int, float] = field(default_factory=dict)
    vllm_gap_us: float = 0.0

    @property
    def vllm_step_judged_us(self) -> dict[int, float]:
        """vLLM's step the targets compare with: the one given the engine's gap when measured."""
        return self.vllm_step_gap_us or self.vllm_step_us

    @property
    def mode(self) -> str:
        return "+".join(self.modes)

    @property
    def sweep_met(self) -> bool | None:
        """The eager sweep's spread against ``sweep_target``. Informational:
        the fit targets (``goals``) replaced it, and ``all_met`` leaves it out
        (a fixed cost within the fit targets spreads more than it allows)."""
        return None if self.sweep_spread is None else self.sweep_spread <= self.sweep_target

    @property
    def sweep_fit(self) -> tuple[float, float] | None:
        """``(fixed us per step, us per request)``: least squares of the
        sweep's engine p50 against its requests per step (None with fewer
        than two batch sizes). Splits what the spread target is about: the
        fixed part is what small batches cannot amortize."""
        return linear_fit([(r.requests_per_step, r.engine_us_p50) for r in self.sweep])

    @property
    def sweep_fit_threaded(self) -> tuple[float, float] | None:
        """``sweep_fit`` of the threaded sweep (the engine thread's wall p50)."""
        return linear_fit([(r.requests_per_step, r.engine_us_p50) for r in self.sweep_threaded])

    @property
    def sweep_cpu_fits(self) -> dict[str, list[float] | None]:
        """Per sweep mode, the fit of the engine thread's CPU p50 instead of its wall time."""
        return {
            mode: None if fit is None else list(fit)
            for mode, rows in (("eager", self.sweep), ("threaded", self.sweep_threaded))
            for fit in [linear_fit([(r.requests_per_step, r.engine_cpu_us_p50) for r in rows])]
        }

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
        verdicts = [r.met for r in self.results] + [v.met for v in self.report_verdicts]
        verdicts += [ok for *_, ok in self.baseline_verdicts()]
        return all(v is not False for v in verdicts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "modes": list(self.modes),
            "torch_threads": self.torch_threads,
            "results": [r.to_dict() for r in self.results],
            "sweep": [r.to_dict() for r in self.sweep],
            "sweep_spread": self.sweep_spread,
            "sweep_cpu_spread": self.sweep_cpu_spread,
            "sweep_target": self.sweep_target,
            "sweep_met": self.sweep_met,
            "sweep_fit": None if self.sweep_fit is None else list(self.sweep_fit),
            "sweep_fixed_allowed_us": self.sweep_fixed_allowed_us,
            "baseline": self.baseline,
            "all_met": self.all_met,
            "metrics_sides": list(self.metrics_sides),
            "metrics_side_by_side": [p.to_dict() for p in self.metrics_pairs],
            "scrape_side_by_side": [p.to_dict() for p in self.scrape_pairs],
            "sweep_threaded": [r.to_dict() for r in self.sweep_threaded],
            "sweep_fit_threaded": None if self.sweep_fit_threaded is None else list(self.sweep_fit_threaded),
            "sweep_cpu_fits": self.sweep_cpu_fits,
            "report_targets": [asdict(v) for v in self.report_verdicts],
            "unjudged_targets": [asdict(u) for u in self.report_unjudged],
            "pool_write": self.pool_write,
            "tier_fill": self.tier_fill,
            "warm_pool": self.warm_pool,
            "wake_probe": self.wake_probe,
            "vllm_step_us": self.vllm_step_us,
            "vllm_step_note": self.vllm_step_note,
            "vllm_step_gap_us": self.vllm_step_gap_us,
            "vllm_gap_us": self.vllm_gap_us,
        }


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


def apply_baseline(results: list[ScenarioResult], base: dict[tuple[str, str], dict[str, float]]) -> None:
    """Set every row's ratios to the same (scenario, mode) row of ``base``
    (``load_baseline``); a row the baseline lacks keeps None."""
    for r in results:
        row = base.get((r.name, r.mode))
        if row is not None:
            r.engine_vs_baseline = r.engine_ratio / row["engine"] if row["engine"] > 0 else None
            r.materialize_vs_baseline = r.materialize_ratio / row["materialize"] if row["materialize"] > 0 else None
            r.engine_wall_vs_baseline = _over(r.engine_us_p50, row["engine_us"])
            r.materialize_wall_vs_baseline = _over(r.materialize_us_p50, row["materialize_us"])
            r.step_vs_baseline = _over(r.step_us_p50, row["engine_us"] + row["materialize_us"])
            r.baseline_materialize_floor_us = row["materialize_floor_us"]
