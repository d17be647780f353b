"""TierIndex (tier/index.py): the scheduler side's LRU record of what the host
tier holds, and the release/bind it hands the worker each step."""

from __future__ import annotations

import pytest

from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError
from omni_prefix_cache.tier.index import TierIndex
from omni_prefix_cache.tier.metadata import TierBind


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


def index(blocks: int) -> TierIndex:
    return TierIndex(max_bytes=blocks * 100 + 99, block_bytes=100)


@pytest.mark.parametrize(("max_bytes", "block_bytes"), [(0, 1), (-5, 1), (10, 0), (10, -1), (10, 11), (True, 1)])
def test_bad_sizes_are_refused_with_the_library_error(max_bytes: int, block_bytes: int) -> None:
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="TierIndex") as err:
        TierIndex(max_bytes, block_bytes)
    assert isinstance(err.value, OmniPrefixCacheUnmatchError)


def test_capacity_is_whole_blocks_of_max_bytes() -> None:
    assert TierIndex(1000, 300).capacity == 3
    idx = index(3)
    idx.retain((h(i), i) for i in range(5))
    assert len(idx) == 3 and idx.held() == (h(2), h(3), h(4))


def test_retain_binds_new_hashes_once_and_take_step_drains_once() -> None:
    idx = index(8)
    idx.retain([(h(1), 10), (h(2), 11)])
    idx.retain([(h(1), 20), (h(3), 12)])  # h(1) held already: touched, not re-bound
    assert idx.take_step() == ((), (TierBind(h(1), 10), TierBind(h(2), 11), TierBind(h(3), 12)))
    assert idx.take_step() == ((), ())
    idx.retain([(h(2), 30)])
    assert idx.take_step() == ((), ())


def test_covered_counts_consecutive_held_blocks_from_first_block() -> None:
    idx = index(8)
    idx.retain([(h(0), 0), (h(1), 1), (h(3), 3)])
    hashes = [h(i) for i in range(5)]
    assert idx.covered(hashes, 0, 5) == 2
    assert idx.covered(hashes, 0, 1) == 1
    assert idx.covered(hashes, 1, 5) == 1
    assert idx.covered(hashes, 2, 5) == 0
    assert idx.covered(hashes, 3, 5) == 1
    assert idx.covered(hashes, 9, 5) == 0
    with pytest.raises(OmniPrefixCacheInvalidArgumentError):
        idx.covered(hashes, -1, 1)


def test_lru_order_follows_covered_and_retain_touches() -> None:
    idx = index(3)
    idx.retain([(h(0), 0), (h(1), 1), (h(2), 2)])
    assert idx.covered([h(0)], 0, 1) == 1  # h(0) most recent now
    idx.retain([(h(1), 9)])  # then h(1)
    idx.take_step()
    idx.retain([(h(3), 3)])
    assert idx.held() == (h(0), h(1), h(3))
    assert idx.take_step() == ((h(2),), (TierBind(h(3), 3),))


def test_a_pinned_entry_is_never_evicted_and_goes_after_unpin() -> None:
    idx = index(2)
    idx.retain([(h(0), 0), (h(1), 1)])
    idx.take_step()
    idx.pin("r", [h(0), h(1)])
    idx.retain([(h(2), 2)])  # the only unpinned entry is the new one: it goes, never bound
    assert idx.held() == (h(0), h(1))
    assert idx.take_step() == ((), ())
    idx.forget([h(0)])  # pinned: stays until unpinned
    idx.retain([(h(3), 3)])
    assert idx.held() == (h(0), h(1))
    assert idx.pinned("r") == (h(0), h(1))
    assert idx.unpin("r") is True and idx.unpin("r") is False
    assert idx.held() == (h(1),)
    assert idx.take_step() == ((h(0),), ())
    idx.retain([(h(2), 2), (h(3), 3)])  # unpinned now: LRU evicts h(1)
    assert idx.held() == (h(2), h(3))
    assert idx.take_step() == ((h(1),), (TierBind(h(2), 2), TierBind(h(3), 3)))


def test_pins_of_two_requests_on_one_hash_both_protect_it() -> None:
    idx = index(1)
    idx.retain([(h(0), 0)])
    idx.pin("a", [h(0)])
    idx.pin("b", [h(0)])
    idx.unpin("a")
    idx.retain([(h(1), 1)])
    assert h(0) in idx  # b still pins it; h(1) is the unpinned LRU victim
    assert h(1) not in idx
    idx.unpin("b")
    assert idx.held() == (h(0),)


def test_pin_refuses_hashes_not_held_naming_the_request() -> None:
    idx = index(2)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"'req-7'.*00000005"):
        idx.pin("req-7", [h(5)])


def test_forget_releases_and_a_pinned_hash_is_released_at_unpin() -> None:
    idx = index(4)
    idx.retain([(h(0), 0), (h(1), 1), (h(2), 2)])
    idx.take_step()
    idx.pin("r", [h(1)])
    idx.forget([h(0), h(1), h(9)])
    assert idx.held() == (h(2), h(1))
    assert idx.take_step() == ((h(0),), ())
    idx.unpin("r")
    assert idx.held() == (h(2),)
    assert idx.take_step() == ((h(1),), ())


def test_a_hash_evicted_before_the_worker_saw_its_bind_is_neither_bound_nor_released() -> None:
    idx = index(1)
    idx.retain([(h(0), 0), (h(1), 1)])
    assert idx.take_step() == ((), (TierBind(h(1), 1),))
    idx.retain([(h(2), 2)])
    idx.forget([h(2)])
    assert idx.take_step() == ((h(1),), ())


def test_a_hash_released_then_retained_again_in_one_step_is_rebound_after_the_release() -> None:
    idx = index(4)
    idx.retain([(h(0), 0)])
    idx.take_step()
    idx.forget([h(0)])
    idx.retain([(h(0), 7)])
    assert idx.take_step() == ((h(0),), (TierBind(h(0), 7),))
    assert h(0) in idx
