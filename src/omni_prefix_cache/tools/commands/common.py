"""What every subcommand shares: exit statuses, the help formatter and the
argument parsers that turn a bad value into a usage error."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` on every option that has a real default (not on on/off flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # On/off flags say in their help which side is the default.
        if action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def describe(*paragraphs: str) -> str:
    """A subcommand description: prose paragraphs wrapped, then the exit statuses as written."""
    return "\n\n".join([*(textwrap.fill(p, width=88) for p in paragraphs), EXIT_STATUS_HELP])


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``, else a usage error saying so."""

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


def float_in(low: float, high: float | None, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a number in ``[low, high]`` (``(low, ...`` with
    ``low_open``; no upper bound when ``high`` is None); NaN is refused."""

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


positive = int_at_least(1)
non_negative = int_at_least(0)
probability = float_in(0.0, 1.0)


def progress_enabled(args: argparse.Namespace) -> bool | None:
    """None (TTY decides) unless --json or --quiet turn the progress line off."""
    return False if getattr(args, "json", False) or getattr(args, "quiet", False) else None
