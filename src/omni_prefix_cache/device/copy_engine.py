"""Where device-to-host copies run: the seam between the controller and torch.

``CudaCopyEngine`` issues copies on per-device copy/read streams, ordered
after the clone's freeze event, straight into pinned host slices, and
returns blocking CUDA events. ``CpuCopyEngine`` runs the same calls as plain
host copies that are complete on return (event None). With it the threaded
committer (queues, worker loop, escalate, budget flush, failure isolation)
runs unchanged on CPU.

``CudaCopyEngine`` reaches torch.cuda only through a ``CudaRuntime``; a test
(``omni_prefix_cache.testing.fake_device``) swaps in a runtime that logs
every stream and event call, so the engine's ordering is checked on CPU.
See docs/cuda.md for the integration contract.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from omni_prefix_cache.device import sync
from omni_prefix_cache.telemetry.registry import TELEMETRY

# (host destination, source) pairs: each source is copied into its own slice.
Copies = Sequence[tuple[torch.Tensor, torch.Tensor]]


class DeviceEvent(Protocol):
    """Completes queued device work: a ``torch.cuda.Event``, ``DeviceEvents``
    (one per device) or a test runtime's fake. None stands for "already
    complete" wherever an event is optional."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DeviceEvents:
    """One event per device (a step whose tensors span several GPUs).

    ``synchronize`` waits them all. ``merged`` keeps, per device, the newer
    event: events recorded on one stream complete in order.
    """

    def __init__(self, events: dict[int, DeviceEvent]) -> None:
        self.events = dict(events)

    def synchronize(self) -> None:
        for event in self.events.values():
            event.synchronize()

    def query(self) -> bool:
        return all(event.query() for event in self.events.values())

    @staticmethod
    def merged(older: DeviceEvent | None, newer: DeviceEvent | None) -> DeviceEvent | None:
        """``newer`` plus the devices only ``older`` covers."""
        if older is None or newer is None:
            return newer if older is None else older
        if isinstance(older, DeviceEvents) and isinstance(newer, DeviceEvents):
            return DeviceEvents({**older.events, **newer.events})
        return newer


def events_of(event: DeviceEvent | None) -> list[DeviceEvent]:
    """The plain events inside ``event`` (None, one event or DeviceEvents)."""
    if event is None:
        return []
    if isinstance(event, DeviceEvents):
        return list(event.events.values())
    return [event]


class CopyEngine(Protocol):
    """How rows leave the device. Used by the controller (and the manager's
    device branches through it) only."""

    name: str
    pin_memory: bool  # host memory a device copy reads or writes is pinned

    def is_device(self, t: torch.Tensor) -> bool:
        """True if ``t`` lives where this engine's lanes copy from."""
        ...

    def freeze(self, tensors: Iterable[torch.Tensor]) -> DeviceEvent | None:
        """An event on the current (compute) stream of each device holding
        one of ``tensors``; None when none is a device tensor."""
        ...

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Host memory a device copy will write (pinned on CUDA)."""
        ...

    def launch(self, freeze_event: DeviceEvent | None, copies: Copies) -> DeviceEvent | None:
        """Copy each source into its host destination on the copy lane of
        the source's device, after ``freeze_event``; return an event whose
        ``synchronize()`` completes them, or None if already done."""
        ...

    def read(self, freeze_event: DeviceEvent | None, copies: Copies) -> None:
        """As ``launch`` on the read lane, and wait for it: the
        destinations are safe to use on the host on return."""
        ...

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy, on whatever lane is current (the hook tests inject into)."""
        ...


class CpuCopyEngine:
    """Host copies, complete on return. For CPU runs, eager mode and tests.

    A CUDA source (eager mode on a GPU machine) is copied synchronously on
    the caller's current stream, after host-waiting the freeze event.
    """

    name = "cpu"
    pin_memory = False

    def is_device(self, t: torch.Tensor) -> bool:
        return not t.is_cpu

    def freeze(self, tensors: Iterable[torch.Tensor]) -> DeviceEvent | None:
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        if not devices:
            return None
        return CudaRuntime().record_on_current(devices)  # pragma: no cover - CUDA only

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def launch(self, freeze_event: DeviceEvent | None, copies: Copies) -> DeviceEvent | None:
        for event in events_of(freeze_event):  # pragma: no cover - CUDA only
            event.synchronize()
        for dst, src in copies:
            self.copy_into(dst, src)
        return None

    def read(self, freeze_event: DeviceEvent | None, copies: Copies) -> None:
        self.launch(freeze_event, copies)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class CudaRuntime:
    """The torch.cuda primitives ``CudaCopyEngine`` uses, and nothing else.
    A test subclasses it to log calls (``testing.fake_device``)."""

    def is_device(self, t: torch.Tensor) -> bool:  # pragma: no cover - CUDA only
        return t.is_cuda

    def device_of(self, t: torch.Tensor) -> int:  # pragma: no cover - CUDA only
        return int(t.device.index if t.device.index is not None else torch.cuda.current_device())

    def new_stream(self, device: int, lane: str) -> Any:  # pragma: no cover - CUDA only
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: int) -> Any:  # pragma: no cover - CUDA only
        return torch.cuda.current_stream(device)

    @contextmanager
    def use_stream(self, device: int, stream: Any) -> Iterator[None]:  # pragma: no cover - CUDA only
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def new_event(self) -> Any:
        # blocking: a host wait sleeps instead of spinning a core (the
        # committer, prefetch and materialize all wait on these).
        return torch.cuda.Event(blocking=True)

    def wait(self, stream: Any, event: Any) -> None:  # pragma: no cover - CUDA only
        stream.wait_event(event)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - CUDA only
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def record_on_current(self, devices: Iterable[int]) -> DeviceEvents:
        """A blocking event on each device's current stream."""
        events: dict[int, Any] = {}
        for device in devices:
            event = self.new_event()
            event.record(self.current_stream(device))
            events[device] = event
        return DeviceEvents(events)


class CudaCopyEngine:
    """Per-device copy and read streams; pinned host memory; non-blocking copies.

    The engine holds every device source a lane reads until the event recorded
    after its copies has completed, so a clone dropped early (a failed task, a
    failed save) is not handed to another allocation while a queued copy still
    reads it. Holds are released by a later launch that finds the event done.
    Not ``record_stream``: once a device fault kills the CUDA context, freeing a
    block marked by ``record_stream`` makes torch's allocator record an event,
    which throws inside a destructor and aborts the process; a hold is simply
    never released after a fault (the process must restart anyway), so
    ``shutdown`` still returns.
    """

    name = "cuda"
    pin_memory = True

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self._rt = runtime if runtime is not None else CudaRuntime()
        self._lanes: dict[tuple[int, str], Any] = {}
        self._lanes_lock = sync.Lock()
        self.lane_uses: Counter[str] = Counter()  # diagnostics: "copy"/"read" launches
        # Per lane, in launch order (a stream completes its events in order): the event
        # recorded after a launch's copies and the sources they read.
        self._holds: dict[tuple[int, str], deque[tuple[Any, tuple[torch.Tensor, ...]]]] = {}
        self._holds_lock = sync.Lock()
        self._faulted = False  # an event query raised: the context is gone, nothing is released again

    def held_sources(self) -> list[torch.Tensor]:
        """The device sources still held for a lane's queued copies (diagnostics, tests)."""
        with self._holds_lock:
            return [t for holds in self._holds.values() for _, sources in holds for t in sources]

    def _hold(self, key: tuple[int, str], event: Any, sources: tuple[torch.Tensor, ...]) -> None:
        """Keep ``sources`` alive until ``event`` is done; first release every
        earlier hold whose event is done. Any thread; takes the holds lock."""
        with self._holds_lock:
            self._release_done()
            self._holds.setdefault(key, deque()).append((event, sources))

    def _release_done(self) -> None:
        if self._faulted:
            return
        for holds in self._holds.values():
            while holds:
                try:
                    done = holds[0][0].query()
                except RuntimeError:  # a dead context: keep every hold for good
                    self._faulted = True
                    return
                if not done:
                    break
                holds.popleft()

    def is_device(self, t: torch.Tensor) -> bool:
        return bool(self._rt.is_device(t))

    def freeze(self, tensors: Iterable[torch.Tensor]) -> DeviceEvent | None:
        devices = sorted({self._rt.device_of(t) for t in tensors if self._rt.is_device(t)})
        if not devices:
            return None
        return self._rt.record_on_current(devices)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self._rt.host_empty(shape, dtype)

    def _lane(self, device: int, lane: str) -> Any:
        # Streams live on the device of the tensors they copy, created on
        # first use: a tensor on GPU 1 is never copied on GPU 0's stream.
        with self._lanes_lock:
            stream = self._lanes.get((device, lane))
            if stream is None:
                stream = self._lanes[(device, lane)] = self._rt.new_stream(device, lane)
            return stream

    def _run(self, lane: str, freeze_event: DeviceEvent | None, copies: Copies) -> DeviceEvent | None:
        by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in copies:
            if self._rt.is_device(src):
                by_device.setdefault(self._rt.device_of(src), []).append((dst, src))
            else:
                self.copy_into(dst, src)
        if not by_device:
            return None
        waits = events_of(freeze_event)
        done: dict[int, Any] = {}
        for device, items in by_device.items():
            stream = self._lane(device, lane)
            self.lane_uses[lane] += 1
            with self._rt.use_stream(device, stream):
                for event in waits:
                    self._rt.wait(stream, event)
                timing = self._timing_start(stream)
                try:
                    for dst, src in items:
                        self.copy_into(dst, src)
                finally:
                    # Also after a failed copy: the copies queued before it still read their sources.
                    event = self._end_launch((device, lane), stream, tuple(src for _, src in items))
                if timing is not None:
                    self._timing_end(lane, stream, timing)
            done[device] = event
        return next(iter(done.values())) if len(done) == 1 else DeviceEvents(done)

    def _end_launch(self, key: tuple[int, str], stream: Any, sources: tuple[torch.Tensor, ...]) -> Any:
        """Record the launch's event on ``stream`` and hold its sources until it is done."""
        event = self._rt.new_event()
        try:
            event.record(stream)
        except RuntimeError:  # a dead context: the sources are never released
            with self._holds_lock:
                self._faulted = True
                self._holds.setdefault(key, deque()).append((event, sources))
            raise
        self._hold(key, event, sources)
        return event

    @staticmethod
    def _timing_start(stream: Any) -> Any:  # pragma: no cover - CUDA only
        """With metrics on, a timing event recorded on ``stream`` before its
        copies (host clocks would time the launch, not the copy)."""
        # A fake runtime on a CPU machine (tests) has no events to time with.
        if TELEMETRY.datapath is None or not _cuda_present():
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    @staticmethod
    def _timing_end(lane: str, stream: Any, start: Any) -> None:  # pragma: no cover - CUDA only
        dp = TELEMETRY.datapath
        if dp is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            dp.device_copy(lane, start, end)

    def launch(self, freeze_event: DeviceEvent | None, copies: Copies) -> DeviceEvent | None:
        return self._run("copy", freeze_event, copies)

    def read(self, freeze_event: DeviceEvent | None, copies: Copies) -> None:
        event = self._run("read", freeze_event, copies)
        if event is not None:
            event.synchronize()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


@functools.cache
def _cuda_present() -> bool:
    return bool(torch.cuda.is_available())


def default_engine(eager: bool) -> CopyEngine:
    """CUDA lanes for the threaded committer where CUDA exists, else CPU."""
    if not eager and torch.cuda.is_available():  # pragma: no cover - CUDA only
        return CudaCopyEngine()
    return CpuCopyEngine()
