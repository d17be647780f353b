"""``omni-prefix-cache bench``: the engine and materialize cost per step
against a memcpy floor, with targets (the bench itself: ``tools.bench``)."""

from __future__ import annotations

import argparse
from typing import Any

from omni_prefix_cache.tools.commands.common import HelpFormatter, describe, float_in, non_negative, positive

# Scenario names of bench.SCENARIOS (bench imports torch; tests keep the two in step).
BENCH_SCENARIOS = ("decode", "decode_256", "decode_mm4", "prefill_hits", "deferred", "decode_spec2", "decode_spec4")
# Of those, the ones with speculative drafts: in the event-API table only.
SPEC_BENCH_SCENARIOS = ("decode_spec2", "decode_spec4")


def bench_scenario(text: str) -> str:
    """``--scenario``: one of ``BENCH_SCENARIOS``."""
    if text in BENCH_SCENARIOS:
        return text
    raise argparse.ArgumentTypeError(f"unknown scenario {text!r}; choose from {', '.join(BENCH_SCENARIOS)}")


def profile_scenario(text: str) -> str:
    """``--profile``: a scenario name or ``decode_<requests>`` (not a speculative one)."""
    if text in SPEC_BENCH_SCENARIOS:
        raise argparse.ArgumentTypeError(f"{text} runs in the event-API table only; --profile times the seed-era calls")
    if text in BENCH_SCENARIOS:
        return text
    head, _, size = text.partition("_")
    if head == "decode" and size.isdigit() and int(size) > 0:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown scenario {text!r}; choose from {', '.join(BENCH_SCENARIOS)} or decode_<requests>"
    )


def add_parser(sub: Any) -> None:
    """Declare ``bench`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "bench",
        help="engine and materialize cost per step against a memcpy floor, with targets",
        description=describe(
            "Scenarios decode (64x1), decode_256, decode_mm4 (four mm keys), prefill_hits, deferred, each in "
            "eager and threaded mode, and a decode batch sweep; decode_spec2 and decode_spec4 (decode with up to "
            "2 or 4 speculative draft tokens a request a step, some rejected) when named, in the event-API table "
            "only, beside decode's event row: the engine thread's cost of speculative decoding. Each row "
            "reports microseconds per step and per request and the ratio to floors measured in the same run "
            "(a torch clone of the step's row bytes; "
            "a staging copy plus a pool index_copy_ of them); the targets table says met or missed (a miss "
            "fails the run only with --strict). With a baseline report (default docs/bench_baseline.json when "
            "present) each row is compared with the baseline's, floor-normalised.",
            "A progress line (steps, elapsed, ETA) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=HelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--mode", choices=("eager", "threaded", "both"), default="both", help="committer mode(s), side by side"
    )
    mode.add_argument("--eager", dest="mode", action="store_const", const="eager", help="short for --mode eager")
    mode.add_argument(
        "--threaded", dest="mode", action="store_const", const="threaded", help="short for --mode threaded"
    )
    p.add_argument(
        "--baseline",
        metavar="JSON",
        default=None,
        help="a bench --json report to compare with; when absent, docs/bench_baseline.json if it exists ('' for none)",
    )
    p.add_argument("--save-baseline", metavar="JSON", default=None, help="also write this run's --json report here")
    p.add_argument(
        "--scenario",
        action="append",
        type=bench_scenario,
        metavar="{" + ",".join(BENCH_SCENARIOS) + "}",
        help="run only this scenario (repeatable; all but decode_spec2 and decode_spec4 when absent; those two "
        "run in the event-API table only)",
    )
    p.add_argument("--iters", type=positive, default=None, help="timed steps per scenario (per-scenario default)")
    p.add_argument("--warmup", type=non_negative, default=None, help="untimed steps first (per-scenario default)")
    p.add_argument("--no-sweep", action="store_true", help="skip the decode batch-size sweep")
    p.add_argument(
        "--repeat",
        type=positive,
        default=1,
        help="run every scenario row, metrics pair and sweep row N times and keep the median run "
        "(by engine p50; a pair by its engine on/off); `make bench` passes 3",
    )
    p.add_argument(
        "--forward-us",
        type=non_negative,
        default=0,
        help="simulate a forward pass: the engine thread sleeps this long between new_step_starts and "
        "save_outputs, not counted in engine time (0: none, as in the baseline)",
    )
    p.add_argument(
        "--profile",
        metavar="SCENARIO",
        type=profile_scenario,
        help="cProfile one scenario (a name above or decode_<requests>) and print the top functions, "
        "the engine calls and materialize each in their own profile (--forward-us applies, the forward "
        "left out; with --metrics on the manager records metrics, otherwise not)",
    )
    p.add_argument("--top", type=positive, default=25, help="functions shown by --profile")
    p.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what --profile times: wall (a wait shows in the function waiting) or cpu (the calling "
        "thread's CPU time: where the engine cpu target's time goes)",
    )
    p.add_argument("--json", action="store_true", help="print the machine-readable report (no progress line)")
    p.add_argument(
        "--metrics",
        choices=["off", "on", "both"],
        default="both",
        help="runtime metrics (PrefixCacheConfig.metrics, off by default in the library) in the bench's "
        "managers: off, on, or both: every scenario and mode with them off and on back to back, the first "
        "side alternating, the tables of the off side and the on/off ratios after them (twice the run time)",
    )
    p.add_argument(
        "--scrape",
        metavar="HZ",
        type=float_in(0.0, 1000.0),
        default=0.0,
        help="also run every scenario and mode without and with a thread scraping the Prometheus collector "
        "(generate_latest over the manager) HZ times a second during the timed steps, back to back, the first "
        "side alternating; both sides with metrics on whatever --metrics says, so the ratio is the scrape's; "
        "a last table gives engine and step p50 of both, the scrapes done and their p50 (0: none; needs the "
        "metrics extra)",
    )
    p.add_argument(
        "--no-event-api",
        action="store_true",
        help="skip the event-API table (decode and prefill_hits, and decode_spec2 and decode_spec4 when named, "
        "on the adapter + event calls + delivery, beside the seed-era path, back to back)",
    )
    p.add_argument(
        "--warm-pool",
        action="store_true",
        help="open every pool slab and write each page once before a scenario's first step, so its pool "
        "writes take no first-touch page faults (a long-running server's steady state; default: cold, "
        "slabs mapped lazily as in the baseline)",
    )
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=None,
        help="a vLLM venv's python: vLLM's own decode scheduler step is measured there after the sweep, "
        "and the sweep's engine time per step is judged against it (default: .venv-vllm/bin/python when it "
        "exists; '' for none)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument(
        "--torch-threads",
        type=non_negative,
        default=1,
        help="torch intra-op threads for the run (1 is steadier on a shared or small machine; 0 keeps torch's own)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the bench (imports torch); the exit status."""
    from omni_prefix_cache.tools.bench import main_bench

    return main_bench(args)
