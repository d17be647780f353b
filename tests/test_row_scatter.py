"""The pool's block-granular write (device/row_scatter.py) against the row
path (``index_copy_`` at every slot), for block runs, partial blocks at
both ends, mixed steps, decode, and every dtype the pool holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.device.row_scatter import BLOCKS_BELOW_ROW_BYTES, SlabScatter, int_view, leads_with_a_block
from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.writes.chunks import WriteChunk
from omni_prefix_cache.writes.write_task import WriteSchedule, WriteTask

BS = 4
NUM_BLOCKS = 16
NUM_SLOTS = BS * NUM_BLOCKS


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, width), generator=gen).bool()
    if dtype.is_complex:
        return torch.randn((n, width), generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn((n, width), generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n, width), generator=gen, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, so NaN payloads and signed zeros compare exactly."""
    return t.contiguous().view(torch.uint8)


def _scatter(slots: list[int], width: int = 6, dtype: torch.dtype = torch.bfloat16) -> tuple[int, bool]:
    """Write rows at ``slots`` both ways onto the same prior contents;
    (rows written as whole blocks, the two slabs bitwise equal)."""
    prior = _rows(NUM_SLOTS, width, dtype, seed=1)
    host = _rows(len(slots), width, dtype, seed=2)
    index = torch.tensor(slots, dtype=torch.int64)
    if prior.element_size() == 1 and dtype not in (torch.int8, torch.uint8, torch.bool):
        # torch has no CPU index_copy_ for float8: the row path on its bytes.
        expected = prior.clone().view(torch.uint8).index_copy_(0, index, host.view(torch.uint8)).view(dtype)
    else:
        expected = prior.clone().index_copy_(0, index, host)
    slab = prior.clone()
    view = SlabScatter.of(slab, BS)
    assert view is not None
    source = view.source(host)
    assert source is not None
    whole = view.scatter(index.numpy(), source)
    return whole, torch.equal(_bits(slab), _bits(expected))


def _block(b: int) -> list[int]:
    return list(range(b * BS, (b + 1) * BS))


def test_a_run_of_whole_blocks_goes_as_blocks() -> None:
    slots = _block(9) + _block(2) + _block(5)
    assert _scatter(slots) == (3 * BS, True)


def test_whole_blocks_out_of_order_inside_are_rows() -> None:
    # Every row's block is whole as a set, but one block's rows come swapped.
    slots = _block(9) + _block(2)
    slots[BS + 1], slots[BS + 2] = slots[BS + 2], slots[BS + 1]
    assert _scatter(slots) == (BS, True)
    slots = _block(2) + _block(9)
    slots[1], slots[2] = slots[2], slots[1]
    assert _scatter(slots) == (0, True)


def test_whole_blocks_then_a_partial_tail() -> None:
    # A deferred key's whole request: three blocks, then 2 rows into a fourth.
    slots = _block(4) + _block(11) + _block(0) + [6 * BS, 6 * BS + 1]
    assert _scatter(slots) == (3 * BS, True)


def test_partial_blocks_at_both_ends_go_row_by_row() -> None:
    # Starts 1 row into block 3, ends 2 rows into block 6.
    slots = list(range(3 * BS + 1, 6 * BS + 2))
    assert _scatter(slots) == (0, True)


def test_a_mixed_step_writes_every_row() -> None:
    # Two whole blocks, a chunk ending mid-block, a misaligned run, then decode rows.
    slots = _block(7) + _block(1) + list(range(10 * BS, 10 * BS + 3)) + _block(12) + [5 * BS + 2, 14 * BS + 1, 3]
    assert _scatter(slots) == (2 * BS, True)  # up to the first partial block
    tail = [s for s in slots if s // BS not in (7, 1, 12)]
    assert _scatter(_block(7) + _block(1) + _block(12) + tail) == (3 * BS, True)
    assert _scatter([5 * BS + 2, *slots]) == (0, True)  # opens mid-block


def test_decode_one_row_per_request_goes_row_by_row() -> None:
    slots = [b * BS + (b % BS) for b in range(NUM_BLOCKS)]
    assert not leads_with_a_block(np.array(slots), BS)
    assert _scatter(slots) == (0, True)


def test_a_gap_inside_a_block_breaks_it() -> None:
    # Slot 2 * BS + 1 missing (taken over by a newer write): block 2 is not whole.
    slots = [s for s in _block(2) + _block(3) if s != 2 * BS + 1]
    assert _scatter(slots) == (0, True)
    assert _scatter(_block(3) + [s for s in _block(2) if s != 2 * BS + 1]) == (BS, True)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []),
    ],
)
@pytest.mark.parametrize("width", [1, 3, 8])
def test_every_dtype_and_width_matches_the_row_path(dtype: torch.dtype, width: int) -> None:
    slots = _block(3) + _block(8) + list(range(10 * BS + 1, 11 * BS)) + [13 * BS + 2]
    narrow = width * torch.empty((), dtype=dtype).element_size() < BLOCKS_BELOW_ROW_BYTES
    assert _scatter(slots, width, dtype) == (2 * BS if narrow else 0, True)


def test_wide_rows_go_row_by_row_and_match() -> None:
    # A row as wide as BLOCKS_BELOW_ROW_BYTES copies about as fast on its own: no block view.
    slots = _block(3) + _block(8) + list(range(10 * BS + 1, 11 * BS))
    assert _scatter(slots, BLOCKS_BELOW_ROW_BYTES // 2, torch.bfloat16) == (0, True)
    assert _scatter(slots, BLOCKS_BELOW_ROW_BYTES // 2 - 4, torch.bfloat16) == (2 * BS, True)


def test_nan_payloads_and_signed_zeros_land_bitwise() -> None:
    host = torch.tensor([[float("nan"), -0.0, float("-inf"), 1.5]] * BS, dtype=torch.float32)
    host.view(torch.int32)[0, 0] = 0x7FC0_1234  # a NaN with a payload
    slab = torch.zeros((NUM_SLOTS, 4), dtype=torch.float32)
    view = SlabScatter.of(slab, BS)
    assert view is not None
    source = view.source(host)
    assert source is not None
    view.scatter(np.array(_block(6)), source)
    assert torch.equal(_bits(slab[6 * BS : 7 * BS]), _bits(host))


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, NUM_SLOTS - 1), st.integers(1, 3 * BS)),
        min_size=1,
        max_size=6,
    )
)
def test_any_unique_slots_match_the_row_path(runs: list[tuple[int, int]]) -> None:
    slots: list[int] = []
    for start, length in runs:
        slots += [s for s in range(start, min(start + length, NUM_SLOTS)) if s not in slots]
    # The leading whole blocks by their definition, one block at a time.
    lead = 0
    while lead + BS <= len(slots) and slots[lead : lead + BS] == _block(slots[lead] // BS):
        lead += BS
    assert _scatter(slots) == (lead, True)


def test_leads_with_a_block_reads_the_first_block_only() -> None:
    assert leads_with_a_block(np.array([4, 5, 6, 7, 1]), BS)
    assert not leads_with_a_block(np.array([1, 2, 3, 4, 5]), BS)  # not aligned
    assert not leads_with_a_block(np.array([4, 5, 6]), BS)  # too short
    assert not leads_with_a_block(np.array([4, 9, 6, 8]), BS)  # the 4th is not 4 + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex128])
def test_a_strided_slab_is_written_row_by_row_or_by_torch(dtype: torch.dtype) -> None:
    # A slab with a strided last dimension has no block view; float32 still has a
    # same-size integer view (numpy rows), complex128 none at all (index_copy_).
    pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_capacity_tokens=8))
    storage = torch.zeros((NUM_SLOTS, 8), dtype=dtype)[:, ::2]
    view = SlabScatter.of(storage, BS)
    assert (view is None) == (dtype == torch.complex128) and (view is None or view.blocks is None)
    assert (int_view(storage) is None) == (view is None)
    pool.install_key("k", storage)
    host = _rows(2 * BS, 4, dtype, seed=3)
    pool.write("k", torch.tensor(_block(1) + _block(4)), host)
    assert torch.equal(storage[BS : 2 * BS], host[:BS]) and torch.equal(storage[4 * BS : 5 * BS], host[BS:])
    assert not storage[:BS].any() and not storage[2 * BS : 4 * BS].any()


def test_a_strided_source_is_written_row_by_row() -> None:
    pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_capacity_tokens=8))
    pool.ensure_key("k", torch.int32, 4)
    wide = _rows(2 * BS, 8, torch.int32, seed=4)
    host = wide[:, ::2]  # strided rows: no block view of them, every row on its own
    pool.write("k", torch.tensor(_block(2) + _block(0)), host)
    assert torch.equal(pool.rows("k", torch.tensor(_block(2) + _block(0))), host)


def test_a_taken_over_row_inside_a_block_is_skipped() -> None:
    """A write losing one slot of a whole block to a newer write leaves that
    slot's row alone and still writes the rest of the block."""
    pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_capacity_tokens=8))
    pool.ensure_key("k", torch.bfloat16, 4)
    newer = torch.full((1, 4), 7.0, dtype=torch.bfloat16)
    pool.write("k", torch.tensor([5 * BS + 2]), newer)
    host = _rows(2 * BS, 4, torch.bfloat16, seed=5)
    old = WriteTask(
        tid=1,
        req_id="a",
        write_n=1,
        schedule=WriteSchedule.JOIN_ON_FINISH,
        chunks=[WriteChunk(slots_cpu=torch.tensor(_block(5) + _block(6)), tensors={}, host={"k": host})],
    )
    old.add_taken_over("k", torch.tensor([5 * BS + 2]))
    for key, kept, rows in old.scatter_rows():
        pool.write(key, kept, rows)
    got = pool.rows("k", torch.tensor(_block(5) + _block(6)))
    expected = host.clone()
    expected[2] = newer[0]
    assert torch.equal(got, expected)
