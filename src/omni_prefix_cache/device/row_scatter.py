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
request (decode). A write whose leading rows fill whole blocks in order
(slots ``b * block_size + 0 .. block_size - 1`` per block: a prefill
chunk, a deferred key's whole request) writes them over a ``(num_blocks,
block_size * width)`` view of the slab in one assignment (the source's
rows viewed, never gathered), and the rest from its first partial block on
row by row. A write starting mid-block and decode's single rows go row by
row: finding whole blocks further inside would cost more numpy calls than
copying those rows as blocks saves. Only narrow rows try blocks at all
(``BLOCKS_BELOW_ROW_BYTES``): numpy copies a row of a few hundred bytes one
by one about as fast as a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Integer views tried, widest first: fewer, wider elements per row.
_INT_VIEWS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
# Only rows narrower than this look for whole blocks. Measured (numpy fancy
# assignment into a warm slab, 2048 rows in 128 whole blocks of 16, one
# core): one by one against as blocks, 4 KiB rows
# 589 / 584 us, 1 KiB 145 / 141, 512 B 61 / 41, 256 B 20 / 11, 32 B 17 / 2.6;
# finding the blocks costs 10-16 us per 2048 rows and 1.5 us per 64 (numpy
# calls), so they pay only below 64 B a row (a narrow deferred key's whole
# request), and a 4 KiB hidden row never gains.
BLOCKS_BELOW_ROW_BYTES = 64


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
    (one row per block; None when the slab's rows are not contiguous, or
    wide enough that one by one is as fast), the write target of
    ``scatter``."""

    rows: np.ndarray
    blocks: np.ndarray | None
    block_size: int
    view_dtype: torch.dtype  # the integer type both views hold

    @classmethod
    def of(
        cls, slab: torch.Tensor, block_size: int, blocks_below_row_bytes: int = BLOCKS_BELOW_ROW_BYTES
    ) -> SlabScatter | None:
        """The views of ``slab`` (``(num_blocks * block_size, width)``), or
        None when it has no integer view (the caller copies with torch); a
        block view only for rows narrower than ``blocks_below_row_bytes``."""
        rows = int_view(slab)
        if rows is None or block_size <= 0 or rows.shape[0] % block_size:
            return None
        blocks = None
        if rows.flags.c_contiguous and rows.shape[1] * rows.itemsize < blocks_below_row_bytes:
            blocks = rows.reshape(rows.shape[0] // block_size, block_size * rows.shape[1])
        view_dtype = next(dtype for size, dtype in _INT_VIEWS if size == rows.itemsize)
        return cls(rows, blocks, int(block_size), view_dtype)

    def source(self, host: torch.Tensor) -> np.ndarray | None:
        """``host`` (CPU rows of the slab's dtype and width) viewed as the
        slab's integer type, or None when it cannot be (its offset or
        strides are not a multiple of that type's size)."""
        try:
            return (host.detach() if host.requires_grad else host).view(self.view_dtype).numpy()
        except (RuntimeError, TypeError):
            return None

    def scatter(self, slots: np.ndarray, host: np.ndarray) -> int:
        """Write ``host`` (``source`` of the rows, one per slot) at ``slots``
        (int64, each in range; a slot listed twice takes one of its rows).
        Returns how many rows went as whole blocks: the leading rows, as
        far as they fill whole blocks in order, as one assignment over the
        block view; every other row (a partial tail, whatever follows the
        first partial block, a write starting mid-block, decode's single
        rows) one by one."""
        bs = self.block_size
        blocks = self.blocks
        n = int(slots.shape[0])
        if blocks is None or n < bs or not host.flags.c_contiguous or not leads_with_a_block(slots, bs):
            self.rows[slots] = host
            return 0
        grid = slots[: n - n % bs].reshape(n // bs, bs)
        first = grid[:, 0]
        whole_block = ((grid - first[:, None]) == np.arange(bs)).all(axis=1) & (first % bs == 0)
        # The leading run of whole blocks (may be none: leads_with_a_block reads two slots only).
        lead = int(whole_block.size) if whole_block.all() else int(np.argmin(whole_block))
        whole = lead * bs
        blocks[first[:lead] // bs] = host[:whole].reshape(lead, blocks.shape[1])
        if whole < n:
            self.rows[slots[whole:]] = host[whole:]
        return whole


def leads_with_a_block(slots: np.ndarray, block_size: int) -> bool:
    """Cheap necessary test (two scalar reads) that ``slots`` opens with a
    whole block: its first slot starts a block and the ``block_size``-th
    slot is ``block_size - 1`` after it. Decode's rows fail it at once."""
    bs = int(block_size)
    if slots.shape[0] < bs:
        return False
    first = int(slots[0])
    return first % bs == 0 and int(slots[bs - 1]) == first + bs - 1
