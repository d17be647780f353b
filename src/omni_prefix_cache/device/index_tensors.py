"""Building int64 index tensors on the engine thread without a Python step
per element (slot ids, owners per row, row offsets)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A 1-D int64 tensor of ``values``: one buffer copy, a few times cheaper
    than ``torch.tensor(list)`` (which converts element by element)."""
    if not values:
        return torch.empty((0,), dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


# Up to this many values, a reduction over them (out_of_range, all_set) reads
# them as Python ints. Inside a real step numpy's reduction runs with cold
# caches (about 5 us, against 1 us in a loop): measured with the bench,
# Python ints win at 64 values and lose at 256.
FEW_IDS = 128


def out_of_range(rows: np.ndarray, n: int) -> bool:
    """True if an int64 row id is negative or ``>= n``: one reduction (a
    negative id seen as unsigned is above any ``n``); up to ``FEW_IDS``
    ids (a decode step's) as Python ints, cheaper than a ufunc call."""
    size = rows.size
    if size == 0:
        return False
    if size <= FEW_IDS and rows.ndim == 1:
        ids: list[int] = rows.tolist()
        return min(ids) < 0 or max(ids) >= n
    return int(np.maximum.reduce(rows.view(np.uint64), axis=None)) >= n


def all_set(mask: np.ndarray) -> bool:
    """True if every value of the 1-D bool ``mask`` is set (up to
    ``FEW_IDS`` values as Python bools)."""
    if mask.size <= FEW_IDS:
        return all(mask.tolist())
    return bool(mask.all())


def uniform_value(values: np.ndarray) -> int | None:
    """The value every element of the non-empty 1-D int ``values`` holds,
    or None (up to ``FEW_IDS`` values as Python ints)."""
    if values.size <= FEW_IDS:
        ints: list[int] = values.tolist()
        return ints[0] if ints.count(ints[0]) == len(ints) else None
    first = int(values[0])
    return first if bool((values == first).all()) else None


def per_row(values: list[int], counts: list[int]) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as int64 (a count may be 0).

    Not ``torch.repeat_interleave``: its CPU kernel opens a parallel region
    with grain size 1 for any size, which costs milliseconds whenever the
    host's cores are busy. numpy's ``repeat`` is a plain loop; one row
    each (decode) is the values themselves.
    """
    return torch.from_numpy(per_row_ids(values, counts))


def per_row_ids(values: list[int], counts: list[int]) -> np.ndarray:
    """``per_row`` as a 1-D int64 numpy array, for a caller that indexes
    numpy tables with it (no tensor to convert back)."""
    if len(values) == 1:  # one writer (a step's write): no list to convert
        return np.full(counts[0], values[0], dtype=np.int64)
    ids = np.array(values, dtype=np.int64)
    if counts.count(1) == len(counts):
        return ids
    return np.repeat(ids, np.array(counts, dtype=np.int64))


def int64_ids(slots: torch.Tensor) -> np.ndarray:
    """Ids (slots, tids) as a 1-D int64 numpy array: a view of a CPU int64
    tensor, else a converted copy."""
    if slots.dtype != torch.int64 or not slots.is_cpu:
        slots = slots.detach().to("cpu", torch.int64)
    return slots.numpy().reshape(-1)


class SlotMarks:
    """A bool table over a pool's slots, all False between calls, for
    "which of these groups of slots share a slot with those": the slots
    are marked, each group's marks summed with one cumulative sum, and the
    table cleared, whatever the number of groups (a group may be empty)."""

    def __init__(self) -> None:
        self._marks: np.ndarray | None = None

    def overlaps(self, num_slots: int, slots: torch.Tensor, groups: Sequence[torch.Tensor | np.ndarray]) -> list[bool]:
        """Per group, whether it holds one of ``slots`` (all ids in
        ``[0, num_slots)``; an id outside raises IndexError and leaves the
        table clear). A group may be given as its int64 numpy ids already."""
        if not groups:
            return []
        marks = self._marks
        if marks is None or marks.size != num_slots:
            marks = self._marks = np.zeros(num_slots, dtype=np.bool_)
        rows = int64_ids(slots)
        parts = [g if isinstance(g, np.ndarray) else int64_ids(g) for g in groups]
        marks[rows] = True
        try:
            hit = marks[np.concatenate(parts)]
        finally:
            marks[rows] = False
        # The usual answer (a reuse that no live read or planned hit holds):
        # one reduction, not the per-group sums below.
        if not hit.any():
            return [False] * len(parts)
        sizes = [part.size for part in parts]
        ends = np.cumsum(sizes)
        counts = np.concatenate(([0], np.cumsum(hit, dtype=np.int64)))
        touched: list[bool] = (counts[ends] > counts[ends - sizes]).tolist()
        return touched
