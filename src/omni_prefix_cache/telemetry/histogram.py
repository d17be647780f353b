"""Fixed-bucket histograms and counters that a scrape can copy at any time.

Every figure the runtime records is one of these. They are written by the
thread that observes (engine, committer, prefetch) and read by a scrape on
another thread, so each holds a plain ``threading.Lock`` for the few
arithmetic operations of one observation or one copy. That lock is taken
directly from ``threading`` (not the ``device.sync`` seam): it never spans a
wait on another thread, so it is not a synchronization point the
interleaving explorer needs to see.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# Seconds: 1 us to 10 s, roughly three per decade (Prometheus' defaults start
# at 5 ms, too coarse for a lock wait or one step's copy).
SECONDS_BUCKETS: tuple[float, ...] = (
    1e-6, 2.5e-6, 1e-5, 2.5e-5, 1e-4, 2.5e-4, 1e-3, 2.5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0, 2.5, 10.0,
)  # fmt: skip


@dataclass(frozen=True)
class HistogramSummary:
    """A copy of one histogram: ``buckets`` are (upper bound, cumulative count)
    pairs ending with ``inf``, as Prometheus exports them."""

    count: int
    sum: float
    buckets: tuple[tuple[float, int], ...]

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile estimated as Prometheus' ``histogram_quantile``
        does (linear inside the bucket, the last finite bound for the
        overflow bucket); None when empty."""
        if self.count == 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower

    def as_dict(self) -> dict[str, float | int | None]:
        """count, sum, p50 and p99 (the snapshot's summary form)."""
        return {"count": self.count, "sum": self.sum, "p50": self.quantile(0.5), "p99": self.quantile(0.99)}


class Histogram:
    """Counts of observations per bucket (upper bounds ``bounds``, plus one
    overflow bucket) and their sum. Any thread."""

    __slots__ = ("bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {self.bounds}")
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        # An observation equal to a bound lands in that bound's bucket (le).
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def summary(self) -> HistogramSummary:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            running += n
            cumulative.append((bound, running))
        return HistogramSummary(count=running, sum=total, buckets=tuple(cumulative))


class Counter:
    """A monotonically growing number (an int or float amount). Any thread."""

    __slots__ = ("_value", "_lock")

    def __init__(self) -> None:
        self._value: float = 0
        self._lock = threading.Lock()

    def add(self, amount: float = 1) -> None:
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        return self._value
