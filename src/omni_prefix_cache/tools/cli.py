"""omni-prefix-cache command line: render the spec diagrams, run the verified serving simulation,
benchmark the engine-facing calls, model-check the composed write pipeline, and validate a recorded trace."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from omni_prefix_cache.tools.commands import bench, check, diagrams, explore, simulate, validate
from omni_prefix_cache.tools.commands.bench import BENCH_SCENARIOS
from omni_prefix_cache.tools.commands.check import check_result_dict
from omni_prefix_cache.tools.commands.common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NOTHING_CHECKED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    EXIT_USAGE,
    HelpFormatter,
    describe,
)
from omni_prefix_cache.tools.commands.explore import EXPLORE_CI_BOUND, EXPLORE_SCENARIOS

__all__ = [
    "BENCH_SCENARIOS",
    "COMMANDS",
    "EXIT_ERROR",
    "EXIT_FAILED",
    "EXIT_NOTHING_CHECKED",
    "EXIT_OK",
    "EXIT_STATUS_HELP",
    "EXIT_USAGE",
    "EXPLORE_CI_BOUND",
    "EXPLORE_SCENARIOS",
    "build_parser",
    "check_result_dict",
    "main",
]


class _VersionAction(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata costs ~20 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        import omni_prefix_cache

        print(f"{parser.prog} {omni_prefix_cache.__version__}")
        parser.exit()


COMMANDS = ("diagrams", "simulate", "bench", "check", "explore", "validate")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``command``, the other subcommands' costly parts are left out."""
    parser = argparse.ArgumentParser(
        prog="omni-prefix-cache",
        description=describe(" ".join((__doc__ or "").split())),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    diagrams.add_parser(sub)
    simulate.add_parser(sub)
    bench.add_parser(sub)
    check.add_parser(sub, full=command in (None, "check"))
    explore.add_parser(sub)
    validate.add_parser(sub)
    return parser


def _command_in(argv: Sequence[str]) -> str:
    """The subcommand named in ``argv`` ("" when none: top-level help or version)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand; its exit
    status (``commands.common``). A usage error exits with status 2."""
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
