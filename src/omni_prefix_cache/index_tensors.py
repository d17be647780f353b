"""Building int64 index tensors on the engine thread without a Python step
per element (slot ids, owners per row, row offsets)."""

from __future__ import annotations

from array import array

import numpy as np
import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A 1-D int64 tensor of ``values``: one buffer copy, a few times cheaper
    than ``torch.tensor(list)`` (which converts element by element)."""
    if not values:
        return torch.empty((0,), dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def out_of_range(rows: np.ndarray, n: int) -> bool:
    """True if an int64 row id is negative or ``>= n``: one reduction (a
    negative id seen as unsigned is above any ``n``)."""
    return bool(rows.size) and int(np.maximum.reduce(rows.view(np.uint64), axis=None)) >= n


def per_row(values: list[int], counts: list[int]) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as int64 (a count may be 0).

    Not ``torch.repeat_interleave``: its CPU kernel opens a parallel region
    with grain size 1 for any size, which costs milliseconds whenever the
    host's cores are busy. numpy's ``repeat`` is a plain loop; one row
    each (decode) is the values themselves.
    """
    if counts.count(1) == len(counts):
        return int64_tensor(values)
    return torch.from_numpy(np.repeat(np.array(values, dtype=np.int64), np.array(counts, dtype=np.int64)))
