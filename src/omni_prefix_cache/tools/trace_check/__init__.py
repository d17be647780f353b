"""Trace validation (docs/trace.md): read a trace the runtime recorded
(``telemetry.trace``) and replay it against the specs."""

from omni_prefix_cache.tools.trace_check.reader import TraceFile, TraceFormatError, parse_lines, read_trace
from omni_prefix_cache.tools.trace_check.replay import Replay, Result
from omni_prefix_cache.tools.trace_check.rules import Violation


def validate_trace(trace: TraceFile) -> Result:
    """Replay ``trace`` against the shipped specs."""
    return Replay().run(trace)


__all__ = [
    "Replay",
    "Result",
    "TraceFile",
    "TraceFormatError",
    "Violation",
    "parse_lines",
    "read_trace",
    "validate_trace",
]
