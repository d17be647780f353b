"""Spec-generated metrics of one compiled machine: moves counted by
(trigger, source, dest), and time spent in the states its spec tags
``waits``.

A ``MoveRecorder`` knows the machine only by names and numbers (the move
labels and the timed state numbers the compiled machine hands it), so a
state or move added to a spec gets its series with no code here. The
runtime module that applies a compiled move calls ``moved`` (or ``counted``
for a vectorised move of many rows) when the machine's ``recorder`` is set;
with metrics off the recorder is None and that check is all it costs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omni_prefix_cache.telemetry.histogram import Histogram, HistogramSummary


class Recorder(Protocol):
    """What a compiled machine's ``recorder`` is: this module's
    ``MoveRecorder`` (metrics) or a ``telemetry.trace.TraceRecorder`` (a
    trace is open; it feeds the metrics recorder too). ``detail``: what the
    trace keeps beside the instance (a holder's page, a task's deferred
    wakes); ``group``: the rows of a vectorised move (key and slots)."""

    def moved(self, move: Any, key: object, detail: Any = None) -> None: ...

    def moved_batch(self, keys: Sequence[object], moves: Sequence[Any]) -> None: ...

    def counted(self, move: Any, n: int, group: Any = None) -> None: ...

    def forget(self, key: object) -> None: ...


class MoveRecorder:
    """Counts and time-in-state histograms of one machine. Any thread.

    ``labels[i]`` is (trigger, source, dest) of the machine's move ``i``;
    ``timed`` maps a timed state's number to its name. ``clock`` returns
    nanoseconds (monotonic: a write waits across threads, so time in state
    is wall time, not CPU time).
    """

    def __init__(
        self,
        machine: str,
        labels: Sequence[tuple[str, str, str]],
        timed: dict[int, str],
        clock: Callable[[], int],
    ) -> None:
        self.machine = machine
        self.labels = tuple(labels)
        self.timed = dict(timed)
        self._clock = clock
        self._counts = [0] * len(self.labels)
        self._entered: dict[object, int] = {}
        self.time_in_state = {name: Histogram() for name in self.timed.values()}
        self._by_state = {state: self.time_in_state[name] for state, name in self.timed.items()}
        self._lock = threading.Lock()

    def moved(self, move: Any, key: object, detail: Any = None) -> None:
        """``move`` (a ``CompiledMove``) was applied to the instance ``key``.
        Ends the instance's timed stay in the move's source (a self-loop
        keeps it) and starts one in its dest (``detail``: for a trace only)."""
        source, dest = int(move.source), int(move.dest)
        timed = self._by_state
        if (source in timed or dest in timed) and source != dest:
            now = self._clock()
            with self._lock:
                self._counts[move.index] += 1
                start = self._entered.pop(key, None) if source in timed else None
                if dest in timed:
                    self._entered[key] = now
            if start is not None:
                timed[source].observe((now - start) / 1e9)
            return
        with self._lock:
            self._counts[move.index] += 1

    def moved_batch(self, keys: Sequence[object], moves: Sequence[Any]) -> None:
        """``moved`` for each (key, move) pair; a None move (the item had
        no such move, so nothing moved) is skipped."""
        for key, move in zip(keys, moves):
            if move is not None:
                self.moved(move, key)

    def counted(self, move: Any, n: int, group: Any = None) -> None:
        """``move`` was applied to ``n`` instances at once (an array machine,
        ``group`` its rows: for a trace only); counted only (see ``docs/stats.md`` on untimed array states)."""
        with self._lock:
            self._counts[move.index] += n

    def forget(self, key: object) -> None:
        """Drop ``key``'s open stay (an instance discarded without a move)."""
        self._entered.pop(key, None)

    def move_counts(self) -> dict[tuple[str, str, str], int]:
        """Count per (trigger, source, dest); moves never applied count 0."""
        with self._lock:
            counts = list(self._counts)
        out: dict[tuple[str, str, str], int] = {}
        for label, n in zip(self.labels, counts):
            out[label] = out.get(label, 0) + n
        return out

    def state_summaries(self) -> dict[str, HistogramSummary]:
        return {name: hist.summary() for name, hist in self.time_in_state.items()}

    @property
    def open_stays(self) -> int:
        """Instances in a timed state now (entered while recording)."""
        return len(self._entered)
