"""The simulated async output thread, shared by the engine loops."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LaggedWorker"]


class LaggedWorker(threading.Thread):
    """Runs the engine's output jobs one step behind it (a bounded queue of
    one), as vLLM's async output thread does; its first error is re-raised
    on the engine thread at the next ``submit`` or at ``finish``."""

    def __init__(self, run: Callable[[Any], None], name: str = "sim-output-builder") -> None:
        super().__init__(name=name, daemon=True)
        self._run = run
        self.jobs: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None

    def submit(self, job: Any) -> None:
        if self.error is not None:
            raise self.error
        self.jobs.put(job)

    def finish(self) -> None:
        """Run what is queued, stop, and raise the worker's error if any."""
        self.jobs.put(None)
        self.join()
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        """Stop after a failed run (bounded wait)."""
        if self.is_alive():
            self.jobs.put(None)
            self.join(timeout=5.0)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is not None:
                continue  # drain without touching the manager again
            try:
                self._run(job)
            except BaseException as exc:  # reported by the engine thread
                self.error = exc
