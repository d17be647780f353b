"""``omni-prefix-cache check``: the bounded exhaustive check of the
composition spec (the model checker: ``testing.modelcheck``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
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
    progress_enabled,
)

SUMMARY = "bounded exhaustive check of the composition spec (every reachable state, TLC-style)"
BOUND_HELP = {
    "requests": "requests",
    "tasks": "write tasks in all",
    "slots": "KV slots",
    "pages": "staging pages",
    "steps": "saved steps in all",
    "reads": "planned delayed reads at a time",
    "failures": "injected write failures",
    "keys": "pool keys per slot (hidden, then mm keys a step may leave out)",
}
BOUND_MIN = {"reads": 0, "failures": 0}
# The lifecycle model's world (Bounds.life): option name -> (LifeBounds field, help).
LIFE_HELP = {
    "positions": ("positions", "lifecycle: positions of the request"),
    "life-steps": ("steps", "lifecycle: engine steps in all"),
    "consumers": ("consumers", "lifecycle: consumers acknowledging on their own schedules"),
    "admissions": ("admissions", "lifecycle: admissions of the request id (a second one reuses it)"),
    "generations": ("generations", "lifecycle: content generations per admission (REPLACED)"),
    "preemptions": ("preemptions", "lifecycle: preemptions (each followed by RESUMED)"),
    "stale": ("stale", "lifecycle: late events of an older owner"),
    "hostile": ("hostile", "lifecycle: hostile delivery calls (an edited output or view, a view used twice)"),
}
LIFE_MIN = {"preemptions": 0, "stale": 0, "hostile": 0}


def add_parser(sub: Any, *, full: bool = True) -> None:
    """Declare ``check`` on the subparsers ``sub``; with ``full=False`` only
    its name and summary (the options need the model checker's import)."""
    if not full:
        # Another command was asked for: the bounds and variants live in the
        # model checker, whose import costs seconds (it loads the specs).
        sub.add_parser("check", help=SUMMARY)
        return
    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, BROKEN, CI_BOUNDS

    p = sub.add_parser(
        "check",
        help=SUMMARY,
        description=describe(
            "Breadth-first over every reachable state of the composition spec (spec/protocol.yaml), in two "
            "worlds. The write path: each segment of an operation (save, escalate, committer claim/copy/write, "
            "fail, drain, materialize, discard, ...) is one atomic action over the component machines, "
            "interleaved with the other threads' segments. The request lifecycle: one request id's tenures "
            "(admission, preemption and resume with growing or shrinking hits, replacement, id reuse, late events "
            "of an older owner) and consumers viewing and acknowledging its outputs on their own schedules "
            "(new_step's events, save's record_saved, materialize, discard, delivery_view, ack_delivery, "
            "commit_output). Checks the protocol's model invariants and the machines' own in every state, and "
            "that every state can still settle; prints states explored, depth and time per world, or a shortest "
            "counterexample in operation-level steps.",
            "A bound left out takes the CI bound's value (the --big bound's with --big). A progress line "
            "(states expanded and found, depth, elapsed) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=HelpFormatter,
    )
    for name, text in BOUND_HELP.items():
        p.add_argument(
            f"--{name}",
            type=int_at_least(BOUND_MIN.get(name, 1)),
            default=None,
            help=f"{text} (CI bound {getattr(CI_BOUNDS, name)}, --big {getattr(BIG_BOUNDS, name)})",
        )
    for option, (name, text) in LIFE_HELP.items():
        p.add_argument(
            f"--{option}",
            dest=f"life_{name}",
            type=int_at_least(LIFE_MIN.get(name, 1)),
            default=None,
            help=f"{text} (CI bound {getattr(CI_BOUNDS.life, name)}, --big {getattr(BIG_BOUNDS.life, name)})",
        )
    p.add_argument(
        "--model",
        choices=("write", "lifecycle", "both"),
        default="both",
        help="which world to search: the write path, the request lifecycle, or both (one after the other)",
    )
    p.add_argument(
        "--broken",
        type=broken_variant,
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
    p.set_defaults(func=run)


def broken_variant(text: str) -> str:
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
        "worlds": [dataclasses.asdict(part) for part in result.parts],
        "violation": None
        if violation is None
        else {"name": violation.name, "message": violation.message, "world": result.model},
        "trace": list(result.trace),
        "final_state": list(result.final_state),
    }


def run(args: argparse.Namespace) -> int:
    """Check the composition within the bounds asked for; print the result; the exit status."""
    import dataclasses
    import json

    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, CI_BOUNDS, check
    from omni_prefix_cache.tools.progress import StepProgress

    base = BIG_BOUNDS if args.big else CI_BOUNDS
    given = {name: getattr(args, name) for name in BOUND_HELP if getattr(args, name) is not None}
    life = {name: getattr(args, f"life_{name}") for name, _ in LIFE_HELP.values()}
    life = {k: v for k, v in life.items() if v is not None}
    bounds = dataclasses.replace(base, **given, life=dataclasses.replace(base.life, **life))
    models = ("write", "lifecycle") if args.model == "both" else (args.model,)
    line = StepProgress("expanded", enabled=progress_enabled(args))

    def progress(expanded: int, found: int, depth: int) -> None:
        line.update(expanded, None, f"states found {found}  depth {depth}")

    from omni_prefix_cache.specs.loader import SpecError

    try:
        result = check(bounds, args.broken, max_states=args.max_states, progress=progress, models=models)
    except SpecError as exc:
        line.close()
        print(f"check: the protocol does not load: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        line.close()
        print(f"check: {exc}", file=sys.stderr)
        return EXIT_ERROR
    line.close()
    if args.json:
        print(json.dumps(check_result_dict(result), indent=2))
        return EXIT_OK if result.ok else EXIT_FAILED
    print(result.report())
    # The host tier's own world (spec/host_tier.yaml): small, searched on the real HostTier.
    from omni_prefix_cache.testing.modelcheck.tier_check import check_tier

    tier = check_tier(max_depth=8 if args.big else 7)
    print(tier.report())
    return EXIT_OK if result.ok and tier.violation is None else EXIT_FAILED
