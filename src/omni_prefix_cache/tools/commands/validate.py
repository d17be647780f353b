"""``omni-prefix-cache validate TRACE``: replay a recorded trace (docs/trace.md)
against the specs and report the first rule it breaks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from omni_prefix_cache.tools.commands.common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NOTHING_CHECKED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    describe,
)


def add_parser(sub: Any) -> None:
    """Declare ``validate`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "validate",
        help="replay a recorded trace against the specs (docs/trace.md)",
        description=describe(
            "Replays a trace recorded with PrefixCacheConfig.trace_path or OMNI_PREFIX_CACHE_TRACE=FILE "
            "against the compiled machines of spec/ and the composition spec/protocol.yaml: every move legal "
            "from the replayed state, every operation's segments in spec order under their locks, the ordering "
            "rules, and the system invariants a trace can judge. The first violation prints the records around "
            "it, the rule broken and the shortest excerpt that shows it.",
            "A trace that lost records (its ring overflowed) is validated up to the loss and exits with the "
            "error status; a torn last line (a killed process) is skipped and reported.",
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("trace", type=Path, metavar="TRACE", help="the trace file (JSON lines)")
    p.add_argument("--json", action="store_true", help="print the machine-readable result")
    p.set_defaults(func=run)


def validate_file(path: Path, *, json_out: bool = False, out: Any = None) -> int:
    """Validate the trace at ``path``, print the result; the exit status."""
    import json

    from omni_prefix_cache.tools.trace_check import TraceFormatError, read_trace, validate_trace
    from omni_prefix_cache.tools.trace_check.report import format_violation, summary

    out = out or sys.stdout
    try:
        trace = read_trace(path)
    except OSError as exc:
        print(f"validate: cannot read {path}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TraceFormatError as exc:
        print(f"validate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    res = validate_trace(trace)
    if json_out:
        print(json.dumps(summary(trace, res), indent=2), file=out)
    elif res.violation is not None:
        print(format_violation(trace, res.violation), file=out)
    else:
        notes = []
        if res.torn:
            notes.append("its torn last line skipped")
        if not res.closed:
            notes.append("no close record: the process did not shut the trace down")
        print(
            f"{path}: {res.records} records, {res.moves} moves, {res.rows} row moves, {res.segments} segments "
            f"replayed in {res.seconds:.2f}s" + (f" ({'; '.join(notes)})" if notes else ""),
            file=out,
        )
        print(f"  judged: {', '.join(res.judged)}", file=out)
        print(f"  not judged from a trace: {', '.join(res.not_judged)}", file=out)
        if res.lost_at is not None:
            print(f"  INCOMPLETE: records were lost at record {res.lost_at + 1} (the ring was full)", file=out)
        else:
            print("result: OK" if res.moves else "result: nothing checked (no move recorded)", file=out)
    if res.violation is not None:
        return EXIT_FAILED
    if res.lost_at is not None:
        return EXIT_ERROR
    return EXIT_OK if res.moves else EXIT_NOTHING_CHECKED


def run(args: argparse.Namespace) -> int:
    return validate_file(args.trace, json_out=args.json)
