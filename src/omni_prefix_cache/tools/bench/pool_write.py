"""The pool write's paths timed alone, on warm slabs: ``index_copy_`` (the
row path before), numpy row by row through the slab's integer view, and
the block path the pool takes (``device.row_scatter``: whole blocks as
block copies, the rest by row), for prefill and decode shapes.

Each shape writes the same rows at the same slots every iteration into a
slab written once before timing (no first-touch faults), p50 of
``ITERS`` runs; GB/s is the rows' bytes over that time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from omni_prefix_cache.block_pool import zeroed_host
from omni_prefix_cache.device.row_scatter import BLOCKS_BELOW_ROW_BYTES, SlabScatter

BLOCK_SIZE = 16
NUM_BLOCKS = 1024
ITERS = 15
# index_copy_: the pool's row path before; rows: numpy one row at a time;
# blocks: leading whole blocks as blocks at any row width; pool: what the pool
# does now (blocks only below BLOCKS_BELOW_ROW_BYTES a row).
PATHS = ("index_copy_", "rows", "blocks", "pool")


@dataclass(frozen=True, slots=True)
class PoolWriteTiming:
    """One (shape, width, path): microseconds p50 and GB/s."""

    shape: str
    width: int
    rows: int
    whole_block_rows: int
    path: str
    us_p50: float
    gb_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _slots(shape: str, gen: torch.Generator) -> torch.Tensor:
    """A step's slots: ``prefill`` 2048 rows in 128 whole blocks, ``prefill_misaligned``
    8 requests of 256 rows each starting 5 rows into a block (15 whole blocks
    and two partial ones each), ``decode``/``decode_256`` one row per request."""
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    offsets = torch.arange(BLOCK_SIZE)
    if shape == "prefill":
        return (blocks[:128, None] * BLOCK_SIZE + offsets).reshape(-1)
    if shape == "prefill_misaligned":
        runs = (blocks[:136].reshape(8, 17)[:, :, None] * BLOCK_SIZE + offsets).reshape(8, -1)
        return runs[:, 5 : 5 + 256].reshape(-1)
    n = 64 if shape == "decode" else 256
    return blocks[:n] * BLOCK_SIZE + torch.randint(0, BLOCK_SIZE, (n,), generator=gen)


def _p50(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(ITERS):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return sorted(times)[len(times) // 2] / 1000.0


def time_pool_writes(
    shapes: tuple[str, ...] = ("prefill", "prefill_misaligned", "decode", "decode_256"),
    widths: tuple[int, ...] = (2048, 128, 16),
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> list[PoolWriteTiming]:
    """Every (shape, width) written each way in ``PATHS``; the widths are
    the bench's hidden, mm and deferred keys'."""
    gen = torch.Generator().manual_seed(seed)
    out: list[PoolWriteTiming] = []
    for width in widths:
        slab = zeroed_host(NUM_BLOCKS * BLOCK_SIZE, width, dtype)
        slab.fill_(1)  # every page written once: no first-touch faults in the timed writes
        view = SlabScatter.of(slab, BLOCK_SIZE)
        assert view is not None  # a fresh slab always has one
        rows_only = dataclasses.replace(view, blocks=None)
        forced = SlabScatter.of(slab, BLOCK_SIZE, blocks_below_row_bytes=2**62)
        assert forced is not None
        for shape in shapes:
            slots = _slots(shape, gen)
            host = torch.randn((int(slots.numel()), width), generator=gen).to(dtype)
            index = slots.numpy()
            source = view.source(host)
            assert source is not None
            paths: dict[str, tuple[Callable[[], object], int]] = {
                "index_copy_": (partial(slab.index_copy_, 0, slots, host), 0),
                "rows": (partial(rows_only.scatter, index, source), 0),
                "blocks": (partial(forced.scatter, index, source), forced.scatter(index, source)),
                "pool": (partial(view.scatter, index, source), view.scatter(index, source)),
            }
            for path in PATHS:
                fn, whole = paths[path]
                us = _p50(fn)
                out.append(PoolWriteTiming(shape, width, int(slots.numel()), whole, path, us, host.nbytes / us / 1e3))
    return out


def pool_write_lines(timings: list[PoolWriteTiming]) -> list[str]:
    """The table: one line per (shape, width), the three paths' us and GB/s side by side."""
    if not timings:
        return []
    head = f"  {'shape':<19} {'width':>5} {'rows':>5} {'whole':>5}" + "".join(f" {p:>22}" for p in PATHS)
    lines = [
        "",
        "pool write alone (warm slab, bf16, block size 16; us p50 and GB/s): index_copy_ the row path before,",
        "  rows numpy one row at a time, blocks the leading whole blocks as blocks at any width (whole: their rows),",
        f"  pool what PrefixBlockPool.write does (blocks only for rows under {BLOCKS_BELOW_ROW_BYTES} B)",
    ]
    lines += [head, "  " + "-" * (len(head) - 2)]
    by_case: dict[tuple[str, int], dict[str, PoolWriteTiming]] = {}
    for t in timings:
        by_case.setdefault((t.shape, t.width), {})[t.path] = t
    for (shape, width), paths in by_case.items():
        first = paths.get("blocks", next(iter(paths.values())))
        cells = "".join(
            f" {paths[p].us_p50:>8.1f} us {paths[p].gb_per_s:>5.1f} GB/s" if p in paths else f" {'-':>22}"
            for p in PATHS
        )
        lines.append(f"  {shape:<19} {width:>5} {first.rows:>5} {first.whole_block_rows:>5}{cells}")
    return lines
