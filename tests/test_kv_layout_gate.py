"""The stage gate's layout rules (kv_layout_gate.py) with stand-ins for vLLM's
spec and parallel configs: which KV cache group keys the rows of a hybrid
model, which group mixes are refused and why, and which tensor/pipeline
parallel rank mirrors. tests_vllm/test_vllm_kv_gate.py runs the same rules on
vLLM 0.33's own spec classes and ParallelConfig."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omni_prefix_cache.group_view import check_prefix_cache_kv_groups, stage_prefix_cache_config
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_prefix_cache.kv_layout_gate import (
    is_prefix_cache_mirror_rank,
    kv_group_kind,
    select_prefix_cache_kv_group,
)

BS = 16


# vLLM's spec classes by name (the gate reads class names, never imports vLLM).
class FullAttentionSpec:
    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec:
    block_size = BS
    sliding_window = 32


class ChunkedLocalAttentionSpec:
    block_size = BS


class MambaSpec:
    block_size = 64


class CrossAttentionSpec:
    block_size = BS


class UniformTypeKVCacheSpecs:
    block_size = BS

    def __init__(self, *specs: Any) -> None:
        self.kv_cache_specs = {f"layer.{i}": s for i, s in enumerate(specs)}


def group(spec: Any, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_spec=spec, **fields)


F, SW, CL, M = (
    group(FullAttentionSpec()),
    group(SlidingWindowSpec()),
    group(ChunkedLocalAttentionSpec()),
    group(MambaSpec()),
)

ACCEPTED = {
    "full": ([F], 0),
    "full+sliding": ([F, SW], 0),
    "sliding+full": ([SW, F], 1),
    "full+chunked": ([F, CL], 0),
    "chunked+full": ([CL, F], 1),
    "mamba+full": ([M, F], 1),
    "full+mamba": ([F, M], 0),
    "sliding+mamba+full": ([SW, M, F], 2),
    "two full, a sliding": ([SW, F, F], 1),
    "eagle full first": ([group(FullAttentionSpec(), is_eagle_group=True), SW, F], 2),
    "only eagle full": ([SW, group(FullAttentionSpec(), is_eagle_group=True)], 1),
    "MLA (a FullAttentionSpec)": ([SW, group(MLAAttentionSpec())], 1),
    "uniform full layers": ([SW, group(UniformTypeKVCacheSpecs(FullAttentionSpec(), MLAAttentionSpec()))], 1),
    "one group without a spec": ([object()], 0),
}


@pytest.mark.parametrize(("groups", "index"), ACCEPTED.values(), ids=list(ACCEPTED))
def test_the_first_full_attention_group_keys_the_rows(groups: list[Any], index: int) -> None:
    keyed = select_prefix_cache_kv_group(groups)
    assert keyed.index == index and keyed.group is groups[index]
    assert check_prefix_cache_kv_groups(groups) is groups[index]
    spec = getattr(groups[index], "kv_cache_spec", None)
    assert keyed.block_size == (None if spec is None else BS)


REFUSED = {
    "no groups": ([], "got 0 groups"),
    "sliding only": ([SW], "none of the 1 groups is full attention"),
    "two sliding": ([SW, SW], "no group covers every position"),
    "mamba only": ([M], "one recurrent state per block"),
    "chunked only": ([CL], "chunked local attention"),
    "sliding+mamba": ([SW, M], "none of the 2 groups is full attention.*null block"),
    "uniform sliding layers": ([group(UniformTypeKVCacheSpecs(SlidingWindowSpec()))], "is full attention"),
    "full+cross attention": ([F, group(CrossAttentionSpec())], "group 1 is CrossAttentionSpec, a kind"),
    "full+unknown spec": ([F, group(object())], "group 1 is object"),
    "full+no spec": ([F, object()], "group 1 declares no kv_cache_spec"),
    "two without spec": ([object(), object()], "cannot tell which of 2 KV cache groups"),
    "host-resident full": ([group(FullAttentionSpec(), host_resident=True), SW], "host_resident=True"),
    "HiSparse full": ([group(FullAttentionSpec(), role=SimpleNamespace(value="hisparse_source"))], "hisparse_source"),
}


@pytest.mark.parametrize(("groups", "says"), REFUSED.values(), ids=list(REFUSED))
def test_a_mix_without_a_full_attention_group_or_with_another_kind_is_refused(groups: list[Any], says: str) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match=says) as err:
        select_prefix_cache_kv_group(groups)
    # Every refusal says what is accepted (the seed suite matches its opening).
    assert "needs a single full-attention KV cache group, or full-attention groups beside" in str(err.value)
    with pytest.raises(OmniPrefixCacheUnmatchError):
        stage(kv_groups=groups)


def test_kinds_are_read_from_class_names_and_their_bases() -> None:
    assert kv_group_kind(F) == kv_group_kind(group(MLAAttentionSpec())) == "full attention"
    assert kv_group_kind(SW) == "sliding window" and kv_group_kind(M) == "Mamba"
    assert kv_group_kind(object()) is None
    assert kv_group_kind(group(UniformTypeKVCacheSpecs(FullAttentionSpec(), SlidingWindowSpec()))) == (
        "UniformTypeKVCacheSpecs"
    )


def stage(
    *,
    kv_groups: list[Any] | None = None,
    parallel: Any = None,
    rank: int | None = None,
    block_size: int = BS,
    **kv_config: Any,
) -> PrefixCacheConfig | None:
    return stage_prefix_cache_config(
        kv_cache_config=SimpleNamespace(
            num_blocks=64, kv_cache_groups=[F] if kv_groups is None else kv_groups, **kv_config
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=block_size, prefix_match_unit=None),
        kv_transfer_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_model_len=1024),
        model_config=None,
        is_pooling_model=False,
        parallel_config=parallel,
        rank=rank,
    )


def test_the_config_carries_the_keyed_groups_index_and_block_size() -> None:
    config = stage(kv_groups=[M, SW, group(FullAttentionSpec(block_size=32))], block_size=16)
    assert config is not None and (config.kv_cache_group_index, config.block_size) == (2, 32)
    single = stage(kv_groups=[object()])  # no spec: cache_config.block_size, group 0 (unchanged)
    assert single is not None and (single.kv_cache_group_index, single.block_size) == (0, BS)


def test_hits_finer_than_the_keyed_block_are_refused() -> None:
    assert stage(kv_groups=[M, F], cache_hit_alignment_tokens=2 * BS) is not None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="hits land every 8 tokens.*block size 16"):
        stage(kv_groups=[M, F], cache_hit_alignment_tokens=8)


def test_the_group_index_is_checked_by_the_config() -> None:
    for bad in (-1, True, "1"):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="kv_cache_group_index must be"):
            PrefixCacheConfig(num_blocks=4, block_size=4, kv_cache_group_index=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------ tensor and pipeline parallel


def parallel(tp: int, pp: int, rank: int = 0, **extra: Any) -> SimpleNamespace:
    """The fields of vLLM's ParallelConfig the gate reads."""
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank, **extra)


LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{tp}-pp{pp}" for tp, pp in LAYOUTS])
def test_only_the_first_tensor_rank_of_the_last_stage_mirrors(tp: int, pp: int) -> None:
    mirrors = [r for r in range(tp * pp) if stage(parallel=parallel(tp, pp, rank=r)) is not None]
    assert mirrors == [(pp - 1) * tp]
    # The rank may be given apart from the config (parallel_config.rank is then not read).
    assert [r for r in range(tp * pp) if stage(parallel=parallel(tp, pp, rank=0), rank=r)] == mirrors
    assert [r for r in range(tp * pp) if is_prefix_cache_mirror_rank(parallel(tp, pp), r)] == mirrors


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{tp}-pp{pp}" for tp, pp in LAYOUTS])
def test_with_an_external_launcher_every_rank_of_the_last_stage_mirrors(tp: int, pp: int) -> None:
    cfg = parallel(tp, pp, distributed_executor_backend="external_launcher")
    assert [r for r in range(tp * pp) if is_prefix_cache_mirror_rank(cfg, r)] == list(range((pp - 1) * tp, tp * pp))


def test_no_parallel_config_is_a_single_rank_and_a_rank_outside_the_world_is_refused() -> None:
    assert stage() is not None and is_prefix_cache_mirror_rank(None)
    for rank in (-1, 4):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=f"worker rank {rank} is outside"):
            stage(parallel=parallel(2, 2), rank=rank)


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_is_refused_on_every_rank_naming_why(name: str) -> None:
    for rank in range(4):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=f"{name}=2.*stripes a request's tokens across ranks"):
            stage(parallel=parallel(2, 2, rank=rank, **{name: 2}))


def test_refusals_fire_on_ranks_that_do_not_mirror_too() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="is full attention"):
        stage(kv_groups=[SW], parallel=parallel(2, 1, rank=1))
