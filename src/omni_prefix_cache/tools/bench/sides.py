"""``bench --metrics both``: every (scenario, mode) run with the runtime
metrics off and on in the same invocation, and the on/off ratios; and
``bench --scrape HZ``: every (scenario, mode) run without and with a thread
scraping the collector (metrics on in both), and the with/without ratios.

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
from omni_prefix_cache.tools.bench.measure import ManagerFactory, TimedHook
from omni_prefix_cache.tools.bench.results import MetricsPair, ScenarioResult, ScrapePair
from omni_prefix_cache.tools.bench.scrape import ScrapeOf, ScrapeRun

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


# One (scenario, mode) run: built with the factory handed (None: the bench's
# default), with the ``run_scenario(during_timed=...)`` hook handed.
RunOne = Callable[[ManagerFactory | None, TimedHook | None], ScenarioResult]


def pair_order(index: int, first: str, second: str) -> tuple[str, str]:
    """Which side of pair ``index`` runs first: ``first`` on even pairs,
    ``second`` on odd ones, so a steady drift cancels over two pairs."""
    return (first, second) if index % 2 == 0 else (second, first)


def run_sides(order: tuple[str, str], run_side: Callable[[str], ScenarioResult]) -> dict[str, ScenarioResult]:
    """``run_side(side)`` for the two sides in ``order``, back to back, the
    metrics switch off before each (a run built with metrics switches it
    on afresh) and after the last."""
    got: dict[str, ScenarioResult] = {}
    for side in order:
        TELEMETRY.disable()
        got[side] = run_side(side)
    TELEMETRY.disable()
    return got


def run_pair(run: RunOne, index: int, factory: ManagerFactory | None) -> MetricsPair:
    """Run one (scenario, mode) off and on via ``run(factory, None)``; pair
    ``index`` picks the order (even: off first). ``factory``: the off side's
    (None: the bench's default); the on side's is ``with_metrics(factory)``."""
    summary: dict[str, Any] = {}

    def side(name: str) -> ScenarioResult:
        nonlocal summary
        if name == "off":
            return run(factory, None)
        result = run(with_metrics(factory), None)
        summary = TELEMETRY.summary()
        return result

    order = pair_order(index, "off", "on")
    got = run_sides(order, side)
    return MetricsPair(off=got["off"], on=got["on"], order=order, on_metrics=summary)


def run_scrape_pair(
    run: RunOne, index: int, factory: ManagerFactory | None, hz: float, scrape_of: ScrapeOf | None = None
) -> ScrapePair:
    """Run one (scenario, mode) without and with a thread scraping the
    collector at ``hz`` across the timed steps (``scrape.ScrapeRun``); pair
    ``index`` picks the order (even: without first). Both sides are built
    by ``with_metrics(factory)``: a scrape of a manager without metrics
    reads only its snapshot, and with metrics on in both the ratio is the
    scrape's alone."""
    hook = ScrapeRun(hz, scrape_of)
    order = pair_order(index, "without", "with")
    got = run_sides(order, lambda name: run(with_metrics(factory), hook if name == "with" else None))
    assert hook.stats is not None  # set when the scraped run's timed steps ended
    return ScrapePair(without=got["without"], scraped=got["with"], order=order, stats=hook.stats)


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


def _opt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


SCRAPE_HEAD = (
    f"{'scenario':<13} {'mode':<8} {'engine w/o':>10} {'with':>9} {'w/w/o':>7} "
    f"{'step w/o':>9} {'with':>9} {'w/w/o':>7} {'scrapes':>7} {'of':>5} {'scrape us':>9} {'first':>7}"
)


def scrape_lines(pairs: list[ScrapePair]) -> list[str]:
    """The scrape table: engine and step p50 (us) without and with the
    scrape thread, with / without, the scrapes done (of the schedule's
    slots in the window) and their p50 duration (us)."""
    hz = ", ".join(sorted({f"{p.stats.hz:g}" for p in pairs}))
    lines = [
        "",
        f"scraping the collector at {hz} Hz (generate_latest over the manager, metrics on in both sides; p50 us; "
        "each pair back to back, first side alternating):",
        SCRAPE_HEAD,
        "-" * len(SCRAPE_HEAD),
    ]
    for p in pairs:
        w, s, st = p.without, p.scraped, p.stats
        lines.append(
            f"{p.name:<13} {p.mode:<8} {w.engine_us_p50:>10.1f} {s.engine_us_p50:>9.1f} "
            f"{_x(p.ratio('engine_us_p50')):>7} {w.step_us_p50:>9.1f} {s.step_us_p50:>9.1f} "
            f"{_x(p.ratio('step_us_p50')):>7} {st.scrapes:>7} {st.scheduled:>5} {_opt_us(st.us_p50):>9} "
            f"{p.order[0]:>7}"
        )
    return lines
