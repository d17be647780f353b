"""Index tensors built from int lists (index_tensors.py)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from omni_prefix_cache.device.index_tensors import (
    FEW_IDS,
    all_set,
    int64_tensor,
    out_of_range,
    per_row,
    per_row_ids,
    uniform_value,
)
from omni_prefix_cache.reads.materializer import gather_index


@given(st.lists(st.tuples(st.integers(-(2**40), 2**40), st.integers(0, 40)), max_size=30))
def test_per_row_repeats_each_value_its_count(runs: list[tuple[int, int]]) -> None:
    values, counts = [v for v, _ in runs], [c for _, c in runs]
    want = torch.repeat_interleave(int64_tensor(values), torch.tensor(counts, dtype=torch.int64))
    got = per_row(values, counts)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    ids = per_row_ids(values, counts)
    assert ids.dtype == np.int64 and ids.ndim == 1 and ids.tolist() == want.tolist()


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 20)), max_size=30))
def test_gather_index_lists_each_range_in_order(ranges: list[tuple[int, int]]) -> None:
    starts, sizes = [s for s, _ in ranges], [k for _, k in ranges]
    want = [row for s, k in ranges for row in range(s, s + k)]
    assert gather_index(starts, sizes).tolist() == want


@given(
    st.integers(1, 50),
    st.lists(st.integers(-2, 52) | st.integers(-(2**62), 2**62), max_size=12),  # near n, and far
    st.integers(1, 3),
    st.sampled_from([2, 24]),  # up to 24 ids read as ints, up to 288 (over 128: one reduction)
)
@example(5, [0, 1, 2, 3, 4, 5], 1, 24)  # 144 ids: the reduction, its largest id equal to n
@example(6, [0, 1, 2, 3, 4, 5], 1, 24)  # 144 ids: the reduction, all inside
@example(5, [0, 1, 2, 3, 4, 5], 1, 8)  # 48 ids as ints, the largest equal to n
@example(5, [0, 1, 2, 3, 4], 1, 8)
def test_out_of_range_is_any_negative_or_too_large(n: int, rows: list[int], stride: int, copies: int) -> None:
    arr = np.array(rows * copies, dtype=np.int64)[::stride]  # strided views read the same
    assert out_of_range(arr, n) is any(r < 0 or r >= n for r in (rows * copies)[::stride])


# A few values read as Python ints, more by numpy: both sides of FEW_IDS.
SIZES = st.sampled_from([1, 2, FEW_IDS - 1, FEW_IDS, FEW_IDS + 1, 3 * FEW_IDS])


@given(SIZES, st.integers(-1, 3), st.data())
def test_uniform_value_is_the_one_value_every_element_holds(size: int, first: int, data: st.DataObject) -> None:
    odd = data.draw(st.lists(st.integers(0, size - 1), max_size=3, unique=True))  # rows that differ, maybe none
    values = np.full(size, first, dtype=np.int8)
    values[odd] = first + 1
    got = uniform_value(values)
    if len(odd) == size:  # every row changed: uniform again
        assert got == first + 1
    else:
        assert got == (None if odd else first)
    assert got is None or type(got) is int


@given(SIZES, st.data())
def test_all_set_is_true_only_when_every_value_is_set(size: int, data: st.DataObject) -> None:
    unset = data.draw(st.lists(st.integers(0, size - 1), max_size=3, unique=True))
    mask = np.ones(size, dtype=bool)
    mask[unset] = False
    assert all_set(mask) is (not unset)
    assert all_set(mask[::2]) is all(mask[::2].tolist())  # a strided view reads the same
