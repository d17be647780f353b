"""``bench --scrape HZ``: a thread that scrapes the Prometheus collector
over the run's manager at a scheduled rate while the timed steps run, as a
Prometheus server polling ``/metrics`` would.

A scrape is ``prometheus_client.generate_latest`` on a registry holding an
``OmniPrefixCacheCollector`` over the manager: the collector's ``collect()``
(one ``stats_snapshot()`` and the runtime metrics' copies) and the text
rendering, all on the scrape thread. The schedule is ``start + k / hz``; a
scrape that overruns its slot skips the slots it covered instead of
catching up back to back, so the rate is at most ``hz``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from omni_prefix_cache.tools.bench.measure import pct
from omni_prefix_cache.tools.bench.results import ScrapeStats

ScrapeOf = Callable[[Any], Callable[[], object]]


def collector_scrape(manager: Any) -> Callable[[], object]:
    """One scrape of ``manager`` as Prometheus does it: ``generate_latest``
    of a fresh registry holding the collector (needs ``prometheus_client``,
    the ``metrics`` extra; ImportError without it)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from omni_prefix_cache.ops.metrics import OmniPrefixCacheCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(OmniPrefixCacheCollector(manager))
    return lambda: generate_latest(registry)


class Scraper:
    """Calls ``scrape`` ``hz`` times a second on its own daemon thread
    between ``__enter__`` and ``__exit__`` (which joins it and re-raises
    what a scrape raised). ``stats()`` after exit: the scrapes done, the
    window and their p50 / max duration."""

    def __init__(self, scrape: Callable[[], object], hz: float) -> None:
        if not hz > 0 or math.isinf(hz):
            raise ValueError(f"scrape rate must be a positive finite number of Hz, got {hz}")
        self._scrape = scrape
        self._hz = hz
        self._period = 1.0 / hz
        self._stop = threading.Event()
        self._durations_ns: list[int] = []
        self._error: BaseException | None = None
        self._start = self._end = 0.0
        self._thread = threading.Thread(target=self._loop, name="bench-scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._end = time.perf_counter()
        if self._error is not None and exc is None:
            raise RuntimeError("bench --scrape: a scrape of the collector raised") from self._error

    def _loop(self) -> None:
        slot = 0
        while True:
            delay = self._start + slot * self._period - time.perf_counter()
            if (delay > 0 and self._stop.wait(delay)) or self._stop.is_set():
                return
            t0 = time.perf_counter_ns()
            try:
                self._scrape()
            except BaseException as exc:  # handed to the thread that leaves the context
                self._error = exc
                return
            self._durations_ns.append(time.perf_counter_ns() - t0)
            # The first slot still ahead: an overrun skips slots, never bunches them.
            slot = max(slot + 1, math.floor((time.perf_counter() - self._start) / self._period) + 1)

    def stats(self) -> ScrapeStats:
        """What the thread did (call after ``__exit__``)."""
        us = [d / 1000.0 for d in self._durations_ns]
        return ScrapeStats(
            hz=self._hz,
            scrapes=len(us),
            window_s=self._end - self._start,
            us_p50=pct(us, 50) if us else None,
            us_max=max(us) if us else None,
        )


class ScrapeRun:
    """A ``run_scenario(during_timed=...)`` hook scraping the run's manager
    at ``hz`` (``scrape_of(manager)`` builds the scrape; default
    ``collector_scrape``); ``stats`` is set when the timed steps end."""

    def __init__(self, hz: float, scrape_of: ScrapeOf | None = None) -> None:
        self.hz = hz
        self._scrape_of = scrape_of or collector_scrape
        self.stats: ScrapeStats | None = None

    @contextmanager
    def __call__(self, manager: Any) -> Iterator[None]:
        scraper = Scraper(self._scrape_of(manager), self.hz)
        with scraper:
            yield
        self.stats = scraper.stats()
