"""Building int64 index tensors on the engine thread without a Python step
per element (slot ids, owners per row, row offsets)."""

from __future__ import annotations

import itertools
from array import array

import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A 1-D int64 tensor of ``values``: one buffer copy, a few times cheaper
    than ``torch.tensor(list)`` (which converts element by element)."""
    if not values:
        return torch.empty((0,), dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def per_row(values: list[int], counts: list[int]) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as int64 (a count may be 0).

    Not ``torch.repeat_interleave``: its CPU kernel opens a parallel region
    with grain size 1 for any size, which costs milliseconds whenever the
    host's cores are busy. One row each (decode) is the values themselves;
    otherwise the value changes only at each run's first row, so the rows
    are the cumulative sum of those jumps: a few tensor ops for any count.
    """
    if counts.count(1) == len(counts):
        return int64_tensor(values)
    kept = [(v, c) for v, c in zip(values, counts) if c > 0]
    total = sum(c for _, c in kept)
    if not total:
        return torch.empty((0,), dtype=torch.int64)
    firsts = int64_tensor(list(itertools.accumulate((c for _, c in kept), initial=0))[:-1])
    runs = int64_tensor([v for v, _ in kept])
    jumps = torch.diff(runs, prepend=runs.new_zeros(1))
    return torch.zeros(total, dtype=torch.int64).index_copy_(0, firsts, jumps).cumsum_(0)
