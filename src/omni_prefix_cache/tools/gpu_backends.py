"""Where ``make gpu-check`` runs (``tools.gpu_check``): a device, a copy
engine factory, a slow forward and an injected device fault.

``cuda_backend``: the real CUDA engine with lanes lagged by a sleep after
every stream wait, and a forward slowed by a sleep kernel. ``fake_backend``:
the real CUDA engine over the logging fake runtime (``testing.fake_device``),
on CPU. ``cpu_backend``: the CPU copy engine (no lanes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.device.copy_engine import CopyEngine, CpuCopyEngine, CudaCopyEngine, CudaRuntime


class LaggingCudaRuntime(CudaRuntime):  # pragma: no cover - CUDA only
    """Sleeps on the lane right after each stream wait: copies land late."""

    def __init__(self, cycles: int) -> None:
        self.cycles = cycles

    def wait(self, stream: Any, event: Any) -> None:
        super().wait(stream, event)
        torch.cuda._sleep(self.cycles)  # runs on `stream`: the caller is inside use_stream


@dataclass
class Backend:
    """Where the harness runs: a device, an engine factory, a slow forward, a fault."""

    name: str
    device: torch.device
    make_engine: Callable[[], CopyEngine]
    slow_forward: Callable[[], None] = lambda: None
    inject_fault: Callable[[CopyEngine], None] | None = None
    lanes: bool = True  # the engine has copy/read lanes (not the CPU engine)

    def memory(self) -> int | None:
        if self.device.type == "cuda":  # pragma: no cover - CUDA only
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        return None


def _sleep_cycles_per_ms() -> float:  # pragma: no cover - CUDA only
    """Calibrate ``torch.cuda._sleep`` (it counts clock cycles, not time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    elapsed_ms: float = start.elapsed_time(end)
    return 20_000_000 / max(elapsed_ms, 1e-3)


def cuda_backend(lag_ms: float, forward_ms: float) -> Backend:  # pragma: no cover - CUDA only
    per_ms = _sleep_cycles_per_ms()

    def fault(engine: CopyEngine) -> None:
        # An out-of-bounds gather: a device-side assert, raised asynchronously. Queued behind a
        # 100 ms kernel on the current stream, so it lands after the host has saved the step whose
        # forward it belongs to, while that step's copy (ordered after it) is still in flight.
        torch.cuda._sleep(int(per_ms * 100))
        torch.zeros(4, device="cuda")[torch.tensor([1 << 20], device="cuda")]

    return Backend(
        name="cuda",
        device=torch.device("cuda", torch.cuda.current_device()),
        make_engine=lambda: CudaCopyEngine(LaggingCudaRuntime(int(per_ms * lag_ms))),
        slow_forward=lambda: torch.cuda._sleep(int(per_ms * forward_ms)),
        inject_fault=fault,
    )


def fake_backend(lag_ms: float) -> Backend:
    from omni_prefix_cache.testing.fake_device import FakeDeviceEngine

    def make() -> CopyEngine:
        engine = FakeDeviceEngine()
        engine.rt.wait_delay_s = lag_ms / 1000
        return engine

    def fault(engine: CopyEngine) -> None:
        # Lands with the step's copy, as the CUDA backend's fault lands behind its slow kernel.
        engine.rt.pending_fault = "CUDA error: an illegal memory access was encountered (fake)"  # type: ignore[attr-defined]

    return Backend(name="fake-lanes", device=torch.device("cpu"), make_engine=make, inject_fault=fault)


def cpu_backend() -> Backend:
    return Backend(name="cpu-engine", device=torch.device("cpu"), make_engine=CpuCopyEngine, lanes=False)
