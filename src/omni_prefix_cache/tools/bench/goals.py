"""The targets judged across a report's rows (issue 27): the decode sweep's
fixed and per-request costs in each mode, and one scenario's engine cost
per request against another's. The targets of a single row are the
scenarios' own (``scenarios.DECODE_TARGETS``, ``PREFILL_TARGETS``).

The engine time per decode step against vLLM's own scheduler step at the
same batch size (issue 40, ``VLLM_STEP_LIMITS``) is judged when the run
measured that step (``vllm_step``: a vLLM venv was there).

Metrics on against off (issue 40, ``METRICS_LIMIT``) is judged on the
``decode`` eager pair of ``--metrics both`` (the CLI's default).

A target whose rows did not run (``--scenario``, ``--no-sweep``, one
``--mode``, no vLLM venv, no metrics pair) is not judged; ``unjudged``
says why, and the report prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_prefix_cache.tools.bench.results import (
    BenchReport,
    MetricsPair,
    ScenarioResult,
    Target,
    TargetVerdict,
    UnjudgedTarget,
)


@dataclass(frozen=True)
class ReportTarget:
    """``metric(report) <= limit``; ``metric`` is None when its rows did not run."""

    name: str
    describe: str
    metric: Callable[[BenchReport], float | None]
    limit: float
    context: Callable[[BenchReport], str] | None = None
    # Why ``metric`` is None (what did not run), printed instead of a verdict.
    missing: Callable[[BenchReport], str] | None = None


def row(rep: BenchReport, name: str, mode: str) -> ScenarioResult | None:
    """The report's row of scenario ``name`` in ``mode`` (None: not run)."""
    return next((r for r in rep.results if r.name == name and r.mode == mode), None)


def _fit(rep: BenchReport, mode: str) -> tuple[float, float] | None:
    return rep.sweep_fit if mode == "eager" else rep.sweep_fit_threaded


def _fixed(mode: str) -> Callable[[BenchReport], float | None]:
    def metric(rep: BenchReport) -> float | None:
        fit = _fit(rep, mode)
        return None if fit is None else fit[0]

    return metric


def _per_request(mode: str) -> Callable[[BenchReport], float | None]:
    def metric(rep: BenchReport) -> float | None:
        fit = _fit(rep, mode)
        return None if fit is None else fit[1]

    return metric


def _fit_context(mode: str) -> Callable[[BenchReport], str]:
    def context(rep: BenchReport) -> str:
        fit = _fit(rep, mode)
        cpu = rep.sweep_cpu_fits.get(mode)
        if fit is None:
            return ""
        text = f"fit {fit[0]:.0f} us + {fit[1]:.2f} us/request"
        return text + ("" if cpu is None else f" (engine thread cpu: {cpu[0]:.0f} us + {cpu[1]:.2f} us/request)")

    return context


def _per_request_over(name: str, other: str, mode: str) -> Callable[[BenchReport], float | None]:
    """``name``'s engine us per request over ``other``'s, in ``mode``."""

    def metric(rep: BenchReport) -> float | None:
        a, b = row(rep, name, mode), row(rep, other, mode)
        if a is None or b is None or b.engine_us_per_request <= 0:
            return None
        return a.engine_us_per_request / b.engine_us_per_request

    return metric


def _per_request_context(name: str, other: str, mode: str) -> Callable[[BenchReport], str]:
    def context(rep: BenchReport) -> str:
        a, b = row(rep, name, mode), row(rep, other, mode)
        if a is None or b is None:
            return ""
        return f"{name} {a.engine_us_per_request:.2f} us/request, {other} {b.engine_us_per_request:.2f}"

    return context


def _over_vllm_step(mode: str, requests: int) -> Callable[[BenchReport], float | None]:
    """The ``mode`` sweep's engine p50 per step at ``requests`` over vLLM's
    scheduler step at the same size, measured in the same run with the same
    gap between its calls as the engine's (``vllm_step_judged_us``)."""

    def metric(rep: BenchReport) -> float | None:
        rows = rep.sweep if mode == "eager" else rep.sweep_threaded
        ours = next((r for r in rows if r.requests_per_step == requests), None)
        theirs = rep.vllm_step_judged_us.get(requests)
        return None if ours is None or not theirs else ours.engine_us_p50 / theirs

    return metric


def _vllm_step_context(mode: str, requests: int) -> Callable[[BenchReport], str]:
    def context(rep: BenchReport) -> str:
        rows = rep.sweep if mode == "eager" else rep.sweep_threaded
        ours = next((r for r in rows if r.requests_per_step == requests), None)
        theirs = rep.vllm_step_judged_us.get(requests)
        if ours is None or not theirs:
            return ""
        gap = f" with a {rep.vllm_gap_us:g} us gap" if rep.vllm_step_gap_us else " back to back"
        return f"engine {ours.engine_us_p50:.0f} us, vLLM scheduler step{gap} {theirs:.0f} us"

    return context


def _no_sweep(mode: str) -> Callable[[BenchReport], str]:
    return lambda rep: f"the {mode} decode sweep did not run (--no-sweep, --mode)"


def _no_rows(*names: str, mode: str) -> Callable[[BenchReport], str]:
    def missing(rep: BenchReport) -> str:
        absent = [n for n in names if row(rep, n, mode) is None]
        return f"{', '.join(absent) or ', '.join(names)} {mode} did not run (--scenario, --mode)"

    return missing


def _no_vllm_step(mode: str) -> Callable[[BenchReport], str]:
    def missing(rep: BenchReport) -> str:
        if not (rep.sweep if mode == "eager" else rep.sweep_threaded):
            return _no_sweep(mode)(rep)
        return rep.vllm_step_note or "vLLM's scheduler step not measured"

    return missing


def _pair(rep: BenchReport, name: str, mode: str) -> MetricsPair | None:
    return next((p for p in rep.metrics_pairs if p.name == name and p.mode == mode), None)


def _metrics_on_over_off(name: str, mode: str) -> Callable[[BenchReport], float | None]:
    """The engine p50 with metrics on over off, of ``--metrics both``'s (``name``, ``mode``) pair."""

    def metric(rep: BenchReport) -> float | None:
        pair = _pair(rep, name, mode)
        return None if pair is None else pair.ratio("engine_us_p50")

    return metric


def _metrics_context(name: str, mode: str) -> Callable[[BenchReport], str]:
    def context(rep: BenchReport) -> str:
        pair = _pair(rep, name, mode)
        if pair is None:
            return ""
        step, cpu = pair.ratio("step_us_p50"), pair.ratio("engine_cpu_us_p50")
        return (
            f"engine off {pair.off.engine_us_p50:.0f} us, on {pair.on.engine_us_p50:.0f} us"
            + ("" if step is None else f"; step on/off {step:.2f}x")
            + ("" if cpu is None else f", engine cpu on/off {cpu:.2f}x")
        )

    return context


def _no_metrics_pair(name: str, mode: str) -> Callable[[BenchReport], str]:
    def missing(rep: BenchReport) -> str:
        if rep.metrics_sides != ("off", "on"):
            return f"needs --metrics both (this run: --metrics {'+'.join(rep.metrics_sides)})"
        return f"{name} {mode} did not run (--scenario, --mode)"

    return missing


# Issue 40: metrics on may cost the decode step this much over off.
METRICS_LIMIT = 1.15

# Issue 40: the engine thread's cost per decode step against vLLM's own scheduler step.
VLLM_STEP_LIMITS = {("threaded", 16): 1.0, ("threaded", 64): 0.5, ("threaded", 256): 0.5}
VLLM_STEP_LIMITS |= {("eager", 16): 1.5, ("eager", 64): 0.75, ("eager", 256): 0.75}

REPORT_TARGETS = (
    ReportTarget(
        "sweep eager fixed us", "<= 120 us per step", _fixed("eager"), 120.0, _fit_context("eager"), _no_sweep("eager")
    ),
    ReportTarget("sweep eager us/request", "<= 2.5 us", _per_request("eager"), 2.5, None, _no_sweep("eager")),
    ReportTarget(
        "sweep threaded fixed us",
        "<= 100 us per step",
        _fixed("threaded"),
        100.0,
        _fit_context("threaded"),
        _no_sweep("threaded"),
    ),
    ReportTarget("sweep threaded us/request", "<= 1.5 us", _per_request("threaded"), 1.5, None, _no_sweep("threaded")),
    *(
        ReportTarget(
            f"decode_256 / decode {mode}",
            "<= 1x (engine us/request)",
            _per_request_over("decode_256", "decode", mode),
            1.0,
            _per_request_context("decode_256", "decode", mode),
            _no_rows("decode_256", "decode", mode=mode),
        )
        for mode in ("eager", "threaded")
    ),
    ReportTarget(
        "deferred / decode eager",
        "<= 2x (engine us/request)",
        _per_request_over("deferred", "decode", "eager"),
        2.0,
        _per_request_context("deferred", "decode", "eager"),
        _no_rows("deferred", "decode", mode="eager"),
    ),
    *(
        ReportTarget(
            f"{mode} x{n} / vLLM sched step",
            f"<= {limit:g}x (engine us/step)",
            _over_vllm_step(mode, n),
            limit,
            _vllm_step_context(mode, n),
            _no_vllm_step(mode),
        )
        for (mode, n), limit in VLLM_STEP_LIMITS.items()
    ),
    ReportTarget(
        "metrics on / off decode eager",
        f"<= {METRICS_LIMIT:g}x (engine p50)",
        _metrics_on_over_off("decode", "eager"),
        METRICS_LIMIT,
        _metrics_context("decode", "eager"),
        _no_metrics_pair("decode", "eager"),
    ),
)


def judge_report(rep: BenchReport, targets: tuple[ReportTarget, ...] = REPORT_TARGETS) -> list[TargetVerdict]:
    """The verdicts of ``targets`` whose rows ``rep`` has, in order."""
    out = []
    for t in targets:
        value = t.metric(rep)
        if value is not None:
            context = t.context(rep) if t.context is not None else ""
            out.append(TargetVerdict(t.name, t.describe, value, t.limit, value <= t.limit, context))
    return out


def unjudged(rep: BenchReport, targets: tuple[ReportTarget, ...] = REPORT_TARGETS) -> list[UnjudgedTarget]:
    """The targets of ``targets`` that ``rep`` could not judge, each with why."""
    return [
        UnjudgedTarget(t.name, t.describe, t.missing(rep) if t.missing is not None else "its rows did not run")
        for t in targets
        if t.metric(rep) is None
    ]


def unjudged_rows(rep: BenchReport, targets: dict[str, tuple[Target, ...]]) -> list[UnjudgedTarget]:
    """The per-row targets (``targets``: scenario name -> its targets) whose
    (scenario, mode) row ``rep`` lacks, each with why."""
    ran = {(r.name, r.mode) for r in rep.results}
    return [
        UnjudgedTarget(f"{name} {mode} {t.name}", t.describe, f"{name} {mode} did not run (--scenario, --mode)")
        for name, ts in targets.items()
        for t in ts
        for mode in t.modes
        if (name, mode) not in ran
    ]
