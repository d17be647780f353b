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


def per_row(values: list[int], counts: list[int], total: int) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as int64.

    Not ``torch.repeat_interleave``: its CPU kernel opens a parallel region
    with grain size 1 for any size, which costs milliseconds whenever the
    host's cores are busy. A decode step (one row per request) is a plain
    tensor; few long runs are one fill per run; otherwise a Python repeat.
    """
    if total == len(values):
        return int64_tensor(values)
    if total > 32 * len(values):
        return torch.cat([torch.full((c,), v, dtype=torch.int64) for v, c in zip(values, counts)])
    return int64_tensor(list(itertools.chain.from_iterable(itertools.repeat(v, c) for v, c in zip(values, counts))))
