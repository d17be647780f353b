"""Where device-to-host copies run: the seam between the controller and torch.

``CudaCopyEngine`` issues copies on dedicated copy/read streams, ordered
after the clone's freeze event, into pinned memory, and returns CUDA events.
``CpuCopyEngine`` runs the same calls as plain host copies that are complete
on return (event None). With it the threaded committer (queues, worker loop,
escalate, budget flush, failure isolation) runs unchanged on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class CopyEngine(Protocol):
    """How to move rows off the device. Used by the controller only."""

    name: str
    pin_memory: bool

    def launch(self, freeze_event: Any, copy: Callable[[], None]) -> Any:
        """Run ``copy`` on the copy lane after ``freeze_event``; return an
        event with ``synchronize()`` that completes it, or None if done."""
        ...

    def read(self, freeze_event: Any, read: Callable[[], T]) -> T:
        """Run ``read`` on the read lane after ``freeze_event`` and wait for
        it; the result is safe to use on the host."""
        ...

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of ``src`` owned by the caller (non-blocking on CUDA;
        valid once the lane's event completes)."""
        ...


class CpuCopyEngine:
    """Host copies, complete on return. For CPU runs and tests."""

    name = "cpu"
    pin_memory = False

    def launch(self, freeze_event: Any, copy: Callable[[], None]) -> Any:
        copy()
        return None

    def read(self, freeze_event: Any, read: Callable[[], T]) -> T:
        return read()

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        return src.detach().to("cpu", copy=True)


class CudaCopyEngine:  # pragma: no cover - exercised only where CUDA exists
    """Copy and read streams; pinned host memory; non-blocking copies."""

    name = "cuda"
    pin_memory = True

    def __init__(self) -> None:
        self._copy_stream = torch.cuda.Stream()
        self._read_stream = torch.cuda.Stream()

    def _on(self, stream: Any, freeze_event: Any, fn: Callable[[], T]) -> tuple[T, Any]:
        with torch.cuda.stream(stream):
            if freeze_event is not None:
                stream.wait_event(freeze_event)
            out = fn()
            event = torch.cuda.Event()
            event.record()
        return out, event

    def launch(self, freeze_event: Any, copy: Callable[[], None]) -> Any:
        _, event = self._on(self._copy_stream, freeze_event, copy)
        return event

    def read(self, freeze_event: Any, read: Callable[[], T]) -> T:
        out, event = self._on(self._read_stream, freeze_event, read)
        event.synchronize()
        return out

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        if src.device.type == "cpu":
            return src.clone()
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        return dst


def default_engine(eager: bool) -> CopyEngine:
    """CUDA lanes for the threaded committer where CUDA exists, else CPU."""
    if not eager and torch.cuda.is_available():
        return CudaCopyEngine()
    return CpuCopyEngine()
