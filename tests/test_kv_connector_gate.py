"""The stage gate's KV-connector rule (kv_connector_gate.py): any connector that
can load KV is refused, whatever its role; only connectors known to only store
pass. tests_vllm/test_vllm_kv_gate.py runs the same rule on vLLM's own
KVTransferConfig and connector registry."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omni_prefix_cache.group_view import check_prefix_cache_kv_transfer, stage_prefix_cache_config
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.kv_connector_gate import (
    STORE_ONLY_KV_CONNECTORS,
    TIER_CONNECTOR,
    TIER_CONNECTOR_MODULE,
    kv_connector_refusal,
)

ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOADING = ("OffloadingConnector", "LMCacheConnectorV1", "NixlConnector", "ExampleConnector", "MyConnector")
STORE_ONLY = sorted(STORE_ONLY_KV_CONNECTORS)


def kv_config(name: str | None, role: str | None = "kv_producer", **extra: Any) -> SimpleNamespace:
    """The fields of vLLM's KVTransferConfig that the gate reads."""
    return SimpleNamespace(
        kv_connector=name,
        kv_role=role,
        kv_connector_module_path=extra.pop("module_path", None),
        kv_connector_extra_config=extra,
        is_kv_consumer=name is not None and role in ("kv_consumer", "kv_both"),
        is_kv_producer=name is not None and role in ("kv_producer", "kv_both"),
    )


def stage(kv_transfer: Any) -> Any:
    """The stage gate with an otherwise valid config (one full-attention group)."""
    return stage_prefix_cache_config(
        kv_cache_config=SimpleNamespace(num_blocks=16, kv_cache_groups=[object()]),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=4, prefix_match_unit=None),
        kv_transfer_config=kv_transfer,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_model_len=128),
        model_config=None,
        is_pooling_model=False,
        speculative_config=None,
    )


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", LOADING)
def test_a_connector_that_can_load_is_refused_whatever_its_role(name: str, role: str) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError) as err:
        stage(kv_config(name, role))
    message = str(err.value)
    assert f"KV connector {name!r} (kv_role={role!r})" in message
    assert "new GPU blocks" in message and "never wrote" in message
    assert "cannot tell locally cached tokens from KV received through a KV connector" in message
    # The refusal names the way to admit it: the tier wrapper.
    assert f"kv_connector='{TIER_CONNECTOR}'" in message
    assert f"kv_connector_module_path='{TIER_CONNECTOR_MODULE}'" in message and "omni_tier_inner" in message


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", STORE_ONLY)
def test_a_store_only_connector_is_admitted(name: str, role: str) -> None:
    assert stage(kv_config(name, role)) is not None


def test_no_connector_is_admitted() -> None:
    assert stage(None) is not None
    assert stage(kv_config(None, None)) is not None
    check_prefix_cache_kv_transfer(None)


def test_a_multi_connector_passes_only_when_every_child_only_stores() -> None:
    stores = [{"kv_connector": name, "kv_role": "kv_producer"} for name in STORE_ONLY]
    assert stage(kv_config("MultiConnector", connectors=stores)) is not None
    mixed = [*stores, {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="'MultiConnector'.*child.*'OffloadingConnector'"):
        stage(kv_config("MultiConnector", connectors=mixed))


def test_a_connector_from_a_module_path_is_refused_even_under_a_store_only_name() -> None:
    cfg = kv_config(STORE_ONLY[0], module_path="my_company.connectors")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="kv_connector_module_path='my_company.connectors'"):
        stage(cfg)


def test_a_duck_typed_config_without_a_connector_name_is_judged_by_its_role() -> None:
    assert "'<unnamed>'" in (kv_connector_refusal(SimpleNamespace(is_kv_consumer=True)) or "")
    assert kv_connector_refusal(SimpleNamespace(is_kv_producer=True)) is not None
    assert kv_connector_refusal(SimpleNamespace(kv_role="kv_producer")) is not None
    assert kv_connector_refusal(SimpleNamespace(is_kv_consumer=False, is_kv_producer=False)) is None


def test_the_connector_refusal_fires_before_the_group_check() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="'OffloadingConnector'"):
        stage_prefix_cache_config(
            kv_cache_config=SimpleNamespace(num_blocks=16, kv_cache_groups=[]),
            cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=4, prefix_match_unit=None),
            kv_transfer_config=kv_config("OffloadingConnector"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_model_len=128),
            model_config=None,
            is_pooling_model=False,
            speculative_config=None,
        )


def tier(
    role: str | None = "kv_both", module_path: str | None = TIER_CONNECTOR_MODULE, **extra: Any
) -> SimpleNamespace:
    inner = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    return kv_config(TIER_CONNECTOR, role, module_path=module_path, omni_tier_inner=inner, **extra)


@pytest.mark.parametrize("role", ROLES)
def test_the_tier_wrapper_from_its_module_is_admitted_with_any_role_around_a_loading_connector(role: str) -> None:
    assert kv_connector_refusal(tier(role)) is None
    assert stage(tier(role)) is not None


@pytest.mark.parametrize("module_path", [None, "my_company.connectors", "omni_prefix_cache.tier", "omni_prefix_cache"])
def test_the_tier_wrappers_name_from_any_other_module_or_the_registry_is_refused(module_path: str | None) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"'{TIER_CONNECTOR}'"):
        stage(tier(module_path=module_path))


def test_the_tier_module_path_admits_no_other_class_name() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="'OffloadingConnector'.*kv_connector_module_path"):
        stage(kv_config("OffloadingConnector", module_path=TIER_CONNECTOR_MODULE))


def test_the_tier_wrapper_nested_in_a_multi_connector_is_refused() -> None:
    child = {"kv_connector": TIER_CONNECTOR, "kv_connector_module_path": TIER_CONNECTOR_MODULE, "kv_role": "kv_both"}
    with pytest.raises(OmniPrefixCacheUnmatchError, match="nested in a MultiConnector.*top-level"):
        stage(kv_config("MultiConnector", connectors=[child]))
