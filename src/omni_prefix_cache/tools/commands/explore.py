"""``omni-prefix-cache explore``: race the runtime's real threads under a
controlled scheduler (the explorer: ``testing.explore``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from omni_prefix_cache.tools.commands.common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    describe,
    int_at_least,
    positive,
)

SUMMARY = "race the runtime's real threads under a controlled scheduler"
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


def add_parser(sub: Any) -> None:
    """Declare ``explore`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "explore",
        help=SUMMARY,
        description=describe(
            "Runs the real manager, its committer thread and its prefetch threads on real threads, but one at a "
            "time: every lock acquire, condition or event wait, thread start or join and future result is a point "
            "where a scheduler picks the next thread. Per scenario it explores every schedule with at most "
            "--bound deviations from the default scheduler (or --strategy pct: random priority schedules), checks "
            "named invariants at every sync point and the row oracle, deadlocks and leaks after each schedule, "
            "and prints schedules explored, the bound, distinct states, elapsed time and found: N.",
            "Every failure prints a replay token; --replay TOKEN re-runs exactly that interleaving.",
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=EXPLORE_SCENARIOS,
        help="scenario to explore (repeatable; default: all)",
    )
    p.add_argument("--strategy", choices=("dfs", "pct"), default="dfs", help="bounded-exhaustive or PCT")
    p.add_argument("--bound", type=int_at_least(0), default=2, help="deviation (preemption) bound; pct: its depth")
    p.add_argument("--budget", type=positive, default=2000, help="most schedules per scenario")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="pct: seed of the priority schedules")
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Explore the chosen scenarios (or replay one token); the exit status."""
    import json
    import time

    from omni_prefix_cache.testing.explore.runner import explore

    if args.mutant is not None:
        from omni_prefix_cache.testing.mutant_catalogue import CANDIDATES, MUTANTS

        if args.mutant not in MUTANTS and args.mutant not in CANDIDATES:
            print(
                f"explore: unknown mutant {args.mutant!r}; known: {', '.join(sorted(MUTANTS | CANDIDATES))}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.replay is not None:
        return run_replay(args.replay, as_json=args.json)
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


def run_replay(token: str, *, as_json: bool) -> int:
    """Re-run the one schedule ``token`` names and report it; the exit status."""
    import json

    from omni_prefix_cache.testing.explore.runner import replay

    try:
        sched, diverged = replay(token)
    except (ValueError, KeyError) as exc:
        print(f"explore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    failure = sched.failure
    if as_json:
        out = {
            "token": token,
            "diverged_at": diverged,
            "sync_points": sched.steps,
            "failure": None if failure is None else {"message": failure.message, "reason": failure.reason},
        }
        print(json.dumps(out, indent=2))
    else:
        print(f"replay {token}: {sched.steps} sync points, {len(sched.decisions)} choice points")
        if diverged:
            print(f"  the run diverged from the token at choice points {diverged} (not the same code or inputs?)")
        if failure is None:
            print("  no failure: found: 0")
        else:
            print(f"  {failure.message.splitlines()[0][:300]}\n  counts as: {failure.reason}")
            print("  " + failure.details.rstrip().replace("\n", "\n  ") if failure.details else "", end="")
            print(f"\n  last sync points:\n{sched.trace()}\n  found: 1")
    return EXIT_OK if failure is None else EXIT_FAILED
