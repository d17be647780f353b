"""Reading a trace file (docs/trace.md): one JSON object per line.

A killed process leaves a file whose last line may be torn: it is reported
(``TraceFile.torn``) and left out; any other line that does not parse is an
error naming its line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TraceFormatError(ValueError):
    """The file is not a trace (naming the line)."""


@dataclass
class TraceFile:
    """The records of one trace, in file order (the header apart)."""

    path: str
    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    torn: bool = False  # the last line was cut (a killed process)
    closed: bool = False  # the trace ends with its close record


def parse_lines(lines: list[str], path: str = "<trace>") -> TraceFile:
    """The trace in ``lines`` (raises TraceFormatError)."""
    if not lines or not lines[0].strip():
        raise TraceFormatError(f"{path}: empty file, no trace header")
    try:
        header = json.loads(lines[0])
    except ValueError as exc:
        raise TraceFormatError(f"{path}:1: the header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("k") != "trace":
        raise TraceFormatError(f"{path}:1: not a trace header (expected a record with k='trace')")
    out = TraceFile(path, header)
    last = len(lines) - 1
    loads = json.loads
    records = out.records
    for n, line in enumerate(lines[1:], start=1):
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except ValueError as exc:
            if n == last:
                out.torn = True
                break
            raise TraceFormatError(f"{path}:{n + 1}: not JSON ({exc})") from None
        if not isinstance(rec, dict) or "k" not in rec:
            raise TraceFormatError(f"{path}:{n + 1}: a record needs a kind 'k'")
        records.append(rec)
    out.closed = bool(records) and records[-1]["k"] == "close"
    return out


def read_trace(path: str | Path) -> TraceFile:
    """The trace at ``path`` (raises OSError, TraceFormatError)."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline; without one the last line may be torn (parse_lines tells)
    return parse_lines(lines, str(path))


def write_lines(path: str | Path, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Write a trace (a test's hand-edited one)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for rec in records:
            f.write(json.dumps(rec) + "\n")
