"""Upstream vLLM-Omni's names, where upstream has them.

``UPSTREAM_ALL`` is upstream's ``vllm_omni.core.prefix_cache.__all__`` with the
module each name is imported from there (upstream 9b356ef); ``UPSTREAM_MODULE_NAMES``
the further names upstream's tests import from a module (private ones included).
Every one must resolve here at the same module path (and the ``__all__`` ones
from the package too).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_prefix_cache
from omni_prefix_cache import group_view
from omni_prefix_cache.group_view import (
    FullAttentionGroupView,
    check_prefix_cache_block_layout,
    check_prefix_cache_kv_transfer,
    check_prefix_cache_token_accounting,
    get_prefix_cache_group_view,
    stage_prefix_cache_config,
)
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
)
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from test_request_lifecycle import BS

UPSTREAM_ALL: list[tuple[str, str]] = [
    ("adapter", "PrefixCacheEventKind"),
    ("adapter", "PrefixCacheRequestEvent"),
    ("adapter", "PrefixCacheSchedulerAdapter"),
    ("adapter", "PrefixCacheStep"),
    ("adapter", "PrefixCacheWrite"),
    ("adapter", "PrefixCacheWriteLayout"),
    ("block_pool", "PrefixBlockPool"),
    ("controller", "OmniPrefixCacheController"),
    ("group_view", "FullAttentionGroupView"),
    ("group_view", "check_prefix_cache_kv_groups"),
    ("group_view", "check_prefix_cache_kv_transfer"),
    ("group_view", "get_prefix_cache_group_view"),
    ("group_view", "stage_prefix_cache_config"),
    ("interface", "HIDDEN_KEY"),
    ("interface", "ModelCachePolicy"),
    ("interface", "OmniPrefixCacheStagingTimeoutError"),
    ("interface", "OmniPrefixCacheUnmatchError"),
    ("interface", "PrefixCacheConfig"),
    ("interface", "StageCacheOutputs"),
    ("interface", "WriteSchedule"),
    ("manager", "OmniPrefixCacheManager"),
]

UPSTREAM_MODULE_NAMES: list[tuple[str, str]] = [
    ("adapter", "PrefixCacheRequestOwner"),
    ("controller", "StagingBufferHolder"),
    ("controller", "TaskState"),
    ("controller", "WriteSchedule"),
    ("controller", "WriteTask"),
    ("controller", "_BudgetTicket"),
    ("controller", "_WriteChunk"),
    ("group_view", "check_prefix_cache_block_layout"),
    ("group_view", "check_prefix_cache_token_accounting"),
    ("interface", "PrefixCacheRequestProgress"),
    ("manager", "_is_step_token_tensor"),
    ("manager", "_snapshot_leftover_mm_cpu"),
]


@pytest.mark.parametrize("module, name", UPSTREAM_ALL + UPSTREAM_MODULE_NAMES)
def test_each_upstream_name_imports_from_upstreams_module_path(module: str, name: str) -> None:
    mod = importlib.import_module(f"omni_prefix_cache.{module}")
    # ``from omni_prefix_cache.<module> import <name>``, as upstream's code and tests write it.
    scope: dict[str, Any] = {}
    exec(f"from omni_prefix_cache.{module} import {name}", scope)
    assert scope[name] is getattr(mod, name)


@pytest.mark.parametrize("module, name", UPSTREAM_ALL)
def test_each_name_of_upstreams_all_is_the_packages_too(module: str, name: str) -> None:
    assert name in omni_prefix_cache.__all__
    scope: dict[str, Any] = {}
    exec(f"from omni_prefix_cache import {name}", scope)
    assert scope[name] is getattr(importlib.import_module(f"omni_prefix_cache.{module}"), name)


def test_the_controllers_upstream_chunk_names_are_the_chunk_types_and_nothing_else() -> None:
    controller = importlib.import_module("omni_prefix_cache.controller")
    assert controller._WriteChunk is WriteChunk
    assert controller._BudgetTicket is BudgetTicket
    with pytest.raises(AttributeError, match=r"omni_prefix_cache.controller' has no attribute '_NoSuch'"):
        getattr(controller, "_NoSuch")  # noqa: B009


# ------------------------------------------------------------------ group view entry points


def _batch(tables: Any) -> Any:
    return SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}, num_computed_tokens_cpu=[0], block_table=tables)


class _Tables:
    """vLLM's ``MultiGroupBlockTable``: ``block_tables`` and ``[0]``."""

    def __init__(self, *groups: Any) -> None:
        self.block_tables = list(groups)

    def __getitem__(self, i: int) -> Any:
        return self.block_tables[i]


def _group(**layout: Any) -> Any:
    return SimpleNamespace(block_table=SimpleNamespace(cpu=torch.tensor([[5, 2]], dtype=torch.int32)), **layout)


FULL = SimpleNamespace(kv_cache_spec=type("FullAttentionSpec", (), {})())


def test_get_prefix_cache_group_view_checks_the_groups_first_then_builds_the_view() -> None:
    view = get_prefix_cache_group_view(_batch(_Tables(_group())), BS, [FULL])
    assert isinstance(view, FullAttentionGroupView)
    assert view.step_slots_cpu(["r"], {"r": 6}).tolist() == [20, 21, 22, 23, 8, 9]
    assert get_prefix_cache_group_view(_batch(_Tables()), BS, [FULL]) is None  # no block table
    assert get_prefix_cache_group_view(_batch(None), BS, [FULL]) is None
    for groups in (None, [], [FULL, FULL], [SimpleNamespace(kv_cache_spec=object())]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="single full-attention"):
            get_prefix_cache_group_view(_batch(_Tables()), BS, groups)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="kernel_block_size"):
        get_prefix_cache_group_view(_batch(_Tables(_group(blocks_per_kv_block=2))), BS, [FULL])


@pytest.mark.parametrize(
    "layout, says",
    [
        ({"use_hybrid_blocks": True}, "kernel_block_size"),
        ({"dcp_world_size": 2}, "decode context parallel"),
        ({"pcp_world_size": 2}, "prefill context parallel"),
        ({"kv_cache_block_size": 2 * BS}, "does not match"),
    ],
)
def test_check_prefix_cache_block_layout_refuses_what_the_slot_math_gets_wrong(layout: dict, says: str) -> None:
    check_prefix_cache_block_layout(_group(), BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=says):
        check_prefix_cache_block_layout(_group(**layout), BS)


def test_the_gate_checks_refuse_on_their_own_and_the_stage_config_calls_them(monkeypatch: pytest.MonkeyPatch) -> None:
    check_prefix_cache_kv_transfer(None)
    check_prefix_cache_kv_transfer(SimpleNamespace(kv_role="kv_producer"))
    for consumer in (SimpleNamespace(is_kv_consumer=True), SimpleNamespace(kv_role="kv_both")):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="KV connector"):
            check_prefix_cache_kv_transfer(consumer)
    cache = SimpleNamespace(enable_prefix_caching=True, block_size=BS, prefix_match_unit=None)
    check_prefix_cache_token_accounting(cache, None)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="speculative decoding"):
        check_prefix_cache_token_accounting(cache, SimpleNamespace(method="ngram"))
    seen: list[Any] = []
    monkeypatch.setattr(group_view, "check_prefix_cache_kv_transfer", seen.append)
    config = stage_prefix_cache_config(
        kv_cache_config=SimpleNamespace(num_blocks=8, kv_cache_groups=[FULL]),
        cache_config=cache,
        kv_transfer_config="the connector",
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16, max_model_len=32),
        model_config=None,
        is_pooling_model=False,
    )
    assert seen == ["the connector"] and config is not None and config.num_blocks == 8
