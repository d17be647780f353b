"""The runtime metrics (``telemetry``) as Prometheus families, with their
histogram buckets; used by ``ops.metrics.OmniPrefixCacheCollector``.

Reading them sums each series' per-thread rows (``telemetry.shards``),
taking only the series' own registration lock to copy its list of rows,
never the manager's or the controller's, and never a lock an observing
thread takes: a scrape does not hold up the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from omni_prefix_cache.telemetry.datapath import FAMILIES
from omni_prefix_cache.telemetry.histogram import HistogramSummary
from omni_prefix_cache.telemetry.registry import Telemetry


def _buckets(summary: HistogramSummary) -> list[tuple[str, float]]:
    return [("+Inf" if bound == float("inf") else repr(bound), float(n)) for bound, n in summary.buckets]


def telemetry_families(
    telemetry: Telemetry, namespace: str, names: Sequence[str], values: Sequence[str]
) -> Iterable[Metric]:
    """Every series of ``telemetry`` (nothing while it is off), each with
    the constant labels ``names`` = ``values``."""
    if not telemetry.enabled:
        return
    moves = CounterMetricFamily(
        f"{namespace}_spec_moves",
        "Moves of each spec machine, by trigger, source and dest state",
        labels=[*names, "machine", "trigger", "source", "dest"],
    )
    for (machine, trigger, source, dest), n in sorted(telemetry.move_counts().items()):
        moves.add_metric([*values, machine, trigger, source, dest], float(n))
    yield moves
    stays = HistogramMetricFamily(
        f"{namespace}_time_in_state_seconds",
        "Time an instance spent in a state its spec tags waits, by machine and state",
        labels=[*names, "machine", "state"],
    )
    for (machine, state), summary in sorted(telemetry.time_in_state().items()):
        stays.add_metric([*values, machine, state], _buckets(summary), summary.sum)
    yield stays
    dp = telemetry.datapath
    if dp is None:
        return
    counters, histograms = dp.counters(), dp.histograms()
    for family in FAMILIES:
        full = f"{namespace}_{family.name}"
        if family.kind == "counter":
            counter = CounterMetricFamily(full.removesuffix("_total"), family.help, labels=[*names, family.label])
            for label, value in counters.get(family.name, {}).items():
                counter.add_metric([*values, label], value)
            yield counter
        else:
            hist = HistogramMetricFamily(full, family.help, labels=[*names, family.label])
            for label, summary in histograms.get(family.name, {}).items():
                hist.add_metric([*values, label], _buckets(summary), summary.sum)
            yield hist
