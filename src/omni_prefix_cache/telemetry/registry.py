"""The process's telemetry: the switch, the clock, every compiled machine's
recorder, and the data-path families.

Compiled machines are process singletons (each runtime module compiles its
spec once at import), so their recorders are too: ``TELEMETRY`` is one per
process, as Prometheus' default registry is. A manager built with its
config's ``metrics`` on turns them on here (one serving process runs one
stage; several managers in one process share the series).

With metrics off every machine's ``recorder`` and ``TELEMETRY.datapath`` are
None; each recording site checks that one attribute and does nothing else.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from omni_prefix_cache.telemetry.datapath import DataPath
from omni_prefix_cache.telemetry.histogram import HistogramSummary
from omni_prefix_cache.telemetry.moves import MoveRecorder, Recorder
from omni_prefix_cache.telemetry.trace import Trace, TraceRecorder


class RecordedMachine(Protocol):
    """What the registry needs of a compiled machine (``specs.compiled``)."""

    recorder: Recorder | None

    def recorder_spec(self) -> tuple[str, list[tuple[str, str, str]], dict[int, str]]:
        """(machine name, (trigger, source, dest) per move index, timed state number -> name)."""
        ...


class Telemetry:
    """The switch and the recorders. ``enable`` / ``disable`` / ``reset`` from
    any thread that is not recording at the same moment (a manager's
    construction, a test); the recording sites only read the attributes."""

    def __init__(self) -> None:
        self.datapath: DataPath | None = None
        # The open trace (docs/trace.md), or None: see ``start_trace``.
        self.trace: Trace | None = None
        self.clock: Callable[[], int] = time.monotonic_ns
        # CPU time of the calling thread: host copies and pool writes (a
        # thread preempted mid-copy is not charged for the wait).
        self.cpu_clock: Callable[[], int] = time.thread_time_ns
        self._machines: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.datapath is not None

    def register(self, machine: RecordedMachine) -> None:
        """Track ``machine`` (compile time) and give it a recorder if on."""
        with self._lock:
            self._machines.add(machine)
            self._install(machine)

    def _recorder(self, machine: RecordedMachine) -> MoveRecorder:
        name, labels, timed = machine.recorder_spec()
        return MoveRecorder(name, labels, timed, self.clock)

    def _install(self, machine: RecordedMachine, fresh: bool = False) -> None:
        """The machine's recorder for the current switches (lock held):
        metrics if on, wrapped in the trace's recorder if a trace is open.
        The machine's metrics recorder is kept (a trace opening or closing
        must not reset its counts) unless ``fresh`` or there is none."""
        metrics = None
        if self.enabled:
            current = getattr(machine.recorder, "metrics", machine.recorder)
            metrics = current if isinstance(current, MoveRecorder) and not fresh else self._recorder(machine)
        trace = self.trace
        if trace is None:
            machine.recorder = metrics
        else:
            name, labels, _ = machine.recorder_spec()
            machine.recorder = TraceRecorder(name, labels, trace, metrics)

    def start_trace(self, trace: Trace) -> None:
        """Record every machine's moves into ``trace`` from now on (a trace
        already open is closed first: one per process)."""
        with self._lock:
            old, self.trace = self.trace, trace
            for machine in list(self._machines):
                self._install(machine)
        if old is not None and old is not trace:
            old.close()

    def stop_trace(self, trace: Trace) -> None:
        """Close ``trace`` and stop recording into it (if it is the open one)."""
        with self._lock:
            if self.trace is trace:
                self.trace = None
                for machine in list(self._machines):
                    self._install(machine)
        trace.close()

    def enable(self, *, clock: Callable[[], int] | None = None, cpu_clock: Callable[[], int] | None = None) -> None:
        """Start recording (idempotent: an enabled registry keeps its series
        unless ``clock`` changes, which starts fresh ones). ``clock`` /
        ``cpu_clock``: nanosecond clocks to use instead of the monotonic and
        the thread clock (a test's)."""
        with self._lock:
            self.cpu_clock = cpu_clock or time.thread_time_ns
            if self.enabled and (clock is None or clock is self.clock):
                return
            self.clock = clock or time.monotonic_ns
            self.datapath = DataPath()
            for machine in list(self._machines):
                self._install(machine, fresh=True)

    def disable(self) -> None:
        """Stop recording and drop every series."""
        with self._lock:
            self.datapath = None
            for machine in list(self._machines):
                self._install(machine)

    def set_enabled(self, on: bool) -> None:
        if on:
            self.enable()
        else:
            self.disable()

    def reset(self) -> None:
        """Fresh, empty series (when enabled)."""
        if self.enabled:
            clock = self.clock
            self.disable()
            self.enable(clock=clock)

    @contextmanager
    def recording(
        self, *, clock: Callable[[], int] | None = None, cpu_clock: Callable[[], int] | None = None
    ) -> Iterator[Telemetry]:
        """Fresh series for the block (clocks injected, e.g. a test's); the
        previous switch state is restored after, with fresh series."""
        was = self.enabled
        self.disable()
        self.enable(clock=clock or time.monotonic_ns, cpu_clock=cpu_clock)
        try:
            yield self
        finally:
            self.disable()
            if was:
                self.enable()

    def recorders(self) -> list[MoveRecorder]:
        with self._lock:
            machines = list(self._machines)
        recorders = [getattr(m.recorder, "metrics", m.recorder) for m in machines]
        return [r for r in recorders if isinstance(r, MoveRecorder)]

    # ------------------------------------------------------------ reading

    def move_counts(self) -> dict[tuple[str, str, str, str], int]:
        """Count per (machine, trigger, source, dest), summed over machines
        compiled from the same spec name."""
        out: dict[tuple[str, str, str, str], int] = {}
        for rec in self.recorders():
            for (trigger, source, dest), n in rec.move_counts().items():
                key = (rec.machine, trigger, source, dest)
                out[key] = out.get(key, 0) + n
        return out

    def time_in_state(self) -> dict[tuple[str, str], HistogramSummary]:
        """Time-in-state histogram per (machine, state)."""
        out: dict[tuple[str, str], HistogramSummary] = {}
        for rec in self.recorders():
            for state, summary in rec.state_summaries().items():
                prev = out.get((rec.machine, state))
                out[(rec.machine, state)] = summary if prev is None else _merged(prev, summary)
        return out

    def summary(self) -> dict[str, Any]:
        """Plain data for ``stats_snapshot()`` and the ``--json`` outputs:
        move counts, and count / sum / p50 / p99 of every histogram."""
        if not self.enabled:
            return {"enabled": False}
        dp = self.datapath
        moves = [
            {"machine": m, "trigger": t, "source": s, "dest": d, "count": n}
            for (m, t, s, d), n in sorted(self.move_counts().items())
        ]
        states = {f"{m}.{s}": h.as_dict() for (m, s), h in sorted(self.time_in_state().items())}
        out: dict[str, Any] = {"enabled": True, "moves": moves, "time_in_state_seconds": states}
        if dp is not None:
            out["counters"] = dp.counters()
            out["histograms"] = {
                family: {label: h.as_dict() for label, h in series.items()}
                for family, series in dp.histograms().items()
            }
        return out


def _merged(a: HistogramSummary, b: HistogramSummary) -> HistogramSummary:
    buckets = tuple((bound, n + m) for (bound, n), (_, m) in zip(a.buckets, b.buckets))
    return HistogramSummary(count=a.count + b.count, sum=a.sum + b.sum, buckets=buckets)


TELEMETRY = Telemetry()


def dropped(n: int) -> None:
    """``n`` prefetched hit reads were abandoned before anyone used them
    (the hit dropped, re-planned after a reuse of its slots, or its step
    consumed without reading them)."""
    dp = TELEMETRY.datapath
    if dp is not None:
        dp.add("prefetch_hits_total", "dropped", n)
