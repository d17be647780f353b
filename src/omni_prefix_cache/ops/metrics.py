"""A ``prometheus_client`` collector over a manager's :class:`~omni_prefix_cache.ops.stats.CacheStats`.

Needs the ``metrics`` extra (``pip install 'omni-prefix-cache[metrics]'``)::

    from prometheus_client import REGISTRY
    from omni_prefix_cache.ops.metrics import OmniPrefixCacheCollector

    REGISTRY.register(OmniPrefixCacheCollector(manager, labels={"stage": "talker"}))

Each scrape takes one ``stats_snapshot()`` (the manager's locks, briefly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_prefix_cache.ops.stats import FIELD_HELP, STAT_FIELDS, CacheStats


class StatsSource(Protocol):
    """What the collector scrapes: a manager, or anything with its ``stats_snapshot()``."""

    def stats_snapshot(self) -> CacheStats: ...


# Fields exported with one sample per mapping entry, and the label naming the entry.
_LABELLED = {"pool_bytes": "key", "write_tasks_by_state": "state"}


class OmniPrefixCacheCollector(Collector):
    """Exports every ``CacheStats`` field as ``<namespace>_<field>``.

    ``source`` is a manager (anything with ``stats_snapshot()``) or a
    callable returning a ``CacheStats``. ``labels`` are constant labels added
    to every sample (e.g. the stage name when one process runs several).
    """

    def __init__(
        self,
        source: StatsSource | Callable[[], CacheStats],
        *,
        namespace: str = "omni_prefix_cache",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        snapshot = getattr(source, "stats_snapshot", None)
        # Without a stats_snapshot() the source is the snapshot callable itself.
        self._snapshot: Callable[[], CacheStats] = (
            snapshot if callable(snapshot) else cast("Callable[[], CacheStats]", source)
        )
        self._namespace = namespace
        self._labels = dict(labels or {})

    def describe(self) -> Iterable[Metric]:
        # Registration must not take the manager's locks; names are fixed anyway.
        return []

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())
        for name in STAT_FIELDS:
            value = getattr(snap, name)
            full, doc = f"{self._namespace}_{name}", FIELD_HELP[name]
            if name == "mode":
                info = InfoMetricFamily(full, doc, labels=names)
                info.add_metric(values, {"mode": str(value)})
                yield info
            elif name in _LABELLED:
                gauge = GaugeMetricFamily(full, doc, labels=[*names, _LABELLED[name]])
                for entry, amount in sorted(value.items()):
                    gauge.add_metric([*values, str(entry)], float(amount))
                yield gauge
            elif name.endswith("_total"):
                counter = CounterMetricFamily(full.removesuffix("_total"), doc, labels=names)
                counter.add_metric(values, float(value))
                yield counter
            else:
                gauge = GaugeMetricFamily(full, doc, labels=names)
                gauge.add_metric(values, float(value))
                yield gauge
