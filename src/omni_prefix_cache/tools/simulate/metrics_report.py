"""``simulate --metrics-out FILE``: the run's metrics as one picture.

One panel per spec machine with timed states (the time-in-state
distribution of each of its ``waits`` states, by histogram bucket), one of
the data path's volume over steps (D2H and pool-write MB per step), and one
of its throughput over steps: bytes over the copy and pool-write time the
telemetry measured (``d2h_seconds`` / ``device_copy_seconds``,
``pool_write_seconds``), per step and over a rolling window. Needs the
``plots`` extra (matplotlib); everything else about ``simulate`` works
without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_prefix_cache.telemetry.registry import TELEMETRY, Telemetry

PLOTS_MISSING = "simulate --metrics-out needs matplotlib: pip install 'omni-prefix-cache[plots]'"
# Steps per point of the throughput panel's rolling line (bytes and seconds summed over them).
THROUGHPUT_WINDOW = 20
DPI = 60
PNG_COLORS = 128


def require_matplotlib() -> None:
    """Raise ImportError with the install hint when matplotlib is absent."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(PLOTS_MISSING) from exc


def _family_sum(histograms: dict[str, dict[str, Any]], family: str, label: str | None = None) -> float:
    """Seconds observed in ``family`` (at ``label``, or over all its labels)."""
    series = histograms.get(family, {})
    return float(sum(h.sum for lab, h in series.items() if label is None or lab == label))


@dataclass
class StepSampler:
    """A progress callback that records, after every step, the data-path
    byte counters and the seconds their copies and writes took (all
    cumulative), then calls ``inner``. Seconds: ``d2h_host_s`` the host
    copies' thread CPU time, ``d2h_device_s`` the copy lane's CUDA-event
    time (0 without CUDA), ``pool_s`` the pool writes' thread CPU time."""

    inner: Callable[..., None] | None = None
    telemetry: Telemetry = TELEMETRY
    steps: list[int] = field(default_factory=list)
    d2h: list[float] = field(default_factory=list)
    pool: list[float] = field(default_factory=list)
    d2h_host_s: list[float] = field(default_factory=list)
    d2h_device_s: list[float] = field(default_factory=list)
    pool_s: list[float] = field(default_factory=list)

    def __call__(self, step: int, total: int, sched: Any, res: Any) -> None:
        dp = self.telemetry.datapath
        counters = dp.counters() if dp is not None else {}
        hists: dict[str, dict[str, Any]] = dp.histograms() if dp is not None else {}
        self.steps.append(step)
        self.d2h.append(sum(counters.get("d2h_bytes_total", {}).values()))
        self.pool.append(sum(counters.get("pool_write_bytes_total", {}).values()))
        self.d2h_host_s.append(_family_sum(hists, "d2h_seconds"))
        self.d2h_device_s.append(_family_sum(hists, "device_copy_seconds", "copy"))
        self.pool_s.append(_family_sum(hists, "pool_write_seconds"))
        if self.inner is not None:
            self.inner(step, total, sched, res)

    def d2h_clock(self) -> tuple[list[float], str]:
        """The D2H seconds to divide by and the clock's name: the copy lane's
        CUDA events when the run timed any (every D2H copy on CUDA runs on
        that lane; the host clock there times only the launch), else the
        copying thread's CPU time."""
        if self.d2h_device_s and self.d2h_device_s[-1] > 0:
            return self.d2h_device_s, "CUDA events"
        return self.d2h_host_s, "thread CPU time"


def _per_step(cumulative: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *cumulative], cumulative)]


def throughput(nbytes: list[float], seconds: list[float], window: int = 1) -> list[float | None]:
    """MB/s per sample from cumulative ``nbytes`` and ``seconds``: the bytes
    moved over the last ``window`` samples divided by the seconds measured
    for them (None where no time was measured: nothing moved)."""
    out: list[float | None] = []
    for i, (b, s) in enumerate(zip(nbytes, seconds)):
        j = i - window
        b0, s0 = (nbytes[j], seconds[j]) if j >= 0 else (0.0, 0.0)
        out.append((b - b0) / (s - s0) / 1e6 if s > s0 else None)
    return out


def _draw_states(ax: Any, machine: str, states: dict[str, Any]) -> None:
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


def _draw_volume(ax: Any, sampler: StepSampler) -> None:
    ax.plot(sampler.steps, [b / 1e6 for b in _per_step(sampler.d2h)], label="D2H", lw=0.8)
    ax.plot(sampler.steps, [b / 1e6 for b in _per_step(sampler.pool)], label="pool write", lw=0.8, alpha=0.7)
    ax.set_title("data path volume over steps", fontsize=9)
    ax.set_ylabel("MB / step", fontsize=8)
    ax.set_xlabel("step", fontsize=8)
    ax.legend(fontsize=7)


def _draw_throughput(ax: Any, sampler: StepSampler) -> None:
    d2h_s, clock = sampler.d2h_clock()
    series = (
        ("D2H", sampler.d2h, d2h_s, "C0"),
        ("pool write", sampler.pool, sampler.pool_s, "C1"),
    )
    for name, nbytes, seconds, color in series:
        per_step = throughput(nbytes, seconds)
        xs = [s for s, v in zip(sampler.steps, per_step) if v is not None]
        ax.scatter(xs, [v for v in per_step if v is not None], s=4, color=color, alpha=0.4, linewidths=0)
        rolling = throughput(nbytes, seconds, THROUGHPUT_WINDOW)
        total = nbytes[-1] / seconds[-1] / 1e6 if seconds and seconds[-1] > 0 else None
        label = f"{name}, {THROUGHPUT_WINDOW}-step window" + ("" if total is None else f" (run: {total:.0f} MB/s)")
        ax.plot(sampler.steps, [float("nan") if v is None else v for v in rolling], color=color, label=label)
    ax.set_yscale("log")
    ax.set_title(f"data path throughput over steps (dots: one step; line: {THROUGHPUT_WINDOW}-step window)", fontsize=9)
    clocks = clock if clock == "thread CPU time" else f"D2H: {clock},\npool write: thread CPU time"
    ax.set_ylabel(f"MB/s\n(over {clocks})", fontsize=8)
    ax.set_xlabel("step", fontsize=8)
    ax.legend(fontsize=7)


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
    cols = 2
    grid_panels = len(by_machine) + 1  # the machines and the volume; the throughput takes a whole row
    rows = (grid_panels + cols - 1) // cols + 1
    fig = plt.figure(figsize=(6.0 * cols, 2.8 * rows))
    grid = fig.add_gridspec(rows, cols)
    cells = [fig.add_subplot(grid[i // cols, i % cols]) for i in range(grid_panels)]
    for ax, (machine, states) in zip(cells, by_machine.items()):
        _draw_states(ax, machine, states)
    _draw_volume(cells[-1], sampler)
    _draw_throughput(fig.add_subplot(grid[rows - 1, :]), sampler)
    fig.tight_layout()
    if Path(path).suffix.lower() == ".png":
        _save_png(fig, Path(path))
    else:
        fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _save_png(fig: Any, path: Path) -> None:
    """``fig`` as a palette PNG: a line plot has few colours, and 128 of them
    keep it as drawn at about a third of the RGBA file's size (the docs keep
    one). Pillow comes with matplotlib."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=PNG_COLORS, method=Image.Quantize.MEDIANCUT).save(
            path, format="PNG", optimize=True
        )
