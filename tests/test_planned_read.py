"""Planned hit reads and copy on write (spec/planned_read.yaml).

The race test holds the prefetch thread at the seam between entering the
version check and taking the reads lock, lets the engine reuse the read's
slots (which preserves the old rows into the read and bumps the versions),
then lets the prefetch go on. The interleaving is forced, not slept for, so
the test fails or passes the same way every run.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_prefix_cache.manager import PREFETCH_THREAD_PREFIX, OmniPrefixCacheManager
from omni_prefix_cache.reads.planned_read import PlannedReads, ReadState
from test_manager import BS, BlockView

HID = 6
MODES = [pytest.param(True, id="eager"), pytest.param(False, id="threaded")]


def step(
    mgr: OmniPrefixCacheManager,
    rid: str,
    blocks: list[int],
    start: int,
    count: int,
    *,
    value: float,
    hit: int = 0,
    finished: Iterable[str] = (),
) -> int:
    view = mgr._view
    view.order, view.blocks[rid], view.start[rid] = [rid], blocks, start
    mgr.new_step_starts(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=hit, block_ids=(blocks,))],
            finished_req_ids=set(finished),
            num_scheduled_tokens={rid: count},
        )
    )
    return mgr.save_outputs(torch.full((count, HID), value), {}, num_tokens_unpadded=count, num_tokens_padded=count)


class SeamLock:
    """The manager's reads lock, holding the prefetch thread's acquisition
    in ``HitReads.ensure_not_overwritten`` (the version check) until
    ``release_prefetch`` is set (``arrived`` says it got there)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.arrived = threading.Event()
        self.release_prefetch = threading.Event()
        self._held_once = False

    def _gate(self, caller: str) -> None:
        if (
            caller == "ensure_not_overwritten"
            and not self._held_once
            and threading.current_thread().name.startswith(PREFETCH_THREAD_PREFIX)
        ):
            self._held_once = True
            self.arrived.set()
            assert self.release_prefetch.wait(10), "the test never released the prefetch thread"

    def acquire(self, *args: Any) -> bool:
        self._gate(sys._getframe(1).f_code.co_name)
        return self.real.acquire(*args)

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()

    def __enter__(self) -> SeamLock:
        self._gate(sys._getframe(1).f_code.co_name)
        self.real.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.mark.parametrize("eager", MODES)
def test_reuse_between_version_check_and_reads_lock_serves_preserved_rows(eager: bool, managers: list) -> None:
    """b's hit read of block 2 is at the version check (before the reads
    lock) when c reuses block 2: the reuse copies a's rows into b's read
    and bumps the versions. The read must then find those copies, not
    raise "overwritten ... no preserved copy"."""
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=eager)
    managers.append(mgr)
    s = step(mgr, "a", [2], 0, 4, value=1.0)
    mgr.materialize(s, ["a"])
    seam = SeamLock(mgr._reads.lock)
    mgr._reads.lock = seam
    moves: list[tuple[str, str, str]] = []
    real_move = mgr._reads.registry.move

    def recording_move(ref: Any, trigger: str, reused: Any = None) -> None:
        before = ReadState(ref.state).name
        real_move(ref, trigger, reused)
        if ref.req_id == "b":
            moves.append((trigger, before, ReadState(ref.state).name))

    mgr._reads.registry.move = recording_move
    s_hit = step(mgr, "b", [2, 6], 4, 1, value=2.0, hit=4, finished=["a"])
    assert seam.arrived.wait(10), "the prefetch thread never reached the reads lock"
    # b's read is planned, its preserved dict is empty, its prefetch waits
    # at the seam. c now takes block 2 (b finished; b's materialize lags).
    s_reuse = step(mgr, "c", [2], 0, 4, value=3.0, finished=["b"])
    seam.release_prefetch.set()
    out = mgr.materialize(s_hit, ["b"])
    assert out.hidden_states["b"][:, 0].tolist() == [1.0] * 4 + [2.0]
    assert mgr.materialize(s_reuse, ["c"]).hidden_states["c"][:, 0].tolist() == [3.0] * 4
    assert not mgr._reads.pending
    # Copy on write is the spec's preserve move, taken while b's read was FETCHING.
    assert moves == [
        ("register", "PLANNING", "PENDING"),
        ("fetch", "PENDING", "FETCHING"),
        ("preserve", "FETCHING", "FETCHING"),
        ("serve", "FETCHING", "SERVED"),
    ]


def test_a_read_dropped_twice_is_an_illegal_move_naming_the_read(managers: list) -> None:
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=True)
    managers.append(mgr)
    s = step(mgr, "a", [2], 0, 4, value=1.0)
    mgr.materialize(s, ["a"])
    ref = mgr._reads.plan(torch.arange(8, 12), HIDDEN_KEY, "b")
    assert ref.state is ReadState.PENDING and ref in mgr._reads.pending
    mgr._reads.forget(ref)
    assert ref.state is ReadState.DROPPED and not mgr._reads.pending
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request 'b', key .* drop is illegal from DROPPED"):
        mgr._reads.forget(ref)


def test_an_unservable_plan_is_refused_and_never_pending(managers: list) -> None:
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=True)
    managers.append(mgr)
    s = step(mgr, "a", [2], 0, 4, value=1.0)
    mgr.materialize(s, ["a"])
    seen: list[str] = []
    real_move = PlannedReads.move
    mgr._reads.registry.move = lambda ref, trigger, reused=None: (
        seen.append(trigger),
        real_move(mgr._reads.registry, ref, trigger),
    )
    with pytest.raises(OmniPrefixCacheUnmatchError, match="never written"):
        mgr._reads.plan(torch.arange(0, 4), HIDDEN_KEY, "b")  # block 0: hidden rows ABSENT
    assert seen == ["refuse"] and not mgr._reads.pending


def test_pool_rows_gathers_into_a_given_buffer_and_refuses_a_mismatched_one() -> None:
    from omni_prefix_cache.block_pool import PrefixBlockPool

    pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=4, block_size=BS))
    pool.ensure_key(HIDDEN_KEY, torch.float32, 3)
    slots = torch.arange(BS)
    pool.write(HIDDEN_KEY, slots, torch.arange(3.0 * BS).reshape(BS, 3))
    picked = torch.tensor([5, 0, 2])
    buf = torch.full((6, 3), -1.0)
    got = pool.rows(HIDDEN_KEY, picked, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:3], pool.rows(HIDDEN_KEY, picked)) and torch.equal(buf[3:], torch.full((3, 3), -1.0))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"reading 3 rows of key .* into a torch.float32 buffer"):
        pool.rows(HIDDEN_KEY, picked, out=buf[:2])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"into a torch.float64 buffer"):
        pool.rows(HIDDEN_KEY, picked, out=torch.empty((3, 3), dtype=torch.float64))


@pytest.mark.parametrize("eager", MODES)
def test_a_prefetch_gathers_the_prefix_once_straight_into_its_buffer(eager: bool, managers: list) -> None:
    """The prefetch thread's pool read writes the prefix rows into the
    ``[prefix | tail]`` buffer materialize returns (no second copy)."""
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=eager)
    managers.append(mgr)
    s = step(mgr, "a", [2], 0, 4, value=1.0)
    mgr.materialize(s, ["a"])
    real_rows = mgr._pool.rows
    outs: list[torch.Tensor | None] = []

    def recording_rows(key: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if threading.current_thread().name.startswith(PREFETCH_THREAD_PREFIX):
            outs.append(out)
        return real_rows(key, slots, out=out)

    mgr._pool.rows = recording_rows
    s_hit = step(mgr, "b", [2, 6], 4, 1, value=2.0, hit=4, finished=["a"])
    got = mgr.materialize(s_hit, ["b"]).hidden_states["b"]
    assert got[:, 0].tolist() == [1.0] * 4 + [2.0]
    assert len(outs) == 1 and outs[0] is not None and outs[0].data_ptr() == got.data_ptr()
