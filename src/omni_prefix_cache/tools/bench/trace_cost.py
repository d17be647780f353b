"""What the trace costs (docs/trace.md): the serving simulation with the
trace off and on, side by side, in alternating rounds so a load change hits
both sides alike; engine-thread us per step (p50, p99: ``new_step_starts`` +
``save_outputs``), wall per step, trace bytes and records per step, and how
long ``validate`` takes on the trace.

    python -m omni_prefix_cache.tools.bench.trace_cost [--steps 700] [--rounds 3] [--json]

Speed is read as the on/off ratio of one run; say the load average with it
(it is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig, run_simulation
from omni_prefix_cache.tools.trace_check import read_trace, validate_trace


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _side(steps: int, seed: int, trace: Path | None, eager: bool) -> dict[str, Any]:
    cfg = SimConfig(
        seed=seed,
        steps=steps,
        workload=WorkloadConfig(arrival_steps=steps * 3 // 7),
        eager=eager,
        trace_path=None if trace is None else str(trace),
    )
    start = time.perf_counter()
    res = run_simulation(cfg)
    wall = time.perf_counter() - start
    out: dict[str, Any] = {
        "engine_us_p50": _pct(res.engine_us, 0.5),
        "engine_us_p99": _pct(res.engine_us, 0.99),
        "wall_ms_per_step": 1000 * wall / max(1, res.steps),
        "steps": res.steps,
        "ok": res.error is None and not res.mismatches,
    }
    if trace is not None:
        t0 = time.perf_counter()
        parsed = read_trace(trace)
        checked = validate_trace(parsed)
        out["validate_s"] = time.perf_counter() - t0
        out["replay_s"] = checked.seconds
        out["run_s"] = wall
        out["valid"] = checked.violation is None
        out["bytes_per_step"] = trace.stat().st_size / max(1, res.steps)
        out["records_per_step"] = len(parsed.records) / max(1, res.steps)
    return out


def measure(steps: int, rounds: int, seed: int = 0, eager: bool = False) -> dict[str, Any]:
    """``rounds`` x (off, on), alternating; medians per side and the on/off ratios."""
    sides: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="trace-cost-") as tmp:
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for side in order:
                path = Path(tmp) / f"{r}.jsonl" if side == "on" else None
                sides[side].append(_side(steps, seed, path, eager))
    med = {
        side: {k: statistics.median(run[k] for run in runs) for k in runs[0] if isinstance(runs[0][k], float)}
        for side, runs in sides.items()
    }
    return {
        "steps": steps,
        "rounds": rounds,
        "mode": "eager" if eager else "threaded",
        "load_average": os.getloadavg(),
        "off": med["off"],
        "on": med["on"],
        "ratio_engine_p50": med["on"]["engine_us_p50"] / med["off"]["engine_us_p50"],
        "ratio_wall": med["on"]["wall_ms_per_step"] / med["off"]["wall_ms_per_step"],
        "all_ok": all(run["ok"] for runs in sides.values() for run in runs) and all(r["valid"] for r in sides["on"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="inline writes (default: threaded committer, lagged)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = measure(args.steps, args.rounds, eager=args.eager)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        off, on = out["off"], out["on"]
        print(f"trace cost, {out['mode']}, {args.steps} steps x {args.rounds} rounds, load {out['load_average']}")
        ratio = out["ratio_engine_p50"]
        print(
            f"  engine us/step p50  off {off['engine_us_p50']:8.1f}  on {on['engine_us_p50']:8.1f}  ratio {ratio:.3f}"
        )
        print(f"  engine us/step p99  off {off['engine_us_p99']:8.1f}  on {on['engine_us_p99']:8.1f}")
        wall_off, wall_on, ratio = off["wall_ms_per_step"], on["wall_ms_per_step"], out["ratio_wall"]
        print(f"  wall ms/step        off {wall_off:8.3f}  on {wall_on:8.3f}  ratio {ratio:.3f}")
        print(f"  trace {on['bytes_per_step'] / 1024:.1f} KiB/step, {on['records_per_step']:.0f} records/step")
        print(f"  validate {on['validate_s']:.2f}s (replay {on['replay_s']:.2f}s) for a {on['run_s']:.2f}s run")
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
