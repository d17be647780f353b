"""``bench --metrics both``: every (scenario, mode) run with the runtime
metrics off and on in the same invocation, and the on/off ratios.

The two sides of a pair run back to back and the order alternates from pair
to pair (off then on, on then off, ...), so a machine that drifts during the
run (another job starting, a CPU clocking down) moves both sides alike and a
steady drift cancels over two pairs instead of always charging one side.

Metrics are a process switch (``TELEMETRY``): before every run of a pair it
is switched off, so an off run builds its manager with plain locks and no
recorders, and an on run's manager (``PrefixCacheConfig.metrics=True``)
switches it on with fresh series; the on run's summary is read right after
it. Callers restore the switch afterwards (``runner.run_bench``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.tools.bench.measure import ManagerFactory
from omni_prefix_cache.tools.bench.results import MetricsPair, ScenarioResult

METRICS_CHOICES = ("off", "on", "both")


def default_factory(cfg: PrefixCacheConfig, view: Any, eager: bool) -> Any:
    """The bench's manager: ``OmniPrefixCacheManager`` as configured."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(cfg, view, eager=eager)


def with_metrics(factory: ManagerFactory | None = None) -> ManagerFactory:
    """``factory`` (default ``default_factory``) with ``metrics=True`` in the
    config it is handed (``bench --metrics on``, and the on side of ``both``)."""
    inner = factory or default_factory

    def build(cfg: PrefixCacheConfig, view: Any, eager: bool) -> Any:
        return inner(dataclasses.replace(cfg, metrics=True), view, eager)

    return build


RunOne = Callable[[ManagerFactory | None], ScenarioResult]


def run_pair(run: RunOne, index: int, factory: ManagerFactory | None) -> MetricsPair:
    """Run one (scenario, mode) off and on via ``run(factory)``; pair
    ``index`` picks the order (even: off first). ``factory``: the off side's
    (None: the bench's default); the on side's is ``with_metrics(factory)``."""
    order: tuple[str, str] = ("off", "on") if index % 2 == 0 else ("on", "off")
    got: dict[str, ScenarioResult] = {}
    summary: dict[str, Any] = {}
    for side in order:
        TELEMETRY.disable()
        if side == "on":
            got[side] = run(with_metrics(factory))
            summary = TELEMETRY.summary()
        else:
            got[side] = run(factory)
    TELEMETRY.disable()
    return MetricsPair(off=got["off"], on=got["on"], order=order, on_metrics=summary)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


SIDE_HEAD = (
    f"{'scenario':<13} {'mode':<8} {'engine off':>10} {'on':>9} {'on/off':>7} "
    f"{'mat. off':>9} {'on':>9} {'on/off':>7} {'step on/off':>11} {'cpu on/off':>10} {'first':>5}"
)


def side_by_side_lines(pairs: list[MetricsPair]) -> list[str]:
    """The side-by-side table: engine and materialize p50 (us) off and on
    with on/off, and the on/off of the step total and of the engine's CPU time."""
    lines = [
        "",
        "metrics off vs on (PrefixCacheConfig.metrics; p50 us; each pair back to back, first side alternating):",
        SIDE_HEAD,
        "-" * len(SIDE_HEAD),
    ]
    for p in pairs:
        lines.append(
            f"{p.name:<13} {p.mode:<8} {p.off.engine_us_p50:>10.1f} {p.on.engine_us_p50:>9.1f} "
            f"{_x(p.ratio('engine_us_p50')):>7} {p.off.materialize_us_p50:>9.1f} {p.on.materialize_us_p50:>9.1f} "
            f"{_x(p.ratio('materialize_us_p50')):>7} {_x(p.ratio('step_us_p50')):>11} "
            f"{_x(p.ratio('engine_cpu_us_p50')):>10} {p.order[0]:>5}"
        )
    return lines
