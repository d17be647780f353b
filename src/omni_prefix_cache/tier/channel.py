"""What the host tier's worker side tells its scheduler side (no torch, no vLLM).

The scheduler side (``tier.connector``) decides what the tier holds; the worker
follows. One thing only the worker knows: a hash whose rows it does not keep
as the scheduler side believes, because its fill failed, its block was rebound,
or its rows would pass this side's byte bound (kept as a surplus meanwhile).
``TierReports`` collects those hashes; vLLM carries them back the way it
carries every worker connector's news, in the step's
``KVConnectorOutput.kv_connector_worker_meta``: the worker side of
``OmniTierConnector`` drains every open tier of its process into its worker
metadata (``drain``), and the scheduler side's ``update_connector_output``
makes its ``TierIndex`` forget them, so they are not offered to a load again
(vLLM recomputes instead), and releases them once no load of them is pending.

A manager's tier registers its reports when it opens and leaves at shutdown;
a worker process serves one stage, so the open tiers are that stage's (a test
process may hold several managers: each drain takes from every open one).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from omni_prefix_cache.tier.metadata import BlockHash

# The most hashes one tier keeps waiting for a drain (a worker without the
# wrapper never drains); past it the oldest are dropped and counted.
MAX_PENDING = 1 << 16


class TierReports:
    """Hashes one tier reports to the scheduler side, until drained. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[BlockHash, None] = {}  # an ordered set: the oldest first
        self.dropped = 0  # hashes dropped past MAX_PENDING before a drain took them
        self.reported = 0  # hashes reported over the tier's life

    def report(self, hashes: Iterable[BlockHash]) -> None:
        """The worker no longer keeps these hashes as the scheduler side believes."""
        with self._lock:
            for h in hashes:
                self._pending.pop(h, None)
                self._pending[h] = None
                self.reported += 1
            excess = len(self._pending) - MAX_PENDING
            if excess > 0:
                for h in list(self._pending)[:excess]:
                    del self._pending[h]
                self.dropped += excess

    def pending(self) -> tuple[BlockHash, ...]:
        """The hashes reported and not taken yet, oldest first (nothing is taken)."""
        with self._lock:
            return tuple(self._pending)

    def take(self) -> tuple[BlockHash, ...]:
        """Every hash reported since the last take, oldest first (and none again)."""
        with self._lock:
            out, self._pending = tuple(self._pending), {}
        return out


_OPEN: weakref.WeakSet[TierReports] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


def open_reports(reports: TierReports) -> None:
    """``reports`` is drained by this process's worker connector from now on."""
    with _OPEN_LOCK:
        _OPEN.add(reports)


def close_reports(reports: TierReports) -> None:
    """``reports`` is no longer drained (its manager shut down)."""
    with _OPEN_LOCK:
        _OPEN.discard(reports)


def drain() -> tuple[BlockHash, ...]:
    """Every open tier's reported hashes, each once (the worker connector, once per step)."""
    with _OPEN_LOCK:
        tiers = list(_OPEN)
    out: dict[BlockHash, None] = {}
    for reports in tiers:
        out.update(dict.fromkeys(reports.take()))
    return tuple(out)
