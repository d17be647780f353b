"""The bench's issue-27 additions: the memcpy bound, the sweep fits in both
modes as targets, the targets judged across rows, ``--warm-pool`` and the
pool write's paths timed alone. Values checked are what the report must
derive from its rows, never speeds."""

from __future__ import annotations

import json
import os
import threading

import pytest

from omni_prefix_cache.tools.bench import BenchReport, ScenarioResult, format_report, run_bench
from omni_prefix_cache.tools.bench.goals import (
    METRICS_LIMIT,
    REPORT_TARGETS,
    VLLM_STEP_LIMITS,
    judge_report,
    unjudged,
    unjudged_rows,
)
from omni_prefix_cache.tools.bench.measure import RUSAGE_THREAD
from omni_prefix_cache.tools.bench.pool_write import PATHS, PoolWriteTiming, pool_write_lines, time_pool_writes
from omni_prefix_cache.tools.bench.results import MetricsPair
from omni_prefix_cache.tools.bench.scenarios import DECODE_TARGETS, DEFERRED_TARGETS, PREFILL_TARGETS, SCENARIOS


def _row(name: str, mode: str, n: int, engine: float, cpu: float | None = None) -> ScenarioResult:
    return ScenarioResult(
        name=name, mode=mode, steps=1, requests_per_step=float(n), tokens_per_step=float(n),
        engine_us_p50=engine, engine_us_p90=engine, materialize_us_p50=0.0, materialize_us_p90=0.0,
        engine_floor_us=1.0, materialize_floor_us=1.0, engine_ratio=1.0, materialize_ratio=1.0,
        tokens_per_s=1.0, engine_us_per_request=engine / n, engine_cpu_us_p50=engine if cpu is None else cpu,
    )  # fmt: skip


def _sweep(mode: str, fixed: float, per_request: float) -> list[ScenarioResult]:
    return [_row(f"decode_{n}", mode, n, fixed + per_request * n) for n in (16, 64, 256)]


def _verdicts(rep: BenchReport) -> dict[str, tuple[float, bool]]:
    return {v.name: (v.value, v.met) for v in judge_report(rep)}


def test_the_sweep_fits_are_judged_per_mode() -> None:
    rep = BenchReport(
        ("eager", "threaded"), 1, [], _sweep("eager", 110.0, 2.4), sweep_threaded=_sweep("threaded", 130.0, 1.2)
    )
    got = _verdicts(rep)
    assert got["sweep eager fixed us"] == (pytest.approx(110.0), True)
    assert got["sweep eager us/request"] == (pytest.approx(2.4), True)
    assert got["sweep threaded fixed us"] == (pytest.approx(130.0), False)  # over 100
    assert got["sweep threaded us/request"] == (pytest.approx(1.2), True)
    d = rep.to_dict()
    assert d["sweep_fit_threaded"] == [pytest.approx(130.0), pytest.approx(1.2)]
    assert d["sweep_cpu_fits"]["eager"] == [pytest.approx(110.0), pytest.approx(2.4)]


def test_cross_row_targets_compare_per_request_costs_and_skip_what_did_not_run() -> None:
    results = [
        _row("decode", "eager", 64, 64 * 5.0),
        _row("decode_256", "eager", 256, 256 * 5.5),  # more per request than decode: missed
        _row("decode", "threaded", 64, 64 * 4.0),
        _row("decode_256", "threaded", 256, 256 * 3.0),
        _row("deferred", "eager", 63, 63 * 9.0),  # 1.8x decode's: met
    ]
    rep = BenchReport(("eager", "threaded"), 1, results, [])
    got = _verdicts(rep)
    assert got["decode_256 / decode eager"] == (pytest.approx(1.1), False)
    assert got["decode_256 / decode threaded"] == (pytest.approx(0.75), True)
    assert got["deferred / decode eager"] == (pytest.approx(1.8), True)
    assert not any(name.startswith("sweep") for name in got)  # no sweep ran
    only_decode = BenchReport(("eager",), 1, results[:1], [])
    assert judge_report(only_decode) == []
    rep.report_verdicts = judge_report(rep)
    assert not rep.all_met
    report = format_report(rep)
    assert "decode_256 / decode eager" in report and "MISSED; decode_256 5.50 us/request, decode 5.00" in report
    assert {t["name"] for t in rep.to_dict()["report_targets"]} == set(got)
    assert len(REPORT_TARGETS) == 8 + len(VLLM_STEP_LIMITS)  # plus one per (mode, size) against vLLM


def test_the_spread_no_longer_decides_all_met() -> None:
    # A fixed cost inside the fit targets spreads more than the old 1.30.
    rep = BenchReport(("eager",), 1, [], _sweep("eager", 100.0, 2.0), sweep_spread=3.0, sweep_cpu_spread=3.0)
    rep.report_verdicts = judge_report(rep)
    assert rep.sweep_met is False and rep.all_met
    assert "now informational: MISSED" in format_report(rep)


def test_a_run_reports_the_memcpy_bound_and_both_sweeps() -> None:
    rep = run_bench(["decode"], iters=2, warmup=1, modes=("eager", "threaded"))
    for r in rep.results:
        assert r.memcpy_bound_us == pytest.approx(2 * r.staging_copy_us) and r.memcpy_bound_us > 0
        assert r.staging_copy_cpu_us > 0
    assert [r.name for r in rep.sweep] == [r.name for r in rep.sweep_threaded] == ["decode_16", "decode", "decode_256"]
    assert {r.mode for r in rep.sweep_threaded} == {"threaded"}
    assert "memcpy bound (2 x staging copy)" in format_report(rep)
    assert "decode sweep, threaded" in format_report(rep)
    names = {v.name for v in rep.report_verdicts}
    assert {"sweep eager fixed us", "sweep threaded us/request"} <= names
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["results"][0]["memcpy_bound_us"] == rep.results[0].memcpy_bound_us
    assert d["warm_pool"] is False and d["pool_write"] == []
    eager_only = run_bench(["decode"], iters=2, warmup=1, modes=("eager",), sweep=True)
    assert eager_only.sweep and not eager_only.sweep_threaded


@pytest.mark.skipif(RUSAGE_THREAD is None, reason="no per-thread page fault counts on this OS")
def test_warm_pool_takes_the_pool_writes_first_touch_faults_before_timing() -> None:
    """Eager decode writes each request's row to a fresh 4 KiB page every
    step: cold, that is one fault per request inside the engine call; warm,
    the slabs were written once before the first step."""
    cold = run_bench(["decode"], iters=3, warmup=1, sweep=False, modes=("eager",))
    warm = run_bench(["decode"], iters=3, warmup=1, sweep=False, modes=("eager",), warm=True)
    (c,), (w,) = cold.results, warm.results
    assert not c.warm_pool and w.warm_pool and warm.warm_pool
    assert c.engine_faults_p50 is not None and w.engine_faults_p50 is not None
    assert c.engine_faults_p50 >= 64 > w.engine_faults_p50
    assert "pool: warm" in format_report(warm) and "pool: cold" in format_report(cold)


def test_pool_write_paths_count_their_whole_block_rows() -> None:
    timings = time_pool_writes(shapes=("prefill", "prefill_misaligned", "decode"), widths=(16, 2048))
    whole = {(t.shape, t.width, t.path): t.whole_block_rows for t in timings}
    assert {t.path for t in timings} == set(PATHS)
    assert whole[("prefill", 16, "blocks")] == whole[("prefill", 16, "pool")] == 2048
    assert whole[("prefill", 2048, "blocks")] == 2048 and whole[("prefill", 2048, "pool")] == 0  # wide rows: by row
    assert whole[("prefill_misaligned", 16, "blocks")] == 0  # opens mid-block
    assert whole[("decode", 16, "pool")] == 0
    assert all(t.us_p50 > 0 and t.gb_per_s > 0 for t in timings)
    lines = pool_write_lines([PoolWriteTiming(**t.to_dict()) for t in timings])
    assert sum(1 for line in lines if line.split()[:2] == ["prefill", "16"]) == 1


def test_engine_wait_is_the_per_step_wall_the_engine_thread_spent_off_its_cpu() -> None:
    """The engine wait readout is the p50 / p90 of each step's own wall minus
    thread CPU (not the difference of the two medians), clamped at 0, and the
    report prints it on the row."""
    from omni_prefix_cache.tools.bench.floors import StepFloors
    from omni_prefix_cache.tools.bench.measure import Samples, StepTiming
    from omni_prefix_cache.tools.bench.scenarios import StepInput

    samples = Samples()
    floors = StepFloors(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    step = StepInput(output=None, order=["r"], blocks={}, computed={}, n=1)  # type: ignore[arg-type]
    # walls 100, 50, 400, 300, 10; cpus 10, 45, 100, 290, 12: waits 90, 5, 300, 10, 0 (clamped)
    for wall, cpu in [(100.0, 10.0), (50.0, 45.0), (400.0, 100.0), (300.0, 290.0), (10.0, 12.0)]:
        samples.add(StepTiming(wall, 1.0, cpu, 1.0, 0.0, 0.0, 0.0, 0.0), floors, step, {})
    r = samples.result("decode", "threaded", committer_clocked=False, forward_us=0.0)
    assert (r.engine_wait_us_p50, r.engine_wait_us_p90) == (10.0, 300.0)
    assert r.engine_us_p50 - r.engine_cpu_us_p50 == 55.0  # what a difference of medians would say
    lines = format_report(BenchReport(("threaded",), 1, [r], []))
    assert "engine wait off-cpu inside new_step_starts + save_outputs p50 10.0 us, p90 300.0 us" in lines


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_profile_keeps_the_engine_calls_and_materialize_apart(clock: str) -> None:
    """``bench --profile``: the engine calls' profile holds new_step_starts
    and save_outputs and nothing of materialize (its prefetch waits are not
    the engine thread's), and materialize's profile the other way round."""
    from omni_prefix_cache.tools.bench.profiling import profile_scenario

    text = profile_scenario("decode_4", eager=False, top=200, iters=3, clock=clock, forward_us=100.0)
    head, engine, materialize = text.split("\n==== ")
    assert f"{clock} clock" in head
    assert engine.startswith("engine calls") and materialize.startswith("materialize")
    assert "(new_step_starts)" in engine and "(save_outputs)" in engine
    assert "(materialize)" not in engine and "materializer.py" not in engine
    assert "(materialize)" in materialize and "(save_outputs)" not in materialize
    assert "(new_step_starts)" not in materialize
    # The forward the bench sleeps is in neither profile.
    assert "{built-in method time.sleep}" not in text
    with pytest.raises(ValueError, match="unknown profile clock"):
        profile_scenario("decode_4", clock="gpu")


def test_profile_with_metrics_on_profiles_the_recording_and_leaves_the_switch_off() -> None:
    """``bench --profile --metrics on``: the manager records (the move
    recorder shows in the engine calls' profile); the process switch is off
    after, as ``--metrics both`` leaves it. Without it nothing records."""
    from omni_prefix_cache.telemetry.registry import TELEMETRY
    from omni_prefix_cache.tools.bench.profiling import profile_scenario

    on = profile_scenario("decode_4", top=400, iters=3, metrics=True)
    assert "metrics on" in on.split("\n", 1)[0] and "(moved)" in on
    assert not TELEMETRY.enabled
    off = profile_scenario("decode_4", top=400, iters=3)
    assert "metrics off" in off.split("\n", 1)[0] and "(moved)" not in off


def test_the_wake_probe_runs_each_side_with_its_thread_and_leaves_none_behind() -> None:
    from omni_prefix_cache.tools.bench.wake_probe import THREAD_NAME, WakeProbe, probe_wake, wake_probe_lines

    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    # probe_wake raises unless each woken side's thread served its wakes.
    probe = probe_wake(iters=4, warmup=2, pairs=2)
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    if cpus is not None:
        assert set(os.sched_getaffinity(0)) == cpus  # the one-CPU side gave this thread its CPUs back
        assert (probe.one_cpu_us is not None) == (len(cpus) > 1)
    assert probe.alone_us > 0 and probe.woken_us > 0
    assert probe.extra_us == probe.woken_us - probe.alone_us
    d = json.loads(json.dumps(probe.to_dict()))
    assert WakeProbe(**d) == probe
    (line,) = [s for s in wake_probe_lines(probe) if s.startswith("wake probe")]
    assert f"alone {probe.alone_us:.0f} us" in line and f"({probe.extra_us:+.0f} us)" in line
    rep = run_bench(["decode"], iters=2, warmup=1, modes=("eager",), sweep=False)
    assert rep.wake_probe is None and "wake probe" not in format_report(rep)
    rep.wake_probe = probe.to_dict()
    assert "wake probe (eager decode x1" in format_report(rep)


def test_the_sweep_is_judged_against_vllms_scheduler_step_at_each_size() -> None:
    eager, threaded = _sweep("eager", 400.0, 5.0), _sweep("threaded", 300.0, 2.0)
    vllm = {16: 200.0, 64: 700.0, 256: 3000.0}
    rep = BenchReport(("eager", "threaded"), 1, [], eager, sweep_threaded=threaded, vllm_step_us=vllm)
    got = _verdicts(rep)
    # eager x16: (400 + 80) / 200 = 2.4 > 1.5; x256: (400 + 1280) / 3000 = 0.56 <= 0.75
    assert got["eager x16 / vLLM sched step"] == (pytest.approx(2.4), False)
    assert got["eager x256 / vLLM sched step"] == (pytest.approx(0.56), True)
    # threaded x64: (300 + 128) / 700 = 0.611 > 0.5; x256: (300 + 512) / 3000 = 0.27 <= 0.5
    assert got["threaded x64 / vLLM sched step"] == (pytest.approx(428 / 700), False)
    assert got["threaded x256 / vLLM sched step"] == (pytest.approx(812 / 3000), True)
    context = next(v.context for v in judge_report(rep) if v.name.startswith("eager x16"))
    assert "vLLM scheduler step back to back 200 us" in context
    text = format_report(rep)
    assert "vLLM's scheduler step" in text
    assert "256                    -       3000 us    1680 us (0.56x)     812 us (0.27x)" in text
    assert rep.to_dict()["vllm_step_us"] == vllm
    # Measured with the engine's gap too: the targets judge that step, and the table shows both.
    rep.vllm_step_gap_us, rep.vllm_gap_us = {16: 400.0, 64: 1400.0, 256: 6000.0}, 5000.0
    got = _verdicts(rep)
    assert got["eager x16 / vLLM sched step"] == (pytest.approx(1.2), True)
    assert got["threaded x64 / vLLM sched step"] == (pytest.approx(428 / 1400), True)
    context = next(v.context for v in judge_report(rep) if v.name.startswith("eager x16"))
    assert "vLLM scheduler step with a 5000 us gap 400 us" in context
    text = format_report(rep)
    assert "vLLM, 5000 us gap" in text
    assert "16               400 us        200 us     480 us (1.20x)     332 us (0.83x)" in text
    assert rep.to_dict()["vllm_step_gap_us"] == rep.vllm_step_gap_us and rep.to_dict()["vllm_gap_us"] == 5000.0
    rep.vllm_step_gap_us, rep.vllm_gap_us = {}, 0.0
    # Not measured (no vLLM venv): the six targets are not judged, and say why.
    rep.vllm_step_us, rep.vllm_step_note = {}, "vLLM's scheduler step not measured (no vLLM venv)"
    assert not [name for name in _verdicts(rep) if "vLLM" in name]
    why = {u.name: u.why for u in unjudged(rep)}
    assert why["eager x16 / vLLM sched step"] == "vLLM's scheduler step not measured (no vLLM venv)"
    rep.report_unjudged = unjudged(rep)
    assert "eager x16 / vLLM sched step" in format_report(rep) and "not judged: vLLM's" in format_report(rep)


def test_vllms_scheduler_step_is_skipped_with_a_reason_when_its_venv_is_missing(tmp_path) -> None:
    from omni_prefix_cache.tools.bench.vllm_step import scheduler_step_us

    none = scheduler_step_us(None, (16,))
    assert (none.back_to_back_us, none.with_gap_us) == ({}, {})
    assert none.note == "vLLM's scheduler step not measured (no vLLM venv)"
    missing = str(tmp_path / "python")
    got = scheduler_step_us(missing, (16,), gap_us=5000.0)
    assert got.back_to_back_us == got.with_gap_us == {} and missing in got.note and "setup-vllm.sh" in got.note


# ---------------------------------------------------------------- issue 40's targets


def _row_verdicts(r: ScenarioResult, targets) -> dict[str, bool]:
    r.judge(targets)
    return {v.name: v.met for v in r.verdicts}


@pytest.mark.parametrize(("engine", "met"), [(1900.0, True), (2100.0, False)])
def test_prefill_hits_eager_engine_is_held_to_2x_the_memcpy_bound(engine: float, met: bool) -> None:
    r = _row("prefill_hits", "eager", 8, engine)
    r.memcpy_bound_us = 1000.0
    assert _row_verdicts(r, PREFILL_TARGETS)["engine / memcpy bound"] is met
    assert SCENARIOS["prefill_hits"]().targets is PREFILL_TARGETS


@pytest.mark.parametrize("mode", ["eager", "threaded"])
@pytest.mark.parametrize(("engine", "met"), [(630.0 * 1.9, True), (630.0 * 2.1, False)])
def test_deferred_engine_per_request_is_held_to_2x_its_own_memcpy_bound(mode: str, engine: float, met: bool) -> None:
    r = _row("deferred", mode, 63, engine)
    r.memcpy_bound_us = 630.0  # 10 us per request
    (v,) = (r.judge(DEFERRED_TARGETS), r.verdicts)[1]
    assert v.met is met and v.value == pytest.approx(engine / 630.0)
    assert "memcpy bound 10.00 us/request" in v.context
    assert SCENARIOS["deferred"]().targets is DEFERRED_TARGETS


@pytest.mark.parametrize(("ratio", "met"), [(8.0, True), (8.5, False)])
def test_decode_materialize_is_held_to_8x_its_floor(ratio: float, met: bool) -> None:
    for mode in ("eager", "threaded"):
        r = _row("decode", mode, 64, 64.0)
        r.materialize_ratio = ratio
        assert _row_verdicts(r, DECODE_TARGETS)["materialize / floor"] is met


def _pair(on_over_off: float) -> MetricsPair:
    off, on = _row("decode", "eager", 64, 400.0), _row("decode", "eager", 64, 400.0 * on_over_off)
    return MetricsPair(off=off, on=on, order=("off", "on"))


@pytest.mark.parametrize(("ratio", "met"), [(1.10, True), (1.20, False)])
def test_metrics_on_over_off_is_judged_on_the_decode_eager_pair(ratio: float, met: bool) -> None:
    pair = _pair(ratio)
    rep = BenchReport(("eager",), 1, [pair.off], [], metrics_sides=("off", "on"), metrics_pairs=[pair])
    got = _verdicts(rep)
    assert got["metrics on / off decode eager"] == (pytest.approx(ratio), met)
    assert METRICS_LIMIT == 1.15
    rep.report_verdicts = judge_report(rep)
    assert rep.all_met is met
    assert "metrics on / off decode eager" in format_report(rep)
    assert "metrics on / off decode eager" not in {u.name for u in unjudged(rep)}


def test_metrics_on_over_off_not_judged_says_why() -> None:
    rep = BenchReport(("eager",), 1, [_row("decode", "eager", 64, 400.0)], [])
    why = {u.name: u.why for u in unjudged(rep)}
    assert why["metrics on / off decode eager"] == "needs --metrics both (this run: --metrics off)"
    threaded = _pair(1.0)
    threaded.off.mode = threaded.on.mode = "threaded"
    rep = BenchReport(("threaded",), 1, [], [], metrics_sides=("off", "on"), metrics_pairs=[threaded])
    assert {u.name: u.why for u in unjudged(rep)}["metrics on / off decode eager"] == (
        "decode eager did not run (--scenario, --mode)"
    )
    assert {u.name: u.why for u in unjudged(rep)}["sweep eager fixed us"].startswith("the eager decode sweep did not")


def test_every_report_target_not_judged_is_listed_with_a_reason_and_rows_not_run_too() -> None:
    rep = BenchReport(("eager",), 1, [_row("decode", "eager", 64, 400.0)], [])
    assert {u.name for u in unjudged(rep)} == {t.name for t in REPORT_TARGETS}
    assert all(u.why for u in unjudged(rep))
    rows = {u.name: u.why for u in unjudged_rows(rep, {"prefill_hits": PREFILL_TARGETS, "decode": DECODE_TARGETS})}
    assert "prefill_hits eager engine / memcpy bound" in rows and "decode eager materialize / floor" not in rows
    assert "decode threaded materialize / floor" in rows
    rep.report_unjudged = unjudged_rows(rep, {"prefill_hits": PREFILL_TARGETS})
    assert "prefill_hits eager did not run" in format_report(rep)
    assert rep.to_dict()["unjudged_targets"][0]["why"].startswith("prefill_hits eager did not run")


def test_the_report_says_when_there_is_no_baseline_and_which_rows_it_lacks() -> None:
    rep = BenchReport(("eager",), 1, [_row("decode", "eager", 64, 400.0)], [])
    assert "no scenario slower than the baseline: not judged (no baseline" in format_report(rep)
    rep.baseline = "base.json"
    rep.results.append(_row("deferred", "eager", 63, 630.0))
    rep.results[0].engine_vs_baseline = 1.2  # slower than the slack allows
    text = format_report(rep)
    assert "decode        eager    engine             1.20x: MISSED" in text
    assert "deferred      eager    not judged: the baseline has no such row" in text
    assert not rep.all_met


def test_repeat_keeps_the_median_run_of_each_row_and_pair() -> None:
    from omni_prefix_cache.tools.bench.runner import median_pair, median_run

    runs = [_row("decode", "eager", 64, us) for us in (300.0, 100.0, 200.0)]
    assert median_run(runs) is runs[2]
    assert median_run(runs[:2]) is runs[1]  # even: the lower middle one
    pairs = [_pair(1.3), _pair(1.1), _pair(1.2)]
    assert median_pair(pairs) is pairs[2]
    done: list[tuple[int, int]] = []
    rep = run_bench(
        ["decode"], iters=2, warmup=1, modes=("eager",), sweep=False, metrics="both", repeat=3,
        progress=lambda d, t: done.append((d, t)),
    )  # fmt: skip
    assert len(rep.metrics_pairs) == 1 and rep.results == [rep.metrics_pairs[0].off]
    assert done[-1] == (3 * 2 * 3, 3 * 2 * 3)  # 3 steps a run, 2 sides, 3 repeats: every step planned and run
    assert {u.name for u in rep.report_unjudged} >= {"sweep eager fixed us", "deferred eager engine / memcpy bound"}
    with pytest.raises(ValueError, match="repeat"):
        run_bench(["decode"], iters=1, warmup=0, modes=("eager",), sweep=False, repeat=0)
