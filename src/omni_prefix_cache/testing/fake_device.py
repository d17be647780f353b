"""A fake CUDA runtime under the real ``CudaCopyEngine``, for CPU tests.

``FakeRuntime`` treats every tensor as a device tensor (device 0 unless
``place``-d elsewhere), so the manager's and the controller's device branches
(clone, freeze event, per-device lanes, source holds, host waits) run on
CPU through the same engine code a GPU runs. Each stream and event call is
appended to ``calls`` in order; copies run on the host at once. ``pinned_*``
counts what a real run would pin (every ``host_empty``). ``fault`` makes
every later event wait or query raise, as a dead CUDA context does; ``pending_fault``
becomes ``fault`` at the next event recorded on a copy lane, as a fault queued
ahead of a step's copy lands while that copy is in flight.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.device.copy_engine import CudaCopyEngine, CudaRuntime


@dataclass(frozen=True)
class Call:
    """One logged runtime call. ``stream`` is a lane name such as ``copy0``,
    ``read1`` or ``compute0``; ``event`` the event's id; ``ptr`` the storage
    a copy or a source hold touched."""

    op: str  # new_stream, record, wait, hold, copy, sync, host_empty
    stream: str | None = None
    event: int | None = None
    ptr: int | None = None
    nbytes: int = 0


class FakeStream:
    def __init__(self, name: str, device: int) -> None:
        self.name = name
        self.device = device

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """Records where it was recorded; ``synchronize`` before ``record`` is a bug."""

    def __init__(self, rt: FakeRuntime, eid: int) -> None:
        self._rt = rt
        self.id = eid
        self.stream: str | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream.name
        self._rt.log(Call("record", stream.name, self.id))
        if self._rt.pending_fault is not None and stream.name.startswith("copy"):
            self._rt.fault, self._rt.pending_fault = self._rt.pending_fault, None

    def synchronize(self) -> None:
        if self.stream is None:
            raise AssertionError(f"event {self.id} waited on before it was recorded")
        if self._rt.fault is not None:
            raise RuntimeError(self._rt.fault)
        self._rt.log(Call("sync", self.stream, self.id))

    def query(self) -> bool:
        if self._rt.fault is not None:
            raise RuntimeError(self._rt.fault)
        return self.stream is not None and self.id not in self._rt.busy_events


def storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class FakeRuntime(CudaRuntime):
    """Logs every call ``CudaCopyEngine`` makes; see the module docstring."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.pinned_bytes = 0
        self.pinned_allocs = 0
        self.fault: str | None = None
        self.pending_fault: str | None = None  # becomes ``fault`` at the next copy-lane event record
        self.busy_events: set[int] = set()  # ids whose ``query`` says not done yet
        self.wait_delay_s = 0.0  # lag injected after each lane wait (the GPU check's dry run)
        self._lock = threading.Lock()
        self._places: dict[int, int] = {}
        self._compute: dict[int, FakeStream] = {}
        self._current = threading.local()
        self._ids = itertools.count(1)

    def log(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def ops(self, *names: str) -> list[Call]:
        """The logged calls whose op is one of ``names`` (all when none given)."""
        with self._lock:
            return [c for c in self.calls if not names or c.op in names]

    def place(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """Pretend ``t`` (and every view of its storage) lives on ``device``."""
        self._places[storage_ptr(t)] = device
        return t

    # ------------------------------------------------------ CudaRuntime API

    def is_device(self, t: torch.Tensor) -> bool:
        return True

    def device_of(self, t: torch.Tensor) -> int:
        return self._places.get(storage_ptr(t), 0)

    def new_stream(self, device: int, lane: str) -> FakeStream:
        stream = FakeStream(f"{lane}{device}", device)
        self.log(Call("new_stream", stream.name))
        return stream

    def current_stream(self, device: int) -> FakeStream:
        current: FakeStream | None = getattr(self._current, "stream", None)
        if current is not None and current.device == device:
            return current
        with self._lock:
            return self._compute.setdefault(device, FakeStream(f"compute{device}", device))

    @contextmanager
    def use_stream(self, device: int, stream: FakeStream) -> Iterator[None]:
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def new_event(self) -> FakeEvent:
        return FakeEvent(self, next(self._ids))

    def wait(self, stream: FakeStream, event: Any) -> None:
        if getattr(event, "stream", None) is None:
            raise AssertionError(f"{stream.name} waits on an event that was never recorded")
        self.log(Call("wait", stream.name, event.id))
        if self.wait_delay_s:
            time.sleep(self.wait_delay_s)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=dtype)
        nbytes = out.numel() * out.element_size()
        with self._lock:
            self.pinned_bytes += nbytes
            self.pinned_allocs += 1
        self.log(Call("host_empty", nbytes=nbytes, ptr=storage_ptr(out)))
        return out

    def lane(self) -> str | None:
        """The lane the calling thread is on (None: the compute stream)."""
        current = getattr(self._current, "stream", None)
        return None if current is None else current.name


class FakeDeviceEngine(CudaCopyEngine):
    """``CudaCopyEngine`` over a ``FakeRuntime``; logs each copy with its lane."""

    name = "fake-cuda"

    def __init__(self, runtime: FakeRuntime | None = None) -> None:
        self.rt = runtime if runtime is not None else FakeRuntime()
        super().__init__(self.rt)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.rt.log(Call("copy", self.rt.lane(), ptr=storage_ptr(src), nbytes=src.numel() * src.element_size()))
        super().copy_into(dst, src)

    def _hold(self, key: tuple[int, str], event: Any, sources: tuple[torch.Tensor, ...]) -> None:
        for src in sources:
            self.rt.log(Call("hold", f"{key[1]}{key[0]}", event.id, ptr=storage_ptr(src)))
        super()._hold(key, event, sources)
