"""The one place the runtime gets its threads and synchronization primitives.

Runtime modules call ``sync.Lock()``, ``sync.Condition(...)``, ``sync.Thread(...)``
and so on instead of naming ``threading`` directly. In production these names
*are* the ``threading`` / ``concurrent.futures`` classes, so a construction
costs the same attribute lookup as before and every acquire, wait or notify
is the real object's own method: the seam adds nothing per operation.

The interleaving explorer (``omni_prefix_cache.testing.explore``) swaps them,
for the duration of a run, for primitives that yield to its scheduler at
every synchronization point. Nothing else should assign these names.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Lock: Any = threading.Lock
RLock: Any = threading.RLock
Condition: Any = threading.Condition
Event: Any = threading.Event
Thread: Any = threading.Thread
# The prefetch executor: ``Executor(max_workers=..., thread_name_prefix=...)``.
Executor: Any = ThreadPoolExecutor

_NAMES = ("Lock", "RLock", "Condition", "Event", "Thread", "Executor")


def new_rlock() -> Any:
    """A re-entrant lock from the current seam (for dataclass ``default_factory``)."""
    return RLock()


@contextlib.contextmanager
def installed(**factories: Any) -> Iterator[None]:
    """Replace some of the seam's factories (by name) for the block; restore them after.
    Only the explorer does this, and never while production threads run."""
    unknown = set(factories) - set(_NAMES)
    if unknown:
        raise KeyError(f"sync seam has no {sorted(unknown)}; known: {', '.join(_NAMES)}")
    g = globals()
    saved = {name: g[name] for name in factories}
    g.update(factories)
    try:
        yield
    finally:
        g.update(saved)
