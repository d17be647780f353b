"""A join that times out raises its own error type (issue 28, item 3), so a
caller can tell it from a failed write or a broken contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import omni_prefix_cache
from omni_prefix_cache import interface
from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from test_manager import BS, NUM_BLOCKS, BlockView, Driver, Req


def _join_timeout_error() -> type[BaseException]:
    # Looked up by name: the type is what this test is about.
    kind = getattr(interface, "OmniPrefixCacheJoinTimeoutError", None)
    assert kind is not None, "interface has no OmniPrefixCacheJoinTimeoutError"
    return kind  # type: ignore[no-any-return]


def test_join_timeout_error_is_exported_like_the_others_and_is_a_library_error() -> None:
    kind = _join_timeout_error()
    assert omni_prefix_cache.OmniPrefixCacheJoinTimeoutError is kind
    assert "OmniPrefixCacheJoinTimeoutError" in omni_prefix_cache.__all__
    assert issubclass(kind, interface.OmniPrefixCacheUnmatchError)
    for other in (
        interface.OmniPrefixCacheWriteFailedError,
        interface.OmniPrefixCacheStagingTimeoutError,
        interface.OmniPrefixCacheShutdownError,
        interface.OmniPrefixCacheInvalidArgumentError,
    ):
        assert not issubclass(kind, other) and not issubclass(other, kind)


def test_save_barrier_join_timing_out_raises_the_join_timeout_error_and_registers_nothing(managers: list[Any]) -> None:
    kind = _join_timeout_error()
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_claim_timeout_s=0.0)
    view = BlockView()
    # Nobody steps a manual committer: step 1's writes never land.
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer="manual")
    managers.append(mgr)
    drv = Driver(mgr, view)
    drv.run({"a": Req([0, 1], 0, 4)})
    tids = sorted(mgr.components.controller.parts.registry.tasks)
    before = mgr.stats()
    with pytest.raises(kind) as info:
        drv.run({"b": Req([2], 0, 2)})  # its save joins step 1's writes first
    message = str(info.value)
    assert f"task {tids[0]} " in message and "did not reach done" in message and "state=QUEUED" in message
    assert not isinstance(info.value, interface.OmniPrefixCacheWriteFailedError)
    after = mgr.stats()
    assert after["steps_saved"] == before["steps_saved"] and not after["sticky_failure"]


def test_errors_doc_has_a_section_for_the_join_timeout_error(repo_root: Path) -> None:
    doc = (repo_root / "docs" / "errors.md").read_text()
    section = doc.split("## `OmniPrefixCacheJoinTimeoutError`\n", 1)[-1].split("\n## ", 1)[0]
    assert section != doc and "staging_claim_timeout_s" in section, section
