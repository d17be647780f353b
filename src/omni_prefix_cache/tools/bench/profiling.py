"""``bench --profile``: cProfile the timed steps of one scenario, the engine
calls (``new_step_starts`` + ``save_outputs``, the forward left out) and
``materialize`` each in their own profile, so a wait inside materialize (a
prefetch not done yet) is never read as the engine thread's."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.tools.bench.measure import run_scenario
from omni_prefix_cache.tools.bench.scenarios import SCENARIOS, decode_scenario
from omni_prefix_cache.tools.bench.sides import with_metrics

PROFILE_CLOCKS = ("wall", "cpu")


def _profiler(clock: str) -> cProfile.Profile:
    """A profiler timing by the wall clock (waits show as the function
    waiting) or by the calling thread's CPU clock (waits cost nothing: where
    the thread's CPU goes, what the engine cpu target counts)."""
    if clock == "cpu":
        return cProfile.Profile(time.thread_time_ns, 1e-9)
    return cProfile.Profile()


def profile_scenario(
    name: str,
    *,
    eager: bool = True,
    top: int = 25,
    iters: int | None = None,
    clock: str = "wall",
    forward_us: float = 0.0,
    metrics: bool = False,
) -> str:
    """cProfile the timed steps of one scenario: for the engine calls, then
    for materialize, the top functions by own and by cumulative time.
    ``clock``: ``wall`` or ``cpu`` (``_profiler``). ``metrics``: the manager
    is built with ``PrefixCacheConfig.metrics`` (the process switch is off
    again after, as ``bench --metrics both`` leaves it). Raises ValueError
    for an unknown scenario or clock."""
    if name not in SCENARIOS and not name.startswith("decode_"):
        raise ValueError(f"unknown scenario {name!r}; choose from {sorted(SCENARIOS)} or decode_<requests>")
    if clock not in PROFILE_CLOCKS:
        raise ValueError(f"unknown profile clock {clock!r}; choose from {list(PROFILE_CLOCKS)}")
    sc = SCENARIOS[name]() if name in SCENARIOS else decode_scenario(int(name.split("_", 1)[1]))
    engine, materialize = _profiler(clock), _profiler(clock)
    TELEMETRY.disable()
    try:
        res = run_scenario(
            sc,
            eager=eager,
            iters=iters,
            profiler=engine,
            materialize_profiler=materialize,
            forward_us=forward_us,
            manager_factory=with_metrics() if metrics else None,
        )
    finally:
        TELEMETRY.disable()
    buf = io.StringIO()
    buf.write(
        f"profile of {name} ({res.mode}, {res.steps} timed steps, {clock} clock, metrics {'on' if metrics else 'off'}; "
        f"engine p50 {res.engine_us_p50:.1f} "
        f"us, materialize p50 {res.materialize_us_p50:.1f} us, profiler overhead included)\n"
    )
    for title, prof in (("engine calls (new_step_starts + save_outputs)", engine), ("materialize", materialize)):
        stats = pstats.Stats(prof, stream=buf)
        stats.strip_dirs()
        per_step = stats.total_tt * 1e6 / max(res.steps, 1)  # type: ignore[attr-defined]
        calls = stats.total_calls / max(res.steps, 1)  # type: ignore[attr-defined]
        buf.write(f"\n==== {title}: {per_step:.0f} us and {calls:.0f} function calls per step ====\n")
        buf.write("\n== by own time (tottime) ==\n")
        stats.sort_stats("tottime").print_stats(top)
        buf.write("\n== by cumulative time ==\n")
        stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()
