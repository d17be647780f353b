"""The bench tables (``make bench`` without ``--json``): per (scenario, mode,
side) rows, the targets with their verdicts, the sweep and the comparison
with the baseline."""

from __future__ import annotations

from omni_prefix_cache.tools.bench.pool_write import PoolWriteTiming, pool_write_lines
from omni_prefix_cache.tools.bench.results import STEP_SIDE, BenchReport, ScenarioResult
from omni_prefix_cache.tools.bench.sides import scrape_lines, side_by_side_lines
from omni_prefix_cache.tools.bench.tier_fill import TierFillTiming, tier_fill_lines
from omni_prefix_cache.tools.bench.wake_probe import WakeProbe, wake_probe_lines


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


HEAD = (
    f"{'scenario':<13} {'mode':<8} {'side':<11} {'p50 us':>9} {'p90 us':>9} {'floor us':>9} {'ratio':>7} "
    f"{'cpu us':>9} {'cpu ratio':>9} {'us/req':>8} {'req/step':>8} {'vs base':>7}"
)


def format_report(rep: BenchReport) -> str:
    """The bench tables: one row per (scenario, mode, side), the targets with
    their verdicts, the sweep, and the comparison with the baseline.

    ``ratio`` is wall p50 / floor p50; ``cpu ratio`` the same with the calling
    thread's CPU time, which a busy machine disturbs less; ``us/req`` the p50
    per request; ``vs base`` the ratio divided by the baseline report's.
    """
    lines = [f"modes: {', '.join(rep.modes)} (torch threads: {rep.torch_threads})"]
    lines.append(
        "pool: warm (every slab page written once before the first step: no first-touch faults)"
        if rep.warm_pool
        else "pool: cold (slabs mapped lazily: a pool write's first touch of a page faults; --warm-pool for warm)"
    )
    if rep.metrics_pairs:
        lines.append("metrics: off in the tables below; off vs on after them")
    elif rep.metrics_sides != ("off",):
        lines.append(f"metrics: {', '.join(rep.metrics_sides)}")
    forward = {r.forward_us for r in [*rep.results, *rep.sweep]}
    if forward != {0.0} and forward:
        lines.append(
            f"forward: {', '.join(f'{f:.0f}' for f in sorted(forward))} us slept by the engine thread between "
            "new_step_starts and save_outputs (not in engine time)"
        )
    lines += [HEAD, "-" * len(HEAD)]
    for r in rep.results:
        lines += _result_lines(r)
    lines += _target_lines(rep)
    if rep.metrics_pairs:
        lines += side_by_side_lines(rep.metrics_pairs)
    if rep.scrape_pairs:
        lines += scrape_lines(rep.scrape_pairs)
    if rep.sweep:
        lines += _sweep_lines(rep, "eager", rep.sweep)
    if rep.sweep_threaded:
        lines += _sweep_lines(rep, "threaded", rep.sweep_threaded)
    if rep.pool_write:
        lines += pool_write_lines([PoolWriteTiming(**t) for t in rep.pool_write])
    if rep.tier_fill is not None:
        lines += ["", *tier_fill_lines(TierFillTiming(**rep.tier_fill))]
    if rep.wake_probe is not None:
        lines += wake_probe_lines(WakeProbe(**rep.wake_probe))
    if rep.vllm_step_us or rep.vllm_step_note:
        lines += ["", f"vLLM's scheduler step (schedule + update_from_output, decode, p50): {rep.vllm_step_note}"]
        lines += vllm_step_lines(rep)
    lines += _baseline_lines(rep) if rep.baseline else ["", NO_BASELINE]
    lines.append("all targets met" if rep.all_met else "some targets MISSED")
    return "\n".join(lines)


def _result_lines(r: ScenarioResult) -> list[str]:
    """One row's engine and materialize sides, its floors, step total and committer CPU."""
    lines = []
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
        f"memcpy bound (2 x staging copy) {r.memcpy_bound_us:.1f} us, "
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
    lines.append(
        f"{'':<13} {r.mode:<8} {'engine wait':<11} off-cpu inside new_step_starts + save_outputs "
        f"p50 {r.engine_wait_us_p50:.1f} us, p90 {r.engine_wait_us_p90:.1f} us (wall - thread cpu per step: "
        "the save barrier, a lock, a staging claim, the GIL, or another process on the core)"
    )
    if r.committer_cpu_engine_us_p50 is not None and r.committer_cpu_materialize_us_p50 is not None:
        lines.append(
            f"{'':<13} {r.mode:<8} {'committer':<11} thread cpu inside engine "
            f"{r.committer_cpu_engine_us_p50:.1f} us, inside materialize "
            f"{r.committer_cpu_materialize_us_p50:.1f} us (p50; shares the GIL with both)"
        )
    return lines


def _target_lines(rep: BenchReport) -> list[str]:
    lines = ["", "targets:"]
    for r in rep.results:
        for v in r.verdicts:
            lines.append(
                f"  {r.name:<13} {r.mode:<8} {v.name:<28} {v.value:>9.2f} (target {v.describe}): {_verdict(v.met)}"
                + (f"; {v.context}" if v.context else "")
            )
    for v in rep.report_verdicts:
        lines.append(
            f"  {'':<13} {'':<8} {v.name:<28} {v.value:>9.2f} (target {v.describe}): {_verdict(v.met)}"
            + (f"; {v.context}" if v.context else "")
        )
    for u in rep.report_unjudged:
        lines.append(f"  {'':<13} {'':<8} {u.name:<28} {'-':>9} (target {u.describe}): not judged: {u.why}")
    return lines


def _sweep_lines(rep: BenchReport, mode: str, rows: list[ScenarioResult]) -> list[str]:
    lines = ["", f"decode sweep, {mode} (engine us per request per step, p50):"]
    for r in rows:
        cpu_per_req = r.engine_cpu_us_p50 / r.requests_per_step
        lines.append(
            f"  {int(round(r.requests_per_step)):>4} requests: {r.engine_us_per_request:7.2f} us/request "
            f"(engine p50 {r.engine_us_p50:.1f} us; cpu {cpu_per_req:.2f} us/request; "
            f"floor ratio {r.engine_ratio:.1f}x)"
        )
    fit = rep.sweep_fit if mode == "eager" else rep.sweep_fit_threaded
    cpu = rep.sweep_cpu_fits.get(mode)
    if fit is not None:
        lines.append(
            f"  fit (least squares of engine p50): {fit[0]:.0f} us fixed per step + {fit[1]:.2f} us per request"
            + ("" if cpu is None else f"; of engine thread cpu: {cpu[0]:.0f} us + {cpu[1]:.2f} us per request")
            + " (targets above)"
        )
    if mode == "eager" and rep.sweep_spread is not None:
        allowed = rep.sweep_fixed_allowed_us
        lines.append(
            f"  spread max/min {rep.sweep_spread:.2f} (the former target <= {rep.sweep_target:.2f}, "
            f"now informational: {_verdict(rep.sweep_met)}); from cpu time {rep.sweep_cpu_spread:.2f}"
            + ("" if allowed is None else f"; it would need fixed <= {allowed:.0f} us at that per-request cost")
        )
    return lines


NO_BASELINE = (
    "no scenario slower than the baseline: not judged (no baseline: docs/bench_baseline.json is not in the "
    "working directory, or --baseline ''; --save-baseline writes one)"
)


def _baseline_lines(rep: BenchReport) -> list[str]:
    lines = [
        "",
        f"against the baseline {rep.baseline} (engine, materialize: floor-normalised, raw wall and floors in "
        f"brackets; {STEP_SIDE}: raw wall per step against the sum of the baseline's two medians; "
        f"target <= {rep.baseline_slack:.2f}x):",
    ]
    for r, side, ratio, ok in rep.baseline_verdicts():
        lines.append(f"  {r.name:<13} {r.mode:<8} {side:<18} {ratio:.2f}x: {_verdict(ok)}{_raw_note(r, side)}")
    judged = {(r.name, r.mode) for r, *_ in rep.baseline_verdicts()}
    for r in rep.results:
        if (r.name, r.mode) not in judged:
            lines.append(f"  {r.name:<13} {r.mode:<8} not judged: the baseline has no such row")
    return lines


def vllm_step_lines(rep: BenchReport) -> list[str]:
    """The sweep's engine p50 per step beside vLLM's scheduler step at each size: the step
    with the engine's gap between its calls (what the targets judge) and back to back."""
    if not rep.vllm_step_us:
        return []
    gap = rep.vllm_gap_us
    head = f"vLLM, {gap:g} us gap" if rep.vllm_step_gap_us else "vLLM (no gap)"
    out = [f"  {'requests':>8} {head:>20} {'back to back':>13} {'eager':>18} {'threaded':>18}"]
    for n, plain in sorted(rep.vllm_step_us.items()):
        judged = rep.vllm_step_judged_us.get(n, plain)
        cells = []
        for rows in (rep.sweep, rep.sweep_threaded):
            ours = next((r for r in rows if r.requests_per_step == n), None)
            cells.append("-" if ours is None else f"{ours.engine_us_p50:.0f} us ({ours.engine_us_p50 / judged:.2f}x)")
        gapped = f"{judged:.0f} us" if rep.vllm_step_gap_us else "-"
        out.append(f"  {n:>8} {gapped:>20} {plain:>10.0f} us {cells[0]:>18} {cells[1]:>18}")
    return out
