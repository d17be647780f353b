"""``simulate --metrics-out FILE``: the run's metrics as one picture.

One panel per spec machine with timed states (the time-in-state
distribution of each of its ``waits`` states, by histogram bucket), and one
panel of the data path over steps (D2H and pool-write bytes per step).
Needs the ``plots`` extra (matplotlib); everything else about ``simulate``
works without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_prefix_cache.telemetry.registry import TELEMETRY, Telemetry

PLOTS_MISSING = "simulate --metrics-out needs matplotlib: pip install 'omni-prefix-cache[plots]'"


def require_matplotlib() -> None:
    """Raise ImportError with the install hint when matplotlib is absent."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(PLOTS_MISSING) from exc


@dataclass
class StepSampler:
    """A progress callback that records, after every step, the data-path
    byte counters (cumulative), then calls ``inner``."""

    inner: Callable[..., None] | None = None
    telemetry: Telemetry = TELEMETRY
    steps: list[int] = field(default_factory=list)
    d2h: list[float] = field(default_factory=list)
    pool: list[float] = field(default_factory=list)

    def __call__(self, step: int, total: int, sched: Any, res: Any) -> None:
        dp = self.telemetry.datapath
        counters = dp.counters() if dp is not None else {}
        self.steps.append(step)
        self.d2h.append(sum(counters.get("d2h_bytes_total", {}).values()))
        self.pool.append(sum(counters.get("pool_write_bytes_total", {}).values()))
        if self.inner is not None:
            self.inner(step, total, sched, res)


def _per_step(cumulative: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *cumulative], cumulative)]


def write_report(path: Path, sampler: StepSampler, telemetry: Telemetry = TELEMETRY) -> None:
    """Draw the picture into ``path`` (PNG, or any format matplotlib infers
    from the suffix). Raises ImportError (the install hint) without matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_machine: dict[str, dict[str, Any]] = {}
    for (machine, state), summary in sorted(telemetry.time_in_state().items()):
        by_machine.setdefault(machine, {})[state] = summary
    panels = len(by_machine) + 1
    cols = 2
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 2.8 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (machine, states) in zip(flat, by_machine.items()):
        for state, summary in states.items():
            bounds = [b for b, _ in summary.buckets]
            counts = [b - a for a, b in zip([0, *[n for _, n in summary.buckets]], [n for _, n in summary.buckets])]
            labels = ["inf" if b == float("inf") else f"{b:g}" for b in bounds]
            p50 = summary.quantile(0.5)
            note = f"n={summary.count}" + (f", p50={p50 * 1e3:.3g} ms" if p50 is not None else "")
            ax.plot(range(len(labels)), counts, marker="o", label=f"{state} ({note})")
            ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.set_title(f"{machine}: time in state (s, bucket upper bound)", fontsize=9)
        ax.set_ylabel("stays", fontsize=8)
        ax.legend(fontsize=7)
    ax = flat[len(by_machine)]
    ax.plot(sampler.steps, [b / 1e6 for b in _per_step(sampler.d2h)], label="D2H MB / step")
    ax.plot(sampler.steps, [b / 1e6 for b in _per_step(sampler.pool)], label="pool write MB / step", alpha=0.7)
    ax.set_title("data path over steps", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.legend(fontsize=7)
    for extra in flat[panels:]:
        extra.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
