"""Data-path figures: bytes and copy time off the device, pool writes,
engine-thread waits, and what became of each prefetched hit.

Every family has one label; its series are created on first use, so a
label value the runtime starts using later needs no declaration here.
Times are seconds. The recording sites choose the clock: the CPU copy and
pool-write times are the copying thread's CPU time (``time.thread_time_ns``,
so a preempted thread is not charged for the wait), CUDA copies are timed
with events, and waits are monotonic wall time.
"""

from __future__ import annotations

import threading
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
    """The data-path families of one recording. Any thread."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, str], Counter] = {}
        self._histograms: dict[tuple[str, str], Histogram] = {}
        self._pending_device: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()

    def add(self, family: str, label: str, amount: float = 1) -> None:
        """Add ``amount`` to the counter family ``family`` at ``label``."""
        counter = self._counters.get((family, label))
        if counter is None:
            counter = self._series(self._counters, Counter, family, label, "counter")
        counter.add(amount)

    def observe(self, family: str, label: str, seconds: float) -> None:
        """Observe ``seconds`` in the histogram family ``family`` at ``label``."""
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

    def copied(self, kind: str, nbytes: int, start_ns: int, end_ns: int) -> None:
        """One device-to-host copy of ``nbytes`` timed ``start_ns``..``end_ns``."""
        self.add("d2h_bytes_total", kind, nbytes)
        self.observe("d2h_seconds", kind, (end_ns - start_ns) / 1e9)

    def pool_written(self, thread: str, nbytes: int, start_ns: int, end_ns: int) -> None:
        self.add("pool_write_bytes_total", thread, nbytes)
        self.observe("pool_write_seconds", thread, (end_ns - start_ns) / 1e9)

    def waited(self, wait: str, start_ns: int, end_ns: int) -> None:
        self.observe("wait_seconds", wait, (end_ns - start_ns) / 1e9)

    def device_copy(self, lane: str, start: Any, end: Any) -> None:
        """A CUDA copy bracketed by two timing events on its lane; resolved
        into ``device_copy_seconds`` by a later read once ``end`` completed
        (a read never waits a device)."""
        with self._lock:
            self._pending_device.append((lane, start, end))

    def _resolve_device(self) -> None:
        with self._lock:
            pending, self._pending_device = self._pending_device, []
        left = []
        for lane, start, end in pending:
            if end.query():
                self.observe("device_copy_seconds", lane, start.elapsed_time(end) / 1e3)  # ms
            else:
                left.append((lane, start, end))
        with self._lock:
            self._pending_device[:0] = left

    def counters(self) -> dict[str, dict[str, float]]:
        """Value per family and label."""
        out: dict[str, dict[str, float]] = {}
        for (family, label), counter in sorted(self._counters.items()):
            out.setdefault(family, {})[label] = counter.value
        return out

    def histograms(self) -> dict[str, dict[str, HistogramSummary]]:
        self._resolve_device()
        out: dict[str, dict[str, HistogramSummary]] = {}
        for (family, label), hist in sorted(self._histograms.items()):
            out.setdefault(family, {})[label] = hist.summary()
        return out
