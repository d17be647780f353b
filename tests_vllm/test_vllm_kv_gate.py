"""The stage gate on vLLM 0.33's real KVTransferConfig and connector registry, and the
vLLM plugin through vLLM's own plugin loader."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from omni_prefix_cache.group_view import stage_prefix_cache_config
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.kv_connector_gate import STORE_ONLY_KV_CONNECTORS, TIER_CONNECTOR, TIER_CONNECTOR_MODULE
from omni_prefix_cache.tier.connector import OmniTierConnector
from omni_prefix_cache.tools.simulate import SimConfig
from omni_prefix_cache.tools.simulate.vllm_engine import VllmOptions, VllmScheduler
from omni_prefix_cache.vllm_plugin import ENV_VAR

ROLES = ("kv_producer", "kv_consumer", "kv_both")
REGISTERED = sorted(KVConnectorFactory._registry)


@pytest.fixture(scope="module")
def sched(v):
    """A real vLLM scheduler (prefix caching on), for its config objects."""
    sched = VllmScheduler(SimConfig(seed=0, num_blocks=32, block_size=16), VllmOptions(), v, [])
    yield sched
    sched.close()


@pytest.fixture
def gate(sched):
    """stage_prefix_cache_config on the real scheduler's configs, with a given KVTransferConfig."""
    vc = sched.vllm_config

    def run(kv_transfer: KVTransferConfig | None):
        return stage_prefix_cache_config(
            kv_cache_config=sched.kv_cache_config,
            cache_config=vc.cache_config,
            kv_transfer_config=kv_transfer,
            scheduler_config=vc.scheduler_config,
            model_config=vc.model_config,
            is_pooling_model=False,
            speculative_config=vc.speculative_config,
        )

    return run


@pytest.mark.parametrize("role", ROLES)
def test_offloading_connector_is_refused_with_every_role(gate, role: str) -> None:
    """OffloadingConnector loads offloaded KV into new blocks whatever its kv_role."""
    cfg = KVTransferConfig(kv_connector="OffloadingConnector", kv_role=role)
    assert cfg.is_kv_producer or cfg.is_kv_consumer
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"'OffloadingConnector' \\(kv_role='{role}'\\) can load KV"):
        gate(cfg)


@pytest.mark.parametrize("name", [n for n in REGISTERED if n not in STORE_ONLY_KV_CONNECTORS and n != "MultiConnector"])
def test_every_registered_connector_not_known_to_only_store_is_refused_as_a_producer(gate, name: str) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"KV connector '{name}'"):
        gate(KVTransferConfig(kv_connector=name, kv_role="kv_producer"))


@pytest.mark.parametrize("name", sorted(STORE_ONLY_KV_CONNECTORS))
def test_the_allow_list_names_registered_connectors_whose_scheduler_never_loads(gate, name: str) -> None:
    """Each allow-listed connector is one of vLLM's, and its get_num_new_matched_tokens only ever
    returns (0, False): read from vLLM's source, so an upgrade that lets it load fails here."""
    assert name in REGISTERED
    cls = KVConnectorFactory._registry[name]()  # the registry's lazy class loader
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.get_num_new_matched_tokens)))
    returns = [ast.unparse(node.value) for node in ast.walk(tree) if isinstance(node, ast.Return) and node.value]
    assert returns and set(returns) == {"(0, False)"}, returns
    for role in ROLES:
        assert gate(KVTransferConfig(kv_connector=name, kv_role=role)) is not None


def test_a_multi_connector_is_judged_by_its_children(gate) -> None:
    store = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer"}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}
    ok = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_producer", kv_connector_extra_config={"connectors": [store]}
    )
    assert gate(ok) is not None
    mixed = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_producer", kv_connector_extra_config={"connectors": [store, offload]}
    )
    with pytest.raises(OmniPrefixCacheUnmatchError, match="child that can load.*'OffloadingConnector'"):
        gate(mixed)


@pytest.mark.parametrize("role", ROLES)
def test_the_tier_wrapper_around_the_offloading_connector_is_admitted_with_every_role(gate, role: str) -> None:
    """The wrapper caps the loads to what the host tier holds and reports them (tier/connector.py);
    vLLM's factory loads it from its module path."""
    inner = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    cfg = KVTransferConfig(
        kv_connector=TIER_CONNECTOR,
        kv_connector_module_path=TIER_CONNECTOR_MODULE,
        kv_role=role,
        kv_connector_extra_config={
            "omni_tier_inner": inner,
            "omni_tier_max_bytes": 1 << 20,
            "omni_tier_bytes_per_token": 256,
        },
    )
    assert gate(cfg) is not None
    assert KVConnectorFactory.get_connector_class(cfg) is OmniTierConnector
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"'{TIER_CONNECTOR}'.*kv_connector_module_path"):
        gate(KVTransferConfig(kv_connector=TIER_CONNECTOR, kv_connector_module_path="elsewhere.tier", kv_role=role))


def test_no_connector_passes(gate) -> None:
    assert gate(None) is not None


def _with_plugins(value: str | None) -> subprocess.CompletedProcess[str]:
    """vLLM's own loader runs the general plugins in a fresh interpreter, then imports upstream's path."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "VLLM_PLUGINS")}
    if value is not None:
        env[ENV_VAR] = value
    code = (
        "import importlib\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "try:\n"
        "    upstream = importlib.import_module('vllm_omni.core.prefix_cache')\n"
        "except ModuleNotFoundError as e:\n"
        "    print('missing', e.name)\n"
        "else:\n"
        "    import omni_prefix_cache, omni_prefix_cache.manager\n"
        "    from vllm_omni.core.prefix_cache.manager import OmniPrefixCacheManager\n"
        "    from vllm_omni.core.prefix_cache import PrefixCacheSchedulerAdapter\n"
        "    ok = upstream is omni_prefix_cache\n"
        "    ok = ok and OmniPrefixCacheManager is omni_prefix_cache.manager.OmniPrefixCacheManager\n"
        "    print('aliased', ok, PrefixCacheSchedulerAdapter.__module__)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_vllms_plugin_loader_aliases_upstreams_package_only_when_opted_in() -> None:
    on = _with_plugins("1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip().splitlines()[-1] == "aliased True omni_prefix_cache.adapter"
    off = _with_plugins(None)
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip().splitlines()[-1] == "missing vllm_omni"


# ------------------------------------------------------------ KV cache group mixes (vLLM 0.33's spec classes)


def _specs() -> dict[str, Any]:
    """One spec of each of vLLM 0.33's kinds, as its model runner builds them."""
    from vllm.v1 import kv_cache_interface as kv

    a = {"block_size": 16, "num_kv_heads": 4, "head_size": 16, "dtype": torch.float32}
    full_small = kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return {
        "full": kv.FullAttentionSpec(**a),
        "mla": kv.MLAAttentionSpec(**a),
        "sink": kv.SinkFullAttentionSpec(**a, sink_len=4),
        "rswa": kv.RSWASpec(**a, rswa_window=32),
        "hidden-state": kv.HiddenStateCacheSpec(**a),
        "uniform-full": kv.UniformTypeKVCacheSpecs(
            block_size=16, kv_cache_specs={"l0": kv.FullAttentionSpec(**a), "l1": full_small}
        ),
        "sliding": kv.SlidingWindowSpec(**a, sliding_window=32),
        "sliding-mla": kv.SlidingWindowMLASpec(**a, sliding_window=32),
        "chunked": kv.ChunkedLocalAttentionSpec(**a, attention_chunk_size=64),
        "mamba": kv.MambaSpec(block_size=16, shapes=((4, 16),), dtypes=(torch.float32,), mamba_cache_mode="align"),
        "cross": kv.CrossAttentionSpec(**a),
        "encoder-only": kv.EncoderOnlyAttentionSpec(**a),
        "circular": kv.CircularBufferSpec(**a),
    }


def _kv_config(*kinds: str, **group: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    specs = _specs()
    groups = [KVCacheGroupSpec([f"layer.{i}"], specs[k], **group) for i, k in enumerate(kinds)]
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)


FULL_KINDS = ("full", "mla", "sink", "rswa", "hidden-state", "uniform-full")
BESIDE = ("sliding", "sliding-mla", "chunked", "mamba")
ACCEPTED_MIXES = [((f,), 0) for f in FULL_KINDS]
ACCEPTED_MIXES += [((f, o), 0) for f in ("full", "mla") for o in BESIDE]
ACCEPTED_MIXES += [((o, f), 1) for f in ("full", "mla") for o in BESIDE]
ACCEPTED_MIXES += [
    (("mamba", "sliding", "full"), 2),
    (("sliding", "full", "full"), 1),
    (("chunked", "mamba", "sink"), 2),
]


def _gate_on(sched: Any, kv_cache_config: Any, **extra: Any) -> Any:
    vc = sched.vllm_config
    return stage_prefix_cache_config(
        kv_cache_config=kv_cache_config,
        cache_config=vc.cache_config,
        kv_transfer_config=None,
        scheduler_config=vc.scheduler_config,
        model_config=vc.model_config,
        is_pooling_model=False,
        **extra,
    )


@pytest.mark.parametrize(("kinds", "index"), ACCEPTED_MIXES, ids=["+".join(k) for k, _ in ACCEPTED_MIXES])
def test_a_full_attention_group_beside_sliding_chunked_or_mamba_groups_is_accepted(sched, kinds, index) -> None:
    config = _gate_on(sched, _kv_config(*kinds))
    assert config is not None and config.kv_cache_group_index == index and config.block_size == 16


REFUSED_MIXES = {
    ("sliding",): "none of the 1 groups is full attention",
    ("sliding", "sliding-mla"): "no group covers every position",
    ("chunked",): "is full attention",
    ("mamba",): "one recurrent state per block",
    ("sliding", "mamba"): "none of the 2 groups is full attention",
    ("full", "cross"): "group 1 is CrossAttentionSpec",
    ("encoder-only", "full"): "group 0 is EncoderOnlyAttentionSpec",
    ("full", "circular"): "group 1 is CircularBufferSpec",
}


@pytest.mark.parametrize(("kinds", "says"), REFUSED_MIXES.items(), ids=["+".join(k) for k in REFUSED_MIXES])
def test_a_mix_without_full_attention_or_with_an_unverified_kind_is_refused(sched, kinds, says) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=says):
        _gate_on(sched, _kv_config(*kinds))


def test_groups_whose_blocks_come_from_another_pool_do_not_key_the_rows(sched) -> None:
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    with pytest.raises(OmniPrefixCacheUnmatchError, match="host_resident=True"):
        _gate_on(sched, _kv_config("full", host_resident=True))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="hisparse_source"):
        _gate_on(sched, _kv_config("full", role=KVCacheGroupRole.HISPARSE_SOURCE))
    config = _kv_config("full", "full")
    config.kv_cache_groups[0].is_eagle_group = True  # an EAGLE draft group keys only when nothing else can
    assert _gate_on(sched, config).kv_cache_group_index == 1


def test_hits_vllm_lands_finer_than_the_keyed_block_are_refused(sched) -> None:
    config = _kv_config("mamba", "full")
    config.cache_hit_alignment_tokens = 8
    with pytest.raises(OmniPrefixCacheUnmatchError, match="cache_hit_alignment_tokens"):
        _gate_on(sched, config)


# ------------------------------------------------------------ tensor and pipeline parallel (vLLM's ParallelConfig)


PARALLEL = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


@pytest.mark.parametrize(("tp", "pp"), PARALLEL, ids=[f"tp{tp}-pp{pp}" for tp, pp in PARALLEL])
def test_only_the_rank_whose_output_vllms_executor_returns_mirrors(sched, tp: int, pp: int) -> None:
    """The mirroring rank is MultiprocExecutor's output rank (RayExecutorV2 inherits it), read from
    vLLM's own ParallelConfig as its worker sets it (parallel_config.rank = the worker's rank)."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    output_rank = MultiprocExecutor._get_output_rank(
        SimpleNamespace(world_size=parallel.world_size, parallel_config=parallel)
    )
    mirrors = []
    for rank in range(parallel.world_size):
        parallel.rank = rank
        if _gate_on(sched, sched.kv_cache_config, parallel_config=parallel) is not None:
            mirrors.append(rank)
    assert mirrors == [output_rank]


@pytest.mark.parametrize("field", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_in_vllms_parallel_config_is_refused(sched, field: str) -> None:
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(tensor_parallel_size=2, **{field: 2})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"{field}=2.*across ranks"):
        _gate_on(sched, sched.kv_cache_config, parallel_config=parallel)
