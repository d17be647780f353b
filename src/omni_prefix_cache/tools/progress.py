"""A self-overwriting progress line for the command line tools (stderr, TTY only)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    minutes, s = divmod(seconds, 60)
    return f"{minutes}:{s:02d}"


class StepProgress:
    """``[#####   ]  42% step 126/300  elapsed 0:03  ETA 0:04  <detail>``.

    Enabled only when the stream is a TTY (or ``enabled`` says so), so piped
    and ``--json`` output never carries it. Redraws at most every ``every_s``.
    """

    def __init__(
        self,
        label: str = "step",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        every_s: float = 0.1,
    ) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.every_s = every_s
        self.started = time.monotonic()
        self._last = float("-inf")
        self._width = 0

    def line(self, done: int, total: int | None, detail: str = "", fraction: float | None = None) -> str:
        """The text drawn for ``done`` of ``total`` steps (``fraction`` overrides done/total for the ETA)."""
        elapsed = time.monotonic() - self.started
        if fraction is None and total:
            fraction = done / total
        parts = []
        if fraction is not None:
            fraction = min(1.0, max(0.0, fraction))
            parts.append(f"[{'#' * int(fraction * 24):<24}] {100 * fraction:3.0f}%")
        parts.append(f"{self.label} {done}" + (f"/{total}" if total else ""))
        parts.append(f"elapsed {_clock(elapsed)}")
        if fraction:
            parts.append(f"ETA {_clock(elapsed * (1 - fraction) / fraction)}")
        if detail:
            parts.append(detail)
        return "  ".join(parts)

    def update(self, done: int, total: int | None, detail: str = "", fraction: float | None = None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        text = self.line(done, total, detail, fraction)
        self._width = max(self._width, len(text))
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()

    def close(self) -> None:
        """Erase the line (the caller's own output follows)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
