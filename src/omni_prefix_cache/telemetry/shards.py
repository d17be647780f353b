"""Per-thread rows of numbers: what every histogram, counter and move
recorder stores its figures in, so that observing takes no lock.

Each observing thread adds into its own row (a plain list, kept by the
thread's ident and cached in a ``threading.local``, so finding it is an
attribute read, not a call); only that thread ever writes the row, so an
increment needs no lock. A read (a scrape, ``stats_snapshot``, on any thread) sums
the rows element by element. The one lock here is taken when a thread
writes its first figure (its row is registered) and by a read (to copy the
list of rows), never per observation.

Nothing a thread recorded is lost when it exits: its row stays. A later
thread that gets the same ident (CPython reuses them) finds it by the ident
and keeps adding into it; the two never run at once, so the row still has
one writer at a time, and the rows stay as many as threads ever observed at
once.

What a read sees: each element only grows (every amount added is >= 0,
and rows are never dropped), so a total never goes backwards from one read
to the next. A read racing an observation may see part of it: a histogram
bucket's count without the observation's sum, for an instant, until the
next read. Prometheus tolerates that (its own clients read count and sum
apart too).

The lock comes straight from ``threading`` (not ``device.sync``): it never
spans a wait on another thread, so it is not a synchronization point the
interleaving explorer needs to see.
"""

from __future__ import annotations

import threading
from threading import get_ident

__all__ = ["Shards"]


class Shards:
    """``width`` numbers kept as one row per observing thread. Any thread.

    A recording site takes its row with::

        try:
            row = shards.local.row
        except AttributeError:  # the thread's first figure here
            row = shards.register()

    and adds into it: ``row[i] += amount`` with ``amount >= 0``. Only the
    thread whose ident keys a row writes it.
    """

    __slots__ = ("width", "rows", "local", "_lock")

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"shards need a width of at least 1, got {width}")
        self.width = width
        # ident -> that thread's row; written only by ``register``.
        self.rows: dict[int, list[float]] = {}
        # ``row``: the calling thread's row, once it registered.
        self.local = threading.local()
        self._lock = threading.Lock()

    def register(self) -> list[float]:
        """The calling thread's row: the one its ident keys (a thread that
        had the ident before left it), else a new one of zeros; cached in
        ``local``. Takes the lock: once per thread, at its first figure."""
        ident = get_ident()
        with self._lock:
            row = self.rows.get(ident)
            if row is None:
                row = self.rows[ident] = [0] * self.width
        self.local.row = row
        return row

    def totals(self) -> list[float]:
        """Every element summed over the rows (ints stay ints). Any thread;
        takes the lock only to copy the list of rows, so an observer never
        waits on it. See the module docstring for what a racing read sees."""
        with self._lock:
            rows = list(self.rows.values())
        if len(rows) == 1:
            return list(rows[0])
        return [sum(column) for column in zip(*rows)] if rows else [0] * self.width
