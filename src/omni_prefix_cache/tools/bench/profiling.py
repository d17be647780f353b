"""``bench --profile``: cProfile the timed steps of one scenario."""

from __future__ import annotations

import cProfile
import io
import pstats

from omni_prefix_cache.tools.bench.measure import run_scenario
from omni_prefix_cache.tools.bench.scenarios import SCENARIOS, decode_scenario


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
