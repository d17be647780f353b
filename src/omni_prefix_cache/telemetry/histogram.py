"""Fixed-bucket histograms and counters that a scrape can copy at any time.

Every data-path figure the runtime records is one of these (a machine's
move counts and time in state are ``moves.MoveRecorder``'s, stored the same
way). They are written by the thread that observes (engine, committer,
prefetch) and read by a scrape on another thread: each keeps one row per
observing thread (``shards.Shards``), so an observation takes no lock and a
read sums the rows. A read racing an observation may see its bucket count
without its sum for an instant; counts never go backwards from one read to
the next (``shards`` says why).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from omni_prefix_cache.telemetry.shards import Shards

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

    @classmethod
    def of(cls, bounds: Sequence[float], counts: Sequence[float], total: float) -> HistogramSummary:
        """The summary of per-bucket ``counts`` (one per bound, then the
        overflow bucket's) whose observations sum to ``total``."""
        cumulative, running = [], 0
        for bound, n in zip((*bounds, float("inf")), counts):
            running += int(n)
            cumulative.append((bound, running))
        return cls(count=running, sum=float(total), buckets=tuple(cumulative))


class Histogram:
    """Counts of observations per bucket (upper bounds ``bounds``, plus one
    overflow bucket) and their sum. Any thread; observing takes no lock.

    Stored as per-thread rows (``shards.Shards``): the buckets' counts, then
    the sum. ``summary`` merges them: a summary racing an ``observe`` may
    count the observation without its sum for an instant (Prometheus
    tolerates it); counts never go backwards from one summary to the next.
    """

    __slots__ = ("bounds", "_shards", "_local", "_sum_at")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {self.bounds}")
        self._sum_at = len(self.bounds) + 1
        self._shards = Shards(self._sum_at + 1)
        self._local = self._shards.local

    def observe(self, value: float) -> None:
        """Count ``value`` (>= 0) in its bucket and add it to the sum. Any
        thread, no lock (the thread's first observation registers its row)."""
        try:
            row = self._local.row
        except AttributeError:  # the thread's first observation
            row = self._shards.register()
        # An observation equal to a bound lands in that bound's bucket (le).
        row[bisect_left(self.bounds, value)] += 1
        row[self._sum_at] += value

    def summary(self) -> HistogramSummary:
        """Every thread's observations so far, merged. Any thread."""
        totals = self._shards.totals()
        return HistogramSummary.of(self.bounds, totals[: self._sum_at], totals[self._sum_at])


class Counter:
    """A monotonically growing number (an int or float amount). Any thread;
    adding takes no lock (per-thread rows, ``shards.Shards``)."""

    __slots__ = ("_shards", "_local")

    def __init__(self) -> None:
        self._shards = Shards(1)
        self._local = self._shards.local

    def add(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0). Any thread, no lock."""
        try:
            row = self._local.row
        except AttributeError:  # the thread's first amount
            row = self._shards.register()
        row[0] += amount

    @property
    def value(self) -> float:
        """The sum of every thread's amounts so far. Any thread; never less
        than an earlier read's."""
        return self._shards.totals()[0]
