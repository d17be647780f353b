"""Data-path figures: bytes and copy time off the device, pool writes,
engine-thread waits, and what became of each prefetched hit.

Every family has one label; its series are created on first use, so a
label value the runtime starts using later needs no declaration here.
Times are seconds. The recording sites choose the clock: the CPU copy and
pool-write times are the copying thread's CPU time (``time.thread_time_ns``,
so a preempted thread is not charged for the wait), CUDA copies are timed
with events, and waits are monotonic wall time.

Recording takes no lock: the series are ``histogram.Counter`` and
``histogram.Histogram`` (per-thread rows), and a series is found by one
dict lookup; the lock here is taken only to create a series, the first time
its label is used. ``copied`` and ``pool_written`` find their byte counter
and their histogram by one lookup.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from omni_prefix_cache.telemetry.histogram import Counter, Histogram, HistogramSummary


@dataclass(frozen=True)
class Family:
    """One exported family: its name (without the namespace), kind, label and help."""

    name: str
    kind: str  # "counter" or "histogram"
    label: str
    help: str


FAMILIES: tuple[Family, ...] = (
    Family("d2h_bytes_total", "counter", "kind", "Bytes copied device to host, by copy kind (step, flush)"),
    Family("d2h_seconds", "histogram", "kind", "Duration of one device-to-host copy, by kind (a step's, a flush's)"),
    Family("device_copy_seconds", "histogram", "lane", "Duration of one CUDA copy on a lane, timed by CUDA events"),
    Family("pool_write_bytes_total", "counter", "thread", "Bytes written into the CPU pool, by writing thread"),
    Family("pool_write_seconds", "histogram", "thread", "Duration of one pool write (a batch of rows), by thread"),
    Family(
        "wait_seconds",
        "histogram",
        "wait",
        "Time blocked on the state lock, the save barrier, a staging page claim, a late prefetch",
    ),
    Family("prefetch_hits_total", "counter", "outcome", "Prefetched hits by outcome: used, dropped, late"),
)
_BY_NAME = {f.name: f for f in FAMILIES}
_S = TypeVar("_S", Counter, Histogram)


class DataPath:
    """The data-path families of one recording. Any thread; recording takes
    no lock (the first use of a label takes one to create its series)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, str], Counter] = {}
        self._histograms: dict[tuple[str, str], Histogram] = {}
        # (bytes family, label) -> that counter and its seconds histogram.
        self._pairs: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        # CUDA copies to resolve: a deque's append and popleft are atomic.
        self._pending_device: deque[tuple[str, Any, Any]] = deque()
        self._lock = threading.Lock()

    def add(self, family: str, label: str, amount: float = 1) -> None:
        """Add ``amount`` (>= 0) to the counter family ``family`` at
        ``label``. Any thread, no lock; raises KeyError for a family not
        declared as a counter in ``FAMILIES``."""
        counter = self._counters.get((family, label))
        if counter is None:
            counter = self._series(self._counters, Counter, family, label, "counter")
        counter.add(amount)

    def observe(self, family: str, label: str, seconds: float) -> None:
        """Observe ``seconds`` in the histogram family ``family`` at
        ``label``. Any thread, no lock; raises KeyError for a family not
        declared as a histogram in ``FAMILIES``."""
        hist = self._histograms.get((family, label))
        if hist is None:
            hist = self._series(self._histograms, Histogram, family, label, "histogram")
        hist.observe(seconds)

    def _series(
        self, table: dict[tuple[str, str], _S], factory: Callable[[], _S], family: str, label: str, kind: str
    ) -> _S:
        spec = _BY_NAME.get(family)
        if spec is None or spec.kind != kind:
            raise KeyError(f"telemetry: no {kind} family {family!r} (declared: {sorted(_BY_NAME)})")
        with self._lock:
            return table.setdefault((family, label), factory())

    def _pair(self, counter: str, histogram: str, label: str) -> tuple[Counter, Histogram]:
        pair = (
            self._series(self._counters, Counter, counter, label, "counter"),
            self._series(self._histograms, Histogram, histogram, label, "histogram"),
        )
        with self._lock:
            return self._pairs.setdefault((counter, label), pair)

    def copied(self, kind: str, nbytes: int, start_ns: int, end_ns: int) -> None:
        """One device-to-host copy of ``nbytes`` timed ``start_ns``..``end_ns``:
        ``d2h_bytes_total`` and ``d2h_seconds`` at ``kind``. Any thread, no lock."""
        pair = self._pairs.get(("d2h_bytes_total", kind)) or self._pair("d2h_bytes_total", "d2h_seconds", kind)
        pair[0].add(nbytes)
        pair[1].observe((end_ns - start_ns) / 1e9)

    def pool_written(self, thread: str, nbytes: int, start_ns: int, end_ns: int) -> None:
        """One pool write of ``nbytes`` by ``thread`` timed ``start_ns``..``end_ns``:
        ``pool_write_bytes_total`` and ``pool_write_seconds``. Any thread, no lock."""
        pair = self._pairs.get(("pool_write_bytes_total", thread)) or self._pair(
            "pool_write_bytes_total", "pool_write_seconds", thread
        )
        pair[0].add(nbytes)
        pair[1].observe((end_ns - start_ns) / 1e9)

    def waited(self, wait: str, start_ns: int, end_ns: int) -> None:
        """A wait ``start_ns``..``end_ns`` in ``wait_seconds`` at ``wait``. Any thread, no lock."""
        hist = self._histograms.get(("wait_seconds", wait))
        if hist is None:
            hist = self._series(self._histograms, Histogram, "wait_seconds", wait, "histogram")
        hist.observe((end_ns - start_ns) / 1e9)

    def device_copy(self, lane: str, start: Any, end: Any) -> None:
        """A CUDA copy bracketed by two timing events on its lane; resolved
        into ``device_copy_seconds`` by a later read once ``end`` completed
        (a read never waits a device). Any thread, no lock."""
        self._pending_device.append((lane, start, end))

    def _resolve_device(self) -> None:
        # Only the copies pending now: one appended meanwhile waits for the
        # next read, and one not complete yet goes back for it.
        pending = self._pending_device
        for _ in range(len(pending)):
            try:
                lane, start, end = pending.popleft()
            except IndexError:  # a concurrent read took it
                return
            if end.query():
                self.observe("device_copy_seconds", lane, start.elapsed_time(end) / 1e3)  # ms
            else:
                pending.append((lane, start, end))

    def counters(self) -> dict[str, dict[str, float]]:
        """Value per family and label. Any thread."""
        out: dict[str, dict[str, float]] = {}
        for (family, label), counter in sorted(list(self._counters.items())):
            out.setdefault(family, {})[label] = counter.value
        return out

    def histograms(self) -> dict[str, dict[str, HistogramSummary]]:
        """Summary per family and label (CUDA copies complete by now
        resolved first). Any thread."""
        self._resolve_device()
        out: dict[str, dict[str, HistogramSummary]] = {}
        for (family, label), hist in sorted(list(self._histograms.items())):
            out.setdefault(family, {})[label] = hist.summary()
        return out
