"""omni-prefix-cache command line: render the spec diagrams, run the verified serving simulation,
benchmark the engine-facing calls, and model-check the composed write pipeline."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Exit statuses shared by every command. A usage error is argparse's 2, so a
# script can tell a bad command line from a run that found a problem.
EXIT_OK = 0
EXIT_FAILED = 1  # mismatch, leak, invariant violation, missed target (bench --strict)
EXIT_USAGE = 2  # bad arguments: nothing was run
EXIT_ERROR = 3  # the run stopped early: the manager raised, or check gave up past --max-states
EXIT_NOTHING_CHECKED = 4  # the run finished but checked no row, so it cannot say OK

EXIT_STATUS_HELP = (
    f"exit status: {EXIT_OK} ok, {EXIT_FAILED} a check failed (mismatch, leak, violation, missed target),\n"
    f"  {EXIT_USAGE} usage error, {EXIT_ERROR} the run stopped with an error, "
    f"{EXIT_NOTHING_CHECKED} nothing was checked"
)

# Scenario names of bench.SCENARIOS (bench imports torch; tests keep the two in step).
BENCH_SCENARIOS = ("decode", "decode_256", "decode_mm4", "prefill_hits", "deferred")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` on every option that has a real default (not on on/off flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # On/off flags say in their help which side is the default.
        if action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _describe(*paragraphs: str) -> str:
    """A subcommand description: prose paragraphs wrapped, then the exit statuses as written."""
    import textwrap

    return "\n\n".join([*(textwrap.fill(p, width=88) for p in paragraphs), EXIT_STATUS_HELP])


# ------------------------------------------------------------ validation


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _float_in(low: float, high: float | None, *, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or (value <= low if low_open else value < low) or (high is not None and value > high):
            bound = f"in {'(' if low_open else '['}{low}, {high}]" if high is not None else f"above {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive = _int_at_least(1)
non_negative = _int_at_least(0)
probability = _float_in(0.0, 1.0)


def _bench_scenario(text: str) -> str:
    if text in BENCH_SCENARIOS:
        return text
    raise argparse.ArgumentTypeError(f"unknown scenario {text!r}; choose from {', '.join(BENCH_SCENARIOS)}")


def _profile_scenario(text: str) -> str:
    if text in BENCH_SCENARIOS:
        return text
    head, _, size = text.partition("_")
    if head == "decode" and size.isdigit() and int(size) > 0:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown scenario {text!r}; choose from {', '.join(BENCH_SCENARIOS)} or decode_<requests>"
    )


def _progress_enabled(args: argparse.Namespace) -> bool | None:
    """None (TTY decides) unless --json or --quiet turn the progress line off."""
    return False if getattr(args, "json", False) or getattr(args, "quiet", False) else None


# -------------------------------------------------------------- diagrams


def _add_diagrams_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diagrams",
        help="render every spec into DOT (and SVG) diagrams",
        description=_describe(
            "Render every spec/*.yaml into <out>/<name>.dot and .svg (the SVG needs graphviz's dot). "
            "With --check, compare the committed .dot files with the specs instead."
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("--out", default="diagrams", help="output folder")
    p.add_argument("--check", action="store_true", help="exit 1 if a committed .dot differs from the specs")
    p.add_argument("--no-svg", action="store_true", help="write .dot files only")
    p.set_defaults(func=_cmd_diagrams, validate=lambda args: _validate_diagrams(p, args))


def _validate_diagrams(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.check:
        return
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --out: cannot create folder {str(out)!r}: {exc.strerror or exc}")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"argument --out: folder {str(out)!r} is not writable")


def _cmd_diagrams(args: argparse.Namespace) -> int:
    try:
        from omni_prefix_cache.specs.diagrams import stale_diagrams, write_diagrams
    except ImportError as exc:
        print(f"diagrams: {exc}; install the extra: pip install 'omni-prefix-cache[diagrams]'", file=sys.stderr)
        return EXIT_ERROR

    out = Path(args.out)
    if args.check:
        stale = stale_diagrams(out)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)} (run: make diagrams)", file=sys.stderr)
            return EXIT_FAILED
        print(f"diagrams in {out} match the specs")
        return EXIT_OK
    try:
        written = write_diagrams(out, svg=not args.no_svg)
    except OSError as exc:
        print(f"diagrams: cannot write to {out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK


# --------------------------------------------------------------- simulate


def _add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="drive the manager through a synthetic vLLM-like serving trace and check every row",
        description=_describe(
            "Synthetic engine loop (chunked prefill, decode, preemption, streaming, same-step hits, "
            "aborts, a deferred key) against the real manager; an oracle checks every materialized row.",
            "A progress line (steps, elapsed, ETA) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=_Formatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--threaded", dest="eager", action="store_false", help="real committer thread (the default)")
    mode.add_argument("--eager", dest="eager", action="store_true", help="copies and pool writes inline at submit")
    p.set_defaults(eager=False)
    lag = p.add_mutually_exclusive_group()
    lag.add_argument(
        "--lag",
        dest="lag",
        action="store_true",
        default=None,
        help="materialize one step behind on a thread (the default when threaded)",
    )
    lag.add_argument(
        "--no-lag", dest="lag", action="store_false", default=None, help="materialize inline after each save"
    )
    p.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="scheduler and input batch: the project's look-alikes or vLLM's real ones (needs vLLM: .ci/setup-vllm.sh)",
    )
    p.add_argument("--seed", type=non_negative, default=0, help="seed of the trace and the discard choices")
    p.add_argument("--steps", type=positive, default=2000, help="step cap; requests still live there are aborted")
    p.add_argument("--arrival-steps", type=positive, default=500, help="requests arrive during this many steps")
    p.add_argument(
        "--arrivals-per-step",
        type=_float_in(0.0, None, low_open=True),
        default=0.45,
        help="mean new requests per step while they arrive",
    )
    p.add_argument("--num-blocks", type=positive, default=96, help="KV blocks (small: preemption and recycling)")
    p.add_argument("--block-size", type=positive, default=16, help="tokens per KV block")
    p.add_argument("--token-budget", type=positive, default=256, help="max scheduled tokens per step")
    p.add_argument("--max-seqs", type=positive, default=16, help="max running requests per step")
    p.add_argument("--hidden", type=positive, default=64, help="hidden-state width")
    p.add_argument("--no-hidden", action="store_true", help="the policy opts out of hidden states (mm keys only)")
    p.add_argument("--staging-depth", type=positive, default=4, help="staging pages (unconsumed step ids)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="row dtype")
    p.add_argument(
        "--gpu-staging-bytes",
        type=non_negative,
        default=24 * 1024,
        help="budget of deferred device clones in bytes (small: more budget flushes)",
    )
    p.add_argument(
        "--discard-prob", type=probability, default=0.03, help="chance a step is discarded, not materialized"
    )
    p.add_argument("--json", action="store_true", help="print the machine-readable summary (no progress line)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--torch-threads",
        type=non_negative,
        default=1,
        help="torch intra-op threads (tiny tensor ops stall on a busy OpenMP pool; 0 keeps torch's own)",
    )
    p.add_argument("--verbose", action="store_true", help="print the manager's log warnings")
    p.set_defaults(func=_cmd_simulate, validate=lambda args: _validate_simulate(p, args))


def _sim_config(args: argparse.Namespace) -> Any:
    from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig

    return SimConfig(
        seed=args.seed,
        steps=args.steps,
        workload=WorkloadConfig(arrival_steps=args.arrival_steps, arrivals_per_step=args.arrivals_per_step),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        token_budget=args.token_budget,
        max_num_seqs=args.max_seqs,
        hidden_size=args.hidden,
        cache_hidden=not args.no_hidden,
        staging_depth=args.staging_depth,
        dtype=args.dtype,
        gpu_staging_bytes=args.gpu_staging_bytes,
        discard_prob=args.discard_prob,
        eager=args.eager,
        lag=args.lag,
    )


def _validate_simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # The manager's own config check, run before the simulation starts, so a bad
    # combination is a usage error rather than "the manager raised".
    from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError

    try:
        _sim_config(args).prefix_cache_config()
    except (ValueError, TypeError, OmniPrefixCacheUnmatchError) as exc:
        parser.error(str(exc))


def _cmd_simulate(args: argparse.Namespace) -> int:
    import json
    import logging

    import torch

    from omni_prefix_cache.tools.simulate import run_simulation
    from omni_prefix_cache.tools.simulate.report import ProgressLine, format_table, summary

    cfg = _sim_config(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run = run_simulation
    if args.engine == "vllm":
        from omni_prefix_cache.tools.simulate.vllm_engine import run_vllm_simulation as run
    progress = ProgressLine(enabled=_progress_enabled(args))
    progress.arrival_steps = args.arrival_steps
    try:
        res = run(cfg, progress=progress)
    except ImportError as exc:
        print(f"simulate --engine {args.engine}: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    if args.json:
        print(json.dumps(summary(res), indent=2, default=str))
    else:
        print(format_table(res))
    if res.error is not None:
        return EXIT_ERROR
    if res.mismatches or res.leaked:
        return EXIT_FAILED
    return EXIT_NOTHING_CHECKED if res.checked_nothing else EXIT_OK


# ------------------------------------------------------------------ bench


def _add_bench_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="engine and materialize cost per step against a memcpy floor, with targets",
        description=_describe(
            "Scenarios decode (64x1), decode_256, decode_mm4 (four mm keys), prefill_hits, deferred, each in "
            "eager and threaded mode, and a decode batch sweep. Each row reports microseconds per step and per "
            "request and the ratio to floors measured in the same run (a torch clone of the step's row bytes; "
            "a staging copy plus a pool index_copy_ of them); the targets table says met or missed (a miss "
            "fails the run only with --strict). With a baseline report (default docs/bench_baseline.json when "
            "present) each row is compared with the baseline's, floor-normalised.",
            "A progress line (steps, elapsed, ETA) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=_Formatter,
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
        type=_bench_scenario,
        metavar="{" + ",".join(BENCH_SCENARIOS) + "}",
        help="run only this scenario (repeatable; all when absent)",
    )
    p.add_argument("--iters", type=positive, default=None, help="timed steps per scenario (per-scenario default)")
    p.add_argument("--warmup", type=non_negative, default=None, help="untimed steps first (per-scenario default)")
    p.add_argument("--no-sweep", action="store_true", help="skip the decode batch-size sweep")
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
        type=_profile_scenario,
        help="cProfile one scenario (a name above or decode_<requests>) and print the top functions",
    )
    p.add_argument("--top", type=positive, default=25, help="functions shown by --profile")
    p.add_argument("--json", action="store_true", help="print the machine-readable report (no progress line)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument(
        "--torch-threads",
        type=non_negative,
        default=1,
        help="torch intra-op threads for the run (1 is steadier on a shared or small machine; 0 keeps torch's own)",
    )
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from omni_prefix_cache.tools.bench import main_bench

    return main_bench(args)


# ------------------------------------------------------------------ check

_CHECK_SUMMARY = "bounded exhaustive check of the composition spec (every reachable state, TLC-style)"
_BOUND_HELP = {
    "requests": "requests",
    "tasks": "write tasks in all",
    "slots": "KV slots",
    "pages": "staging pages",
    "steps": "saved steps in all",
    "reads": "planned delayed reads at a time",
    "failures": "injected write failures",
    "keys": "pool keys per slot (hidden, then mm keys a step may leave out)",
}
_BOUND_MIN = {"reads": 0, "failures": 0}


def _add_check_parser(sub: Any, *, full: bool = True) -> None:
    if not full:
        # Another command was asked for: the bounds and variants live in the
        # model checker, whose import costs seconds (it loads the specs).
        sub.add_parser("check", help=_CHECK_SUMMARY)
        return
    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, BROKEN, CI_BOUNDS

    p = sub.add_parser(
        "check",
        help=_CHECK_SUMMARY,
        description=_describe(
            "Breadth-first over every reachable state of the composition spec (spec/protocol.yaml): each "
            "segment of an operation (save, escalate, committer claim/copy/write, fail, drain, materialize, "
            "discard, ...) is one atomic action over the component machines, interleaved with the other threads' "
            "segments. Checks the protocol's model invariants and the machines' own in every state, and that every "
            "state can still settle; prints states explored, depth and time, or a shortest counterexample in "
            "operation-level steps.",
            "A bound left out takes the CI bound's value (the --big bound's with --big). A progress line "
            "(states expanded and found, depth, elapsed) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=_Formatter,
    )
    for name, text in _BOUND_HELP.items():
        p.add_argument(
            f"--{name}",
            type=_int_at_least(_BOUND_MIN.get(name, 1)),
            default=None,
            help=f"{text} (CI bound {getattr(CI_BOUNDS, name)}, --big {getattr(BIG_BOUNDS, name)})",
        )
    p.add_argument(
        "--broken",
        type=_broken_variant,
        metavar="NAME|FILE.yaml",
        help="check a spec mutation instead: a catalogued one ("
        + "; ".join(f"{k}: {v.meaning}" for k, v in BROKEN.items())
        + ") or a whole replacement protocol file (a mutation kept as a file)",
    )
    p.add_argument(
        "--big",
        action="store_true",
        help=f"start from the bigger bound ({BIG_BOUNDS.describe()}; minutes) instead of the CI bound",
    )
    p.add_argument(
        "--max-states", type=positive, default=None, help=f"give up past this many states (exit {EXIT_ERROR})"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress line)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_check)


def _broken_variant(text: str) -> str:
    """``--broken``: a catalogued mutation name or a readable .yaml file."""
    from omni_prefix_cache.testing.modelcheck import BROKEN

    if text in BROKEN:
        return text
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no such protocol file: {text}")
        return text
    raise argparse.ArgumentTypeError(
        f"unknown variant {text!r} (catalogued: {', '.join(sorted(BROKEN))}; or a protocol .yaml file)"
    )


def check_result_dict(result: Any) -> dict[str, Any]:
    """What ``check --json`` prints for a ``modelcheck.CheckResult``."""
    import dataclasses

    violation = result.violation
    return {
        "ok": result.ok,
        "bounds": dataclasses.asdict(result.bounds),
        "broken": result.broken,
        "states": result.states,
        "transitions": result.transitions,
        "max_depth": result.depth,
        "seconds": round(result.seconds, 3),
        "violation": None if violation is None else {"name": violation.name, "message": violation.message},
        "trace": list(result.trace),
        "final_state": list(result.final_state),
    }


def _cmd_check(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, CI_BOUNDS, check
    from omni_prefix_cache.tools.progress import StepProgress

    base = BIG_BOUNDS if args.big else CI_BOUNDS
    given = {name: getattr(args, name) for name in _BOUND_HELP if getattr(args, name) is not None}
    bounds = dataclasses.replace(base, **given)
    line = StepProgress("expanded", enabled=_progress_enabled(args))

    def progress(expanded: int, found: int, depth: int) -> None:
        line.update(expanded, None, f"states found {found}  depth {depth}")

    from omni_prefix_cache.specs.loader import SpecError

    try:
        result = check(bounds, args.broken, max_states=args.max_states, progress=progress)
    except SpecError as exc:
        line.close()
        print(f"check: the protocol does not load: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        line.close()
        print(f"check: {exc}", file=sys.stderr)
        return EXIT_ERROR
    line.close()
    print(json.dumps(check_result_dict(result), indent=2) if args.json else result.report())
    return EXIT_OK if result.ok else EXIT_FAILED


# ------------------------------------------------------------------ explore

_EXPLORE_SUMMARY = "race the runtime's real threads under a controlled scheduler"
# Scenario names of testing.explore.runner.SCENARIOS (tests keep the two in step), cheapest first.
EXPLORE_SCENARIOS = (
    "copy-interrupt",
    "escalate-copying",
    "copy-failure",
    "write-failure",
    "reuse-read",
    "deferred-flush",
    "shutdown",
)
# The CI bound: every schedule with at most one deviation, per scenario.
EXPLORE_CI_BOUND = 1


def _add_explore_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explore",
        help=_EXPLORE_SUMMARY,
        description=_describe(
            "Runs the real manager, its committer thread and its prefetch threads on real threads, but one at a "
            "time: every lock acquire, condition or event wait, thread start or join and future result is a point "
            "where a scheduler picks the next thread. Per scenario it explores every schedule with at most "
            "--bound deviations from the default scheduler (or --strategy pct: random priority schedules), checks "
            "named invariants at every sync point and the row oracle, deadlocks and leaks after each schedule, "
            "and prints schedules explored, the bound, distinct states, elapsed time and found: N.",
            "Every failure prints a replay token; --replay TOKEN re-runs exactly that interleaving.",
        ),
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=EXPLORE_SCENARIOS,
        help="scenario to explore (repeatable; default: all)",
    )
    p.add_argument("--strategy", choices=("dfs", "pct"), default="dfs", help="bounded-exhaustive or PCT")
    p.add_argument("--bound", type=_int_at_least(0), default=2, help="deviation (preemption) bound; pct: its depth")
    p.add_argument("--budget", type=positive, default=2000, help="most schedules per scenario")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="pct: seed of the priority schedules")
    p.add_argument(
        "--time-budget", type=positive, default=None, metavar="S", help="stop exploring after S seconds in all"
    )
    p.add_argument("--mutant", help="apply this catalogued mutant (testing/mutant_catalogue.py) while exploring")
    p.add_argument("--replay", metavar="TOKEN", help="re-run the one schedule a failure printed, and report it")
    p.add_argument(
        "--ci", action="store_true", help=f"the CI bound: --bound {EXPLORE_CI_BOUND}, every scenario exhausted"
    )
    p.add_argument("--keep-going", action="store_true", help="do not stop a scenario at its first failure")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_explore)


def _cmd_explore(args: argparse.Namespace) -> int:
    import json
    import time

    from omni_prefix_cache.testing.explore.runner import explore, replay

    if args.mutant is not None:
        from omni_prefix_cache.testing.mutant_catalogue import CANDIDATES, MUTANTS

        if args.mutant not in MUTANTS and args.mutant not in CANDIDATES:
            print(
                f"explore: unknown mutant {args.mutant!r}; known: {', '.join(sorted(MUTANTS | CANDIDATES))}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.replay is not None:
        try:
            sched, diverged = replay(args.replay)
        except (ValueError, KeyError) as exc:
            print(f"explore: {exc}", file=sys.stderr)
            return EXIT_USAGE
        failure = sched.failure
        if args.json:
            out = {
                "token": args.replay,
                "diverged_at": diverged,
                "sync_points": sched.steps,
                "failure": None if failure is None else {"message": failure.message, "reason": failure.reason},
            }
            print(json.dumps(out, indent=2))
        else:
            print(f"replay {args.replay}: {sched.steps} sync points, {len(sched.decisions)} choice points")
            if diverged:
                print(f"  the run diverged from the token at choice points {diverged} (not the same code or inputs?)")
            if failure is None:
                print("  no failure: found: 0")
            else:
                print(f"  {failure.message.splitlines()[0][:300]}\n  counts as: {failure.reason}")
                print("  " + failure.details.rstrip().replace("\n", "\n  ") if failure.details else "", end="")
                print(f"\n  last sync points:\n{sched.trace()}\n  found: 1")
        return EXIT_OK if failure is None else EXIT_FAILED
    bound, budget = (EXPLORE_CI_BOUND, 10**6) if args.ci else (args.bound, args.budget)
    reports = []
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    try:
        for name in args.scenario or EXPLORE_SCENARIOS:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            report = explore(
                name,
                strategy=args.strategy,
                bound=bound,
                budget=budget,
                seed=args.seed,
                mutant=args.mutant,
                stop_at_first=not args.keep_going,
                time_budget_s=left,
            )
            reports.append(report)
            if not args.json:
                print(report.line(), flush=True)
                for found in report.found:
                    print(found.describe(), flush=True)
            if args.mutant is not None and report.found:
                break  # a mutant is killed once: the other scenarios add nothing
    except Exception as exc:  # the explorer itself broke: not a finding
        print(f"explore: stopped with {exc!r}", file=sys.stderr)
        return EXIT_ERROR
    total = sum(len(r.found) for r in reports)
    if args.json:
        print(
            json.dumps({"mutant": args.mutant, "found": total, "scenarios": [r.as_dict() for r in reports]}, indent=2)
        )
    else:
        print(f"found: {total}")
    return EXIT_FAILED if total else EXIT_OK


# ------------------------------------------------------------------ main


class _VersionAction(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata costs ~20 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        import omni_prefix_cache

        print(f"{parser.prog} {omni_prefix_cache.__version__}")
        parser.exit()


COMMANDS = ("diagrams", "simulate", "bench", "check", "explore")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``command``, the other subcommands' costly parts are left out."""
    parser = argparse.ArgumentParser(
        prog="omni-prefix-cache",
        description=_describe(" ".join((__doc__ or "").split())),
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    _add_diagrams_parser(sub)
    _add_simulate_parser(sub)
    _add_bench_parser(sub)
    _add_check_parser(sub, full=command in (None, "check"))
    _add_explore_parser(sub)
    return parser


def _command_in(argv: Sequence[str]) -> str:
    """The subcommand named in ``argv`` ("" when none: top-level help or version)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate(args)  # checks across flags; exits like argparse (status 2) on a bad combination
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"\n{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): say nothing more, and keep Python's
        # exit-time flush of stdout from raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
