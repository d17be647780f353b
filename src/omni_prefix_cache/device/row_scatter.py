"""Writing rows into a host slab at memory bandwidth: whole blocks as
block-granular copies, the rest row by row.

``torch.Tensor.index_copy_`` copies a CPU row element by element (2-3x
slower than a plain copy for 4 KiB rows, and it spreads over the
intra-op threads to get there). numpy's fancy assignment copies each
indexed row as one strided block, so on a zero-copy integer view of the
same memory it runs at memcpy speed. A bitwise copy through an integer
view of the same element size or wider is exact for every dtype (float
payloads, NaNs and signed zeros included), so the view is taken as the
widest of 8, 4, 2, 1 bytes that divides a row.

A step's rows mostly land in runs of whole blocks (prefill) or one row per
request (decode). Rows ``[i, i + block_size)`` of a write whose slots are
``b * block_size + 0 .. block_size - 1`` fill block ``b`` whole: those are
written over a ``(num_blocks, block_size * width)`` view of the slab, one
fancy assignment per run of back-to-back whole blocks of the source (the
source's rows viewed, never gathered). The remaining rows (partial blocks
at either end of a run, decode's single rows) are written row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Integer views tried, widest first: fewer, wider elements per row.
_INT_VIEWS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def int_view(t: torch.Tensor) -> np.ndarray | None:
    """A zero-copy numpy view of 2-D CPU tensor ``t``'s bytes as the widest
    integer that divides its rows (``(rows, row_bytes / size)``), or None
    when no integer view of it can be taken (a strided last dimension, a
    misaligned offset, a dtype numpy cannot hold)."""
    if t.ndim != 2 or t.device.type != "cpu":
        return None
    row_bytes = int(t.shape[1]) * t.element_size()
    for size, dtype in _INT_VIEWS:
        if row_bytes % size:
            continue
        try:
            return t.detach().view(dtype).numpy()
        except (RuntimeError, TypeError):
            continue  # offset or strides not a multiple of ``size``: try a narrower view
    return None


@dataclass(frozen=True, slots=True)
class SlabScatter:
    """A slab's integer views: ``rows`` (one row per slot) and ``blocks``
    (one row per block, None when the slab's rows are not contiguous), the
    write target of ``scatter``."""

    rows: np.ndarray
    blocks: np.ndarray | None
    block_size: int
    view_dtype: torch.dtype  # the integer type both views hold

    @classmethod
    def of(cls, slab: torch.Tensor, block_size: int) -> SlabScatter | None:
        """The views of ``slab`` (``(num_blocks * block_size, width)``), or
        None when it has no integer view (the caller copies with torch)."""
        rows = int_view(slab)
        if rows is None or block_size <= 0 or rows.shape[0] % block_size:
            return None
        blocks = None
        if rows.flags.c_contiguous:
            blocks = rows.reshape(rows.shape[0] // block_size, block_size * rows.shape[1])
        view_dtype = next(dtype for size, dtype in _INT_VIEWS if size == rows.itemsize)
        return cls(rows, blocks, int(block_size), view_dtype)

    def source(self, host: torch.Tensor) -> np.ndarray | None:
        """``host`` (CPU rows of the slab's dtype and width) viewed as the
        slab's integer type, or None when it cannot be (its offset or
        strides are not a multiple of that type's size)."""
        try:
            return host.detach().view(self.view_dtype).numpy()
        except (RuntimeError, TypeError):
            return None

    def scatter(self, slots: np.ndarray, host: np.ndarray) -> int:
        """Write ``host`` (``source`` of the rows, one per slot) at ``slots`` (int64, each in
        range; a slot listed twice takes one of its rows). Returns how many
        rows went as whole blocks."""
        bs = self.block_size
        blocks = self.blocks
        if blocks is None or slots.shape[0] < bs or not host.flags.c_contiguous:
            self.rows[slots] = host
            return 0
        starts = block_starts(slots, bs)
        if starts.size == 0:
            self.rows[slots] = host
            return 0
        width = blocks.shape[1]
        # Runs of back-to-back whole blocks of the source: one view each.
        cuts = np.flatnonzero(np.diff(starts) != bs) + 1
        bounds = [0, *cuts.tolist(), int(starts.size)]
        for a, b in zip(bounds, bounds[1:]):
            first = int(starts[a])
            blocks[slots[starts[a:b]] // bs] = host[first : first + (b - a) * bs].reshape(b - a, width)
        covered = int(starts.size) * bs
        if covered < slots.shape[0]:
            whole = np.zeros(slots.shape[0], dtype=np.bool_)
            whole[(starts[:, None] + np.arange(bs)).reshape(-1)] = True
            rest = np.flatnonzero(~whole)
            self.rows[slots[rest]] = host[rest]
        return covered


def block_starts(slots: np.ndarray, block_size: int) -> np.ndarray:
    """The rows ``i`` (ascending int64) at which ``slots[i : i + block_size]``
    is one whole block: ``slots[i]`` a multiple of ``block_size`` followed by
    its ``block_size - 1`` successors. Whole blocks never overlap."""
    n, bs = int(slots.shape[0]), int(block_size)
    if n < bs:
        return np.empty((0,), dtype=np.int64)
    if bs == 1:
        return np.arange(n, dtype=np.int64)
    step = slots[1:] == slots[:-1] + 1
    if not step.any():  # decode: no two rows back to back
        return np.empty((0,), dtype=np.int64)
    # breaks[i]: how many of the pairs (0, 1) .. (i - 1, i) are not back to back.
    breaks = np.zeros(n, dtype=np.int64)
    np.cumsum(~step, out=breaks[1:])
    m = n - bs + 1
    aligned = slots[:m] % bs == 0
    return np.flatnonzero(aligned & (breaks[bs - 1 :] == breaks[:m])).astype(np.int64, copy=False)
