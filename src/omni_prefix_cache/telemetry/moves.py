"""Spec-generated metrics of one compiled machine: moves counted by
(trigger, source, dest), and time spent in the states its spec tags
``waits``.

A ``MoveRecorder`` knows the machine only by names and numbers (the move
labels and the timed state numbers the compiled machine hands it), so a
state or move added to a spec gets its series with no code here. The
runtime module that applies a compiled move calls ``moved`` (or ``counted``
for a vectorised move of many rows, ``moved_batch`` for a batch of
instances) when the machine's ``recorder`` is set; with metrics off the
recorder is None and that check is all it costs.

Recording takes no lock: the counts and the time-in-state histograms are
one per-thread row (``shards.Shards``) per machine, so one ``moved`` is one
call that finds the thread's row once and adds into it. The open stays
(instance -> when it entered its timed state) are one dict shared by every
thread, since a stay may start on one thread and end on another; each
instance's moves are already serialized by its owner's lock, and a single
dict operation needs no lock of its own.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omni_prefix_cache.telemetry.histogram import SECONDS_BUCKETS, HistogramSummary
from omni_prefix_cache.telemetry.shards import Shards


class Recorder(Protocol):
    """What a compiled machine's ``recorder`` is: this module's
    ``MoveRecorder`` (metrics) or a ``telemetry.trace.TraceRecorder`` (a
    trace is open; it feeds the metrics recorder too). ``detail``: what the
    trace keeps beside the instance (a holder's page, a task's deferred
    wakes); ``group``: the rows of a vectorised move (key and slots).
    ``per_instance``: whether it needs each instance's moves one by one (a
    trace does); when False, moves that leave every stay as it is (a
    self-loop) may be reported as one ``counted`` of many."""

    per_instance: bool

    def moved(self, move: Any, key: object, detail: Any = None) -> None: ...

    def moved_batch(self, keys: Sequence[object], moves: Sequence[Any]) -> None: ...

    def counted(self, move: Any, n: int, group: Any = None) -> None: ...

    def forget(self, key: object) -> None: ...


class MoveRecorder:
    """Counts and time-in-state histograms of one machine. Any thread; no
    lock per move.

    ``labels[i]`` is (trigger, source, dest) of the machine's move ``i``;
    ``timed`` maps a timed state's number to its name. ``clock`` returns
    nanoseconds (monotonic: a write waits across threads, so time in state
    is wall time, not CPU time).

    A read (``move_counts``, ``state_summaries``) merges the threads' rows:
    one racing a move may see a stay's bucket count without its seconds for
    an instant (Prometheus tolerates it); counts never go backwards from one
    read to the next.
    """

    # Counts and stays only: self-loops may come as one ``counted`` of many.
    per_instance = False

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
        self.bounds = SECONDS_BUCKETS
        self._clock = clock
        # A row: one count per move, then per timed state its buckets'
        # counts (the overflow bucket last) and the seconds of its stays.
        self._sum_offset = len(self.bounds) + 1
        per_state = self._sum_offset + 1
        names = list(dict.fromkeys(self.timed.values()))
        self._state_at = {name: len(self.labels) + k * per_state for k, name in enumerate(names)}
        self._shards = Shards(len(self.labels) + len(names) * per_state)
        self._local = self._shards.local
        # Per move: None when it neither ends nor starts a stay (untimed
        # states, or a self-loop, which keeps the stay), else (where the
        # source's histogram starts in a row, -1 if untimed; dest timed).
        self._timing: tuple[tuple[int, bool] | None, ...] = tuple(
            None
            if source == dest or (source not in self._state_at and dest not in self._state_at)
            else (self._state_at.get(source, -1), dest in self._state_at)
            for _, source, dest in self.labels
        )
        self._entered: dict[object, int] = {}

    def moved(self, move: Any, key: object, detail: Any = None) -> None:
        """``move`` (a ``CompiledMove``) was applied to the instance ``key``.
        Counts it; ends the instance's timed stay in the move's source (a
        self-loop keeps it) and starts one in its dest, reading the clock
        once (``detail``: for a trace only). Any thread, no lock."""
        try:
            row = self._local.row
        except AttributeError:  # the thread's first move here
            row = self._shards.register()
        i = move.index
        row[i] += 1
        timing = self._timing[i]
        if timing is None:
            return
        ends, starts = timing
        now = self._clock()
        if ends >= 0:
            start = self._entered.pop(key, None)
            if start is not None:
                seconds = (now - start) / 1e9
                row[ends + bisect_left(self.bounds, seconds)] += 1
                row[ends + self._sum_offset] += seconds
        if starts:
            self._entered[key] = now

    def moved_batch(self, keys: Sequence[object], moves: Sequence[Any]) -> None:
        """``moved`` for each (key, move) pair, applied together: the clock
        is read once for the batch, at its first timed move. A None move
        (the item had no such move, so nothing moved) is skipped. Any
        thread, no lock."""
        try:
            row = self._local.row
        except AttributeError:  # the thread's first move here
            row = self._shards.register()
        timings, entered, bounds, sum_offset = self._timing, self._entered, self.bounds, self._sum_offset
        now: int | None = None
        for key, move in zip(keys, moves):
            if move is None:
                continue
            i = move.index
            row[i] += 1
            timing = timings[i]
            if timing is None:
                continue
            if now is None:
                now = self._clock()
            ends, starts = timing
            if ends >= 0:
                start = entered.pop(key, None)
                if start is not None:
                    seconds = (now - start) / 1e9
                    row[ends + bisect_left(bounds, seconds)] += 1
                    row[ends + sum_offset] += seconds
            if starts:
                entered[key] = now

    def counted(self, move: Any, n: int, group: Any = None) -> None:
        """``move`` was applied to ``n`` instances at once (an array machine,
        ``group`` its rows: for a trace only); counted only (see
        ``docs/stats.md`` on untimed array states). Any thread, no lock."""
        try:
            row = self._local.row
        except AttributeError:  # the thread's first move here
            row = self._shards.register()
        row[move.index] += n

    def forget(self, key: object) -> None:
        """Drop ``key``'s open stay (an instance discarded without a move)."""
        self._entered.pop(key, None)

    def move_counts(self) -> dict[tuple[str, str, str], int]:
        """Count per (trigger, source, dest); moves never applied count 0.
        Any thread."""
        counts = self._shards.totals()
        out: dict[tuple[str, str, str], int] = {}
        for label, n in zip(self.labels, counts):
            out[label] = out.get(label, 0) + int(n)
        return out

    def state_summaries(self) -> dict[str, HistogramSummary]:
        """Time-in-state histogram per timed state name. Any thread."""
        totals = self._shards.totals()
        return {
            name: HistogramSummary.of(self.bounds, totals[at : at + self._sum_offset], totals[at + self._sum_offset])
            for name, at in self._state_at.items()
        }

    @property
    def open_stays(self) -> int:
        """Instances in a timed state now (entered while recording)."""
        return len(self._entered)
