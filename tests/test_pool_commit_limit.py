"""A pool larger than the host can commit is refused where it is sized
(issue 28, item 2): at the save that fixes its keys' widths, before that
save changes anything, with the invalid-argument error naming the bytes
needed, the host's limit and the knobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omni_prefix_cache import block_pool
from omni_prefix_cache.block_pool import host_commit_limit
from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheInvalidArgumentError, PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from test_contract import assert_same_state, background_drain_paused, manager_state
from test_manager import BS, NUM_BLOCKS, WIDTHS, BlockView, Req, assert_nothing_held, start_step


def fake_proc(root: Path, mode: int, **kb: int) -> Path:
    """A stand-in for /proc: ``overcommit_memory`` and a meminfo with ``kb``."""
    (root / "sys/vm").mkdir(parents=True, exist_ok=True)
    (root / "sys/vm/overcommit_memory").write_text(f"{mode}\n")
    (root / "meminfo").write_text("".join(f"{name}: {value:>12} kB\n" for name, value in kb.items()))
    return root


def test_host_commit_limit_follows_each_overcommit_mode(tmp_path: Path) -> None:
    heuristic = host_commit_limit(fake_proc(tmp_path / "0", 0, MemTotal=1000, SwapTotal=24, CommitLimit=9))
    assert heuristic is not None and heuristic.bytes == 1024 * 1024 and heuristic.whole_pool
    assert "MemTotal" in heuristic.explained and "SwapTotal" in heuristic.explained
    strict = host_commit_limit(fake_proc(tmp_path / "2", 2, MemTotal=1000, CommitLimit=600, Committed_AS=100))
    assert strict is not None and strict.bytes == 500 * 1024 and not strict.whole_pool
    assert "CommitLimit" in strict.explained and "Committed_AS" in strict.explained
    always = host_commit_limit(fake_proc(tmp_path / "1", 1, MemTotal=1000))
    assert always is not None and always.bytes is None
    assert host_commit_limit(tmp_path / "missing") is None
    assert host_commit_limit(fake_proc(tmp_path / "7", 7, MemTotal=1000)) is None


def _step(mgr: OmniPrefixCacheManager, view: BlockView) -> tuple[dict[str, Req], torch.Tensor, dict[str, torch.Tensor]]:
    reqs = {"a": Req([0, 1], 0, 8)}
    start_step(mgr, view, reqs)
    values = torch.arange(8, dtype=torch.float32)
    hidden = values.unsqueeze(1).repeat(1, WIDTHS[HIDDEN_KEY])
    return reqs, hidden, {"m": values.unsqueeze(1).repeat(1, WIDTHS["m"])}


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_first_save_of_an_oversized_pool_is_refused_before_it_changes_anything(
    mode: int, eager: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, managers: list[Any]
) -> None:
    # 128 slots: hidden 8 x float32 (4,096 bytes) and m 3 x float32 (1,536 bytes).
    small = dict(MemTotal=4, SwapTotal=0) if mode == 0 else dict(MemTotal=64, CommitLimit=36, Committed_AS=32)
    monkeypatch.setattr(block_pool, "PROC_ROOT", fake_proc(tmp_path, mode, **small))
    view = BlockView()
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS), view, eager=eager)
    managers.append(mgr)
    _, hidden, mm = _step(mgr, view)
    with background_drain_paused(mgr):
        before = manager_state(mgr)
        with pytest.raises(OmniPrefixCacheInvalidArgumentError) as info:
            mgr.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8)
        after = manager_state(mgr)
    message = str(info.value)
    assert "save_outputs (step 1)" in message
    assert "5,632 bytes" in message  # what the two slabs need
    assert "4,096 bytes" in message  # what the host allows
    assert f"overcommit_memory={mode}" in message
    assert "num_blocks 32" in message and "float32" in message and "smaller dtype" in message
    assert_same_state(before, after)
    assert mgr.components.controller.parts.budget.staged_bytes == 0 and not mgr.stats()["sticky_failure"]
    assert_nothing_held(mgr)
    # Refused before it changed anything: once the host allows it, the same
    # save (same step, same snapshot) goes through and serves its rows.
    roomy = dict(MemTotal=64, SwapTotal=0) if mode == 0 else dict(MemTotal=64, CommitLimit=64, Committed_AS=32)
    fake_proc(tmp_path, mode, **roomy)
    sid = mgr.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8)
    got = mgr.materialize(sid, ["a"])
    assert got.hidden_states is not None and torch.equal(got.hidden_states["a"], hidden)
    assert torch.equal(got.mm_outputs["m"]["a"], mm["m"])


def test_a_key_opened_later_counts_the_slabs_already_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, managers: list[Any]
) -> None:
    # Room for hidden (4,096 bytes) alone, not for hidden and m together.
    monkeypatch.setattr(block_pool, "PROC_ROOT", fake_proc(tmp_path, 0, MemTotal=5, SwapTotal=0))
    view = BlockView()
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS), view, eager=True)
    managers.append(mgr)
    _, hidden, mm = _step(mgr, view)
    mgr.discard_step(mgr.save_outputs(hidden, {}, num_tokens_unpadded=8, num_tokens_padded=8))
    _, hidden, mm = _step(mgr, view)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="the slabs already open hold 4,096 bytes"):
        mgr.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8)


def test_the_real_hosts_limit_refuses_a_pool_above_it_or_grants_it_under_overcommit(managers: list[Any]) -> None:
    limit = host_commit_limit()
    if limit is None:
        pytest.fail("this test reads a Linux /proc")
    width = 1024  # float32: 4 KiB a slot
    room = limit.bytes if limit.bytes is not None else 2**30
    num_blocks = room // (BS * width * 4) + 1024
    view = BlockView()
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=num_blocks, block_size=BS), view, eager=True)
    managers.append(mgr)
    start_step(mgr, view, {"a": Req([0, 1], 0, 8)})
    hidden = torch.ones((8, width))
    if limit.bytes is None:
        # overcommit_memory=1: the kernel maps it; pages fill only as rows land.
        mgr.discard_step(mgr.save_outputs(hidden, {}, num_tokens_unpadded=8, num_tokens_padded=8))
        return
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=f"num_blocks {num_blocks} "):
        mgr.save_outputs(hidden, {}, num_tokens_unpadded=8, num_tokens_padded=8)
