"""The library's Protocols against vLLM's real classes, and what the group view reads on vLLM 0.33."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pytest
import torch

from omni_prefix_cache import engine_types as P
from omni_prefix_cache.group_view import FullAttentionGroupView, stage_prefix_cache_config
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.tools.simulate import SimConfig
from omni_prefix_cache.tools.simulate.vllm_engine import RunnerBatch, VllmOptions, VllmScheduler
from omni_prefix_cache.tools.simulate.workload import RequestSpec

BLOCK = 16


def members(proto: type) -> set[str]:
    """Names a Protocol declares (annotations, methods, properties), its Protocol bases' too."""
    out: set[str] = set()
    for cls in proto.__mro__:
        if cls in (typing.Protocol, typing.Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        out |= set(getattr(cls, "__annotations__", {}))
        out |= {k for k, val in vars(cls).items() if callable(val) or isinstance(val, property)}
    return {m for m in out if not m.startswith("_") or m == "__getitem__"} - {"__init__", "__subclasshook__"}


@pytest.fixture(scope="module")
def step(v):
    """One real scheduler step (two requests, one a prefix hit of the other's same-step blocks) and its batch."""
    cfg = SimConfig(seed=0, num_blocks=32, block_size=BLOCK)
    prompt = tuple(range(100, 150))
    trace = [RequestSpec("a", 0, (prompt,), 4), RequestSpec("b", 0, (prompt + (7, 8),), 4)]
    sched = VllmScheduler(cfg, VllmOptions(), v, trace)
    runner = RunnerBatch(cfg, VllmOptions(), v, sched.vllm_config.model_config.max_model_len)
    plan = sched.schedule(0)
    runner.update_states(plan.output)
    yield SimpleNamespace(sched=sched, runner=runner, plan=plan, so=plan.output, cfg=cfg)
    sched.close()


# (protocol, vLLM class name) for the dataclasses: each declared member must be a field or attribute.
DATACLASSES = [
    (P.NewRequestDataLike, "NewRequestData"),
    (P.CachedRequestDataLike, "CachedRequestData"),
    (P.SchedulerOutputLike, "SchedulerOutput"),
    (P.RunnerSchedulerOutputLike, "SchedulerOutput"),
    (P.SpecDecodeSchedulerOutputLike, "SchedulerOutput"),
    (P.ModelRunnerOutputLike, "ModelRunnerOutput"),
]


@pytest.mark.parametrize(("proto", "name"), DATACLASSES, ids=[f"{p.__name__}-{n}" for p, n in DATACLASSES])
def test_protocol_members_are_fields_of_vllm_dataclass(proto: type, name: str, v) -> None:
    cls = getattr(v, name)
    have = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
    missing = sorted(members(proto) - have)
    assert not missing, f"vLLM {v.vllm.__version__} {name} lacks {missing}, which {proto.__name__} reads"


def test_real_scheduler_output_satisfies_protocols(step) -> None:
    so = step.so
    assert isinstance(so, P.RunnerSchedulerOutputLike)
    assert isinstance(so.scheduled_cached_reqs, P.CachedRequestDataLike)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    for new in so.scheduled_new_reqs:
        assert isinstance(new, P.NewRequestDataLike)
    # b hits the 3 full blocks a allocated in this same step (vLLM caches at allocation).
    b = so.scheduled_new_reqs[1]
    assert b.num_computed_tokens == 48 and list(b.block_ids[0][:3]) == list(so.scheduled_new_reqs[0].block_ids[0][:3])


def test_real_input_batch_and_block_table_satisfy_protocols(step) -> None:
    batch = step.runner.input_batch
    assert isinstance(batch, P.InputBatchLike)
    assert isinstance(batch.block_table, P.MultiGroupBlockTableLike)
    assert isinstance(batch.block_table[0], P.BlockTableLike)
    for proto, obj in (
        (P.InputBatchLike, batch),
        (P.MultiGroupBlockTableLike, batch.block_table),
        (P.BlockTableLike, batch.block_table[0]),
    ):
        missing = sorted(m for m in members(proto) if not hasattr(obj, m))
        assert not missing, f"{type(obj).__name__} lacks {missing}, which {proto.__name__} reads"


def test_protocol_check_fails_on_a_renamed_field() -> None:
    """The checks above can fail: an object whose field was renamed is not an instance."""
    renamed = SimpleNamespace(req_id="a", num_computed_tokens=0, block_id=([1],))
    assert not isinstance(renamed, P.NewRequestDataLike)
    assert "block_ids" in members(P.NewRequestDataLike)
    assert "resumed_req_ids" in members(P.CachedRequestDataLike)
    assert {"req_ids", "block_table"} <= members(P.InputBatchLike)


# ------------------------------------------------------------ group view on 0.33


def test_block_table_has_no_legacy_kernel_block_attrs(step) -> None:
    """0.33's table holds allocator blocks (kernel blocks are mapped in the attention metadata builder);
    if a vLLM brings these back, decide again what the group view must refuse."""
    group = step.runner.input_batch.block_table[0]
    present = [a for a in P.LEGACY_BLOCK_TABLE_ATTRS if hasattr(group, a)]
    assert not present, f"vLLM {type(group).__module__}.BlockTable has {present} again"
    assert group.block_size == BLOCK and group.dcp_world_size == 1 and group.pcp_world_size == 1


def test_group_view_reads_block_size_and_refuses_a_mismatch(v) -> None:
    """On 0.33 the block-size check reads BlockTable.block_size (no kv_cache_block_size there)."""
    cfg = SimConfig(num_blocks=32, block_size=32)
    batch = RunnerBatch(cfg, VllmOptions(), v, 1024).input_batch
    FullAttentionGroupView(batch, 32)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="block table block size 32 does not match"):
        FullAttentionGroupView(batch, BLOCK)


def test_group_view_refuses_context_parallel_read_from_real_table(step) -> None:
    """dcp/pcp world sizes are read from the real BlockTable's attributes of those names."""
    group = step.runner.input_batch.block_table[0]
    old = group.dcp_world_size
    group.dcp_world_size = 2
    try:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="dcp_world_size=2"):
            FullAttentionGroupView(step.runner.input_batch, BLOCK)
    finally:
        group.dcp_world_size = old


def test_group_view_slots_match_the_schedulers_blocks(step) -> None:
    """Slots from the real InputBatch equal block_id * block_size + offset of the scheduler's own block ids."""
    view = FullAttentionGroupView(step.runner.input_batch, BLOCK)
    so = step.so
    order = view.batch_req_ids()
    got = view.step_slots_cpu(order, so.num_scheduled_tokens)
    blocks = {n.req_id: list(n.block_ids[0]) for n in so.scheduled_new_reqs}
    starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    want = [
        blocks[r][p // BLOCK] * BLOCK + p % BLOCK
        for r in order
        for p in range(starts[r], starts[r] + so.num_scheduled_tokens[r])
    ]
    assert got.tolist() == want
    assert 0 not in {b for bs in blocks.values() for b in bs}, "block 0 is vLLM's null block"


def test_config_gate_on_real_vllm_config(step, v) -> None:
    """stage_prefix_cache_config reads vLLM 0.33's config objects; sub-block prefix matching refuses."""
    vc, kv = step.sched.vllm_config, step.sched.kv_cache_config
    args = dict(
        kv_cache_config=kv,
        kv_transfer_config=vc.kv_transfer_config,
        scheduler_config=vc.scheduler_config,
        model_config=vc.model_config,
        is_pooling_model=False,
        speculative_config=vc.speculative_config,
    )
    cfg = stage_prefix_cache_config(cache_config=vc.cache_config, **args)
    assert cfg is not None and (cfg.num_blocks, cfg.block_size) == (32, BLOCK)
    assert cfg.staging_capacity_tokens == vc.scheduler_config.max_num_batched_tokens
    finer = v.CacheConfig(block_size=BLOCK, enable_prefix_caching=True, prefix_match_unit=8)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="prefix_match_unit=8"):
        stage_prefix_cache_config(cache_config=finer, **args)
    off = v.CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    assert stage_prefix_cache_config(cache_config=off, **args) is None
    assert torch.get_num_threads() >= 1


def test_adapter_reads_the_real_scheduler_output_and_input_batch(step) -> None:
    """The adapter's getattr reads find vLLM 0.33's real fields: hits, blocks, counts, the write layout."""
    from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheSchedulerAdapter

    so = step.so
    adapter = PrefixCacheSchedulerAdapter()
    result = adapter.translate_step(so)
    assert [(e.req_id, e.kind) for e in result.events] == [
        ("a", PrefixCacheEventKind.STARTED),
        ("b", PrefixCacheEventKind.STARTED),
    ]
    for event, new in zip(result.events, so.scheduled_new_reqs, strict=True):
        assert event.hit_end == new.num_computed_tokens
        assert event.block_ids == tuple(tuple(g) for g in new.block_ids)
        assert event.scheduled_tokens == so.num_scheduled_tokens[new.req_id]
    assert dict(result.scheduled_tokens) == dict(so.num_scheduled_tokens)
    view = FullAttentionGroupView(step.runner.input_batch, BLOCK)
    layout = adapter.build_write_layout(view, num_scheduled_tokens=so.num_scheduled_tokens)
    starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    cursor = 0
    for write in layout.writes:
        n = so.num_scheduled_tokens[write.req_id]
        assert (write.row_start, write.row_end) == (cursor, cursor + n)
        assert (write.token_start, write.token_end) == (starts[write.req_id], starts[write.req_id] + n)
        cursor += n
    assert layout.total_rows == cursor == len(layout.slots_cpu)


def test_adapter_reads_real_cached_request_data(v) -> None:
    """vLLM 0.33's CachedRequestData field names: resumed ids first with their new blocks and computed count."""
    from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheSchedulerAdapter

    data = v.CachedRequestData(
        req_ids=["d", "r"],
        resumed_req_ids={"r"},
        new_token_ids=[[], []],
        all_token_ids={},
        new_block_ids=[None, ([4, 5],)],
        num_computed_tokens=[33, 32],
        num_output_tokens=[2, 0],
    )
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=data, num_scheduled_tokens={"d": 1, "r": 3})
    events = PrefixCacheSchedulerAdapter().translate_scheduler_output(so)
    assert [(e.req_id, e.kind, e.hit_end, e.block_ids, e.scheduled_tokens, e.num_output_tokens) for e in events] == [
        ("r", PrefixCacheEventKind.RESUMED, 32, ((4, 5),), 3, 0),
        ("d", PrefixCacheEventKind.EXTENDED, 33, (), 1, 2),
    ]
