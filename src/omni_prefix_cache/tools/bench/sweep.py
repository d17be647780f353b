"""The decode batch sweep: ``decode`` at several batch sizes (eager), held
to a spread target of engine us per request, with a least-squares split of
the engine time into a fixed and a per-request cost."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SWEEP_SIZES = (16, 64, 256)
SWEEP_TARGET = 1.30  # max/min engine us per request across the sweep


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b * x``: ``(a, b)``; None when fewer than two
    distinct x values."""
    if len({x for x, _ in points}) < 2:
        return None
    b, a = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return a, b


def fixed_cost_allowed(per_request: float, n_min: float, n_max: float, target: float) -> float | None:
    """The largest fixed per-step cost ``a`` for which the per-request cost
    ``a / n + per_request`` varies at most ``target``-fold between ``n_min``
    and ``n_max`` requests per step: infinite when the batch sizes are
    within ``target`` of each other (any fixed cost is), None for a
    non-positive per-request cost."""
    denom = 1.0 / n_min - target / n_max
    if per_request <= 0 or denom <= 0:
        return None if per_request <= 0 else float("inf")
    return per_request * (target - 1.0) / denom


def spread(per_request: Sequence[float]) -> float:
    """Max over min of the sweep's per-request costs (1.0: flat)."""
    return max(per_request) / min(per_request)
