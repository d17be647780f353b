"""Loading vLLM and building the real pieces the ``--engine vllm`` driver
runs: its configs (a tiny model directory, no weights), the KV cache
config, the v1 ``Scheduler`` and the request block hasher, set up the way
``EngineCore`` sets them up; and what the driver counts in vLLM's block pool.

vLLM is imported lazily (:func:`load_vllm`); it is never a dependency of
the library. Tested against vLLM 0.33.0 (``.ci/setup-vllm.sh``).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.tier.metadata import tier_metadata_of
from omni_prefix_cache.tools.simulate.engine import SimConfig

# Without VLLM_TARGET_DEVICE=cpu, VllmConfig cannot infer a device on a machine with no GPU.
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}

# A tiny model config: the scheduler and the input batch only need its sizes.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


# Where each vLLM name the driver (and tests_vllm) uses lives in vLLM 0.33.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "vllm.config": (
        "CacheConfig",
        "ModelConfig",
        "ParallelConfig",
        "SchedulerConfig",
        "SpeculativeConfig",
        "VllmConfig",
    ),
    "vllm.sampling_params": ("SamplingParams",),
    "vllm.utils.hashing": ("get_hash_fn_by_name",),
    "vllm.v1.attention.backends.utils": ("reorder_batch_to_split_decodes_and_prefills",),
    "vllm.v1.core.kv_cache_utils": (
        "get_request_block_hasher",
        "init_none_hash",
        "resolve_cache_hit_alignment_tokens",
        "resolve_kv_cache_block_sizes",
    ),
    "vllm.v1.core.sched.output": ("CachedRequestData", "NewRequestData", "SchedulerOutput"),
    "vllm.v1.core.sched.scheduler": ("Scheduler",),
    "vllm.v1.kv_cache_interface": (
        "FullAttentionSpec",
        "KVCacheConfig",
        "KVCacheGroupSpec",
        "MambaSpec",
        "SlidingWindowSpec",
    ),
    "vllm.v1.outputs": ("DraftTokenIds", "ModelRunnerOutput"),
    "vllm.v1.request": ("Request", "RequestStatus"),
    "vllm.v1.structured_output": ("StructuredOutputManager",),
    "vllm.v1.worker.block_table": ("BlockTable", "MultiGroupBlockTable", "SlotMappingMode"),
    "vllm.v1.worker.gpu_input_batch": ("CachedRequestState", "InputBatch"),
}


def load_vllm() -> SimpleNamespace:
    """Import the vLLM names the driver uses (8-30 s the first time); ImportError without vLLM."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    try:
        ns = SimpleNamespace(vllm=importlib.import_module("vllm"))
    except ImportError as exc:
        raise ImportError(
            f"vLLM is not importable ({exc}); build its environment with `bash .ci/setup-vllm.sh` "
            "and run .venv-vllm/bin/omni-prefix-cache"
        ) from exc
    for module, names in VLLM_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(ns, name, getattr(mod, name))
    return ns


@dataclass(frozen=True)
class VllmOptions:
    """How the real vLLM pieces are set up (the workload and manager come from :class:`SimConfig`)."""

    # Model Runner V2 reporting: a resumed (preempted) request comes back among the new
    # requests instead of the cached ones with ``resumed_req_ids`` (the 0.33 default).
    resumed_as_new: bool = False
    # The decode-first batch reorder some attention backends ask for (``_may_reorder_batch``).
    reorder_threshold: int | None = 1
    vocab: int = 32000
    # vLLM's OffloadingConnector (CPU offload) behind the host tier's wrapper, and a fake worker that
    # completes its transfer jobs (docs/integration.md, "Behind a KV connector").
    kv_offload: bool = False
    offload_cpu_bytes: int = 1 << 22
    sync_load_budget_bytes: int = 0  # > 0: loads that fit are sync
    tier_max_bytes: int = 1 << 20
    tier_bytes_per_token: int = 256
    # The KV cache groups (KV_LAYOUTS): one full-attention group, or a hybrid model's groups.
    kv_layout: str = "full"


# KV cache layouts of the driver: the groups in order, by kind. A sliding window of
# SLIDING_WINDOW_BLOCKS blocks makes most prefix hits longer than the window.
KV_LAYOUTS: dict[str, tuple[str, ...]] = {
    "full": ("full",),
    "hybrid-sw-first": ("sliding", "full"),
    "hybrid-full-first": ("full", "sliding"),
    "hybrid-mamba": ("mamba", "full"),
}
SLIDING_WINDOW_BLOCKS = 2


# ------------------------------------------------------------ builders


def vllm_config(v: SimpleNamespace, cfg: SimConfig, opts: VllmOptions, model_dir: str) -> Any:
    """A ``VllmConfig`` over a model directory holding only ``config.json``
    (written here): prefix caching and chunked prefill on, ``cfg``'s sizes."""
    path = os.path.join(model_dir, "config.json")
    with open(path, "w") as f:
        json.dump(MODEL_CONFIG | {"vocab_size": opts.vocab}, f)
    max_len = cfg.num_blocks * cfg.block_size
    model = v.ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len)
    cache = v.CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = cfg.num_blocks
    if "mamba" in layout_groups(opts.kv_layout):
        # Prefix caching beside a Mamba group needs its "align" mode (vLLM 0.33), blocks the attention's size.
        cache.mamba_cache_mode = "align"
        cache.mamba_block_size = cfg.block_size
    sched = v.SchedulerConfig(
        max_num_batched_tokens=cfg.token_budget,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        # Priority only to let a client's retry jump the queue (VllmScheduler's abort); all else is 0, FCFS.
        policy="priority",
    )
    spec = None
    if cfg.spec_tokens:
        # Speculative decoding as an n-gram proposer sets it up; the driver's fake runner proposes the drafts.
        spec = v.SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=cfg.spec_tokens,
            prompt_lookup_max=3,
            target_model_config=model,
            target_parallel_config=v.ParallelConfig(),
        )
    if not opts.kv_offload:
        return v.VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, speculative_config=spec)
    from vllm.config import KVEventsConfig, KVTransferConfig  # type: ignore[import-not-found]

    transfer = offload_kv_transfer(
        cpu_bytes=opts.offload_cpu_bytes,
        sync_load_budget_bytes=opts.sync_load_budget_bytes,
        tier_max_bytes=opts.tier_max_bytes,
        tier_bytes_per_token=opts.tier_bytes_per_token,
    )
    return v.VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=KVTransferConfig(**transfer),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        speculative_config=spec,
    )


TIER_CONNECTOR_NAME = "OmniTierConnector"
TIER_CONNECTOR_MODULE = "omni_prefix_cache.tier.connector"


def offload_kv_transfer(
    *,
    cpu_bytes: int,
    sync_load_budget_bytes: int,
    tier_max_bytes: int,
    tier_bytes_per_token: int,
    wrap: bool = True,
    kv_role: str = "kv_both",
    kv_load_failure_policy: str = "recompute",
) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields of an OffloadingConnector (CPU offload), wrapped
    by the host tier's connector unless ``wrap`` is False (the documented config)."""
    inner: dict[str, Any] = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "sync_load_budget_bytes": sync_load_budget_bytes},
    }
    common = {"kv_role": kv_role, "kv_load_failure_policy": kv_load_failure_policy}
    if not wrap:
        return {**inner, **common}
    return {
        "kv_connector": TIER_CONNECTOR_NAME,
        "kv_connector_module_path": TIER_CONNECTOR_MODULE,
        "kv_connector_extra_config": {
            "omni_tier_inner": inner,
            "omni_tier_max_bytes": tier_max_bytes,
            "omni_tier_bytes_per_token": tier_bytes_per_token,
        },
        **common,
    }


def offload_worker_output(scheduler_output: Any) -> Any:
    """A fake worker's ``KVConnectorOutput`` for a step of the wrapped OffloadingConnector:
    every load and store job of the step completes (an async load is received now), and
    the wrapper's worker side adds the hashes this process's host tiers reported."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # type: ignore[import-not-found]
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-not-found]

    meta = scheduler_output.kv_connector_metadata
    inner = getattr(meta, "inner", meta)
    loads = dict(getattr(inner, "load_jobs", {}) or {})
    stores = dict(getattr(inner, "store_jobs", {}) or {})
    completed = dict.fromkeys([*loads, *stores], 1)
    recving = {job.req_id for job in loads.values() if not job.sync}
    worker_meta: Any = OffloadingWorkerMetadata(completed_jobs=completed)
    if tier_metadata_of(meta) is not None:  # the wrapper's worker side
        from omni_prefix_cache.tier import channel
        from omni_prefix_cache.tier.connector import OmniTierWorkerMetadata

        worker_meta = OmniTierWorkerMetadata.of(worker_meta, channel.drain())
    return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)


def layout_groups(layout: str) -> tuple[str, ...]:
    """The group kinds of KV layout ``layout``; ValueError naming the layouts for another name."""
    groups = KV_LAYOUTS.get(layout)
    if groups is None:
        raise ValueError(f"unknown KV layout {layout!r}; one of {', '.join(KV_LAYOUTS)}")
    return groups


def kv_cache_config(v: SimpleNamespace, cfg: SimConfig, layout: str = "full", vllm_config: Any = None) -> Any:
    """``layout``'s KV cache groups (``KV_LAYOUTS``) over one pool of ``cfg.num_blocks``
    blocks (no tensors), each group a layer of its kind, every block ``cfg.block_size``
    tokens. With ``vllm_config``, its hash block size and hit alignment are resolved into
    it as vLLM's engine core does."""
    bs = cfg.block_size
    attention = {"block_size": bs, "num_kv_heads": 4, "head_size": 16, "dtype": torch.float32}
    specs = {
        "full": lambda: v.FullAttentionSpec(**attention),
        "sliding": lambda: v.SlidingWindowSpec(**attention, sliding_window=SLIDING_WINDOW_BLOCKS * bs),
        "mamba": lambda: v.MambaSpec(
            block_size=bs, shapes=((4, 16),), dtypes=(torch.float32,), mamba_cache_mode="align"
        ),
    }
    groups = [
        v.KVCacheGroupSpec([f"model.layers.{i}.{kind}"], specs[kind]()) for i, kind in enumerate(layout_groups(layout))
    ]
    config = v.KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    if vllm_config is not None:
        scheduler_bs, hash_bs = block_sizes(v, config, vllm_config)
        config.hash_block_size = hash_bs
        config.cache_hit_alignment_tokens = v.resolve_cache_hit_alignment_tokens(
            config, vllm_config, scheduler_bs, hash_bs
        )
    return config


def block_sizes(v: SimpleNamespace, kv_config: Any, vllm_config: Any) -> tuple[int, int]:
    """vLLM's ``(scheduler block size, hash block size)`` for ``kv_config``, as its engine core resolves them."""
    scheduler_bs, hash_bs = v.resolve_kv_cache_block_sizes(kv_config, vllm_config)
    return int(scheduler_bs), int(hash_bs)


def stage_config(config: Any, kv_config: Any) -> PrefixCacheConfig:
    """The stage gate (``group_view.stage_prefix_cache_config``) on ``config``'s
    parts and ``kv_config``: the keyed group and its block size. Raises what the
    gate raises; AssertionError where it gives this single rank no cache."""
    from omni_prefix_cache.group_view import stage_prefix_cache_config

    gated = stage_prefix_cache_config(
        kv_cache_config=kv_config,
        cache_config=config.cache_config,
        kv_transfer_config=config.kv_transfer_config,
        scheduler_config=config.scheduler_config,
        model_config=config.model_config,
        is_pooling_model=False,
        speculative_config=config.speculative_config,
        parallel_config=config.parallel_config,
    )
    assert gated is not None, "the stage gate gave the driver's single rank no prefix cache"
    return gated


def scheduler(v: SimpleNamespace, cfg: SimConfig, opts: VllmOptions, config: Any, kv_config: Any) -> Any:
    """vLLM's v1 ``Scheduler`` over ``config`` and ``kv_config`` (block and hash
    block sizes resolved as its engine core does); the V2 model runner's
    reporting with ``opts.resumed_as_new``."""
    scheduler_bs, hash_bs = block_sizes(v, kv_config, config)
    sched = v.Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=v.StructuredOutputManager(config),
        block_size=scheduler_bs,
        hash_block_size=hash_bs,
    )
    if opts.resumed_as_new:
        sched.use_v2_model_runner = True
    return sched


def block_hasher(v: SimpleNamespace, cfg: SimConfig, config: Any, kv_config: Any = None) -> Any:
    """The request block hasher as ``EngineCore`` sets it up (sha256 by default),
    every hash block size tokens (``cfg.block_size`` without ``kv_config``)."""
    hash_fn = v.get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    v.init_none_hash(hash_fn)
    hash_bs = cfg.block_size if kv_config is None else block_sizes(v, kv_config, config)[1]
    return v.get_request_block_hasher(hash_bs, hash_fn)


def preempt_request(sched: Any, request: Any, timestamp: float) -> None:
    """Preempt a running ``request`` as vLLM's scheduler does when the KV
    cache is full: out of ``running``, its blocks freed (their hashes stay
    cached), back at the head of the queue; the next ``schedule()`` lists it
    in ``preempted_req_ids`` and later resumes it. vLLM has no public entry
    for this, so its private ``Scheduler._preempt_request`` is called."""
    import vllm.v1.core.sched.scheduler  # type: ignore[import-not-found]  # only in .venv-vllm

    sched.running.remove(request)
    vllm.v1.core.sched.scheduler.Scheduler._preempt_request(sched, request, timestamp)


# ------------------------------------------------------------ block pool counters


@dataclass
class KvBlockStats:
    """vLLM block pool activity seen by the driver."""

    fresh_blocks: int = 0  # blocks newly given to a request (not prefix hits)
    recycled: int = 0  # fresh blocks that another request held before
    evicted_hashes: int = 0  # cached blocks whose hash vLLM dropped to reuse them
    null_block_in_table: int = 0  # block 0 (vLLM's null block) seen among a request's blocks


class EvictionCounter:
    """A metrics collector for vLLM's ``BlockPool`` that counts, in
    ``stats.evicted_hashes``, the blocks a new allocation took from the
    prefix cache (a cached hash dropped), and passes every call on to the
    collector it replaces (None: vLLM's default, no metrics).

    ``BlockPool`` calls ``on_block_evicted`` for every block it hands out,
    just before it drops the block's hashes; the block is evicted when one
    of them still maps to it (what ``BlockPool`` then removes).
    """

    def __init__(self, pool: Any, stats: KvBlockStats) -> None:
        self.pool = pool
        self.stats = stats
        self.inner = pool.metrics_collector

    def on_block_evicted(self, block: Any) -> None:
        hashes = [] if block.block_hash is None else [block.block_hash]
        hashes.extend(self.pool.cached_block_hashes_by_block.get(block.block_id, ()))
        cached = self.pool.cached_block_hash_to_block
        self.stats.evicted_hashes += any(cached.contain(h, block.block_id) for h in hashes)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def on_block_allocated(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()

    @classmethod
    def install(cls, sched: Any, stats: KvBlockStats) -> None:
        """Count into ``stats`` the evictions of ``sched``'s block pool. A vLLM
        whose pool has no metrics collector hook leaves the counter at 0."""
        pool = sched.kv_cache_manager.block_pool
        if all(
            hasattr(pool, a)
            for a in ("metrics_collector", "cached_block_hash_to_block", "cached_block_hashes_by_block")
        ):
            pool.metrics_collector = cls(pool, stats)
