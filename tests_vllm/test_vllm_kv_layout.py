"""KV cache layouts on vLLM 0.33's real pieces: a hybrid model's groups (a
full-attention group beside a sliding-window or Mamba group) in the real
scheduler and the real InputBatch (one block table per group), kernel blocks
smaller than the KV block (vLLM's AttentionGroup), and the tier connector's
hashes of a hybrid layout. Each slot check compares the group view with the
block ids vLLM's own KV cache manager handed out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.worker.utils import AttentionGroup

from omni_prefix_cache.group_view import FullAttentionGroupView, get_prefix_cache_group_view
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.tools.simulate import SimConfig
from omni_prefix_cache.tools.simulate.vllm_engine import RunnerBatch, VllmOptions, VllmScheduler
from omni_prefix_cache.tools.simulate.vllm_offload import OffloadHarness, OffloadOptions
from omni_prefix_cache.tools.simulate.vllm_setup import KV_LAYOUTS, SLIDING_WINDOW_BLOCKS
from omni_prefix_cache.tools.simulate.workload import RequestSpec

BLOCK = 16
HYBRID = [name for name in KV_LAYOUTS if name != "full"]
PROMPT = tuple(range(100, 200))  # 100 tokens: 6 full blocks, longer than the sliding window


def _run_until(sched: VllmScheduler, runner: RunnerBatch, req_id: str) -> Any:
    """Step the real scheduler (and the runner's batch) until ``req_id`` is scheduled as new."""
    for step in range(40):
        plan = sched.schedule(step)
        runner.update_states(plan.output)
        new = [n for n in plan.output.scheduled_new_reqs if n.req_id == req_id]
        if new:
            return plan, new[0]
        sched.update(plan)
    raise AssertionError(f"{req_id!r} was never scheduled")


def _expected_slots(blocks: list[int], start: int, n: int, bs: int = BLOCK) -> list[int]:
    return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]


@pytest.fixture(params=HYBRID)
def hybrid(request: pytest.FixtureRequest, v: Any) -> Any:
    """A request, then one that hits its prefix (96 tokens), under a hybrid layout."""
    cfg = SimConfig(seed=0, num_blocks=64, block_size=BLOCK)
    trace = [RequestSpec("a", 0, (PROMPT,), 2), RequestSpec("b", 4, (PROMPT + (7,) * 20,), 2)]
    opts = VllmOptions(kv_layout=request.param)
    sched = VllmScheduler(cfg, opts, v, trace)
    runner = RunnerBatch(
        cfg, opts, v, sched.vllm_config.model_config.max_model_len, sched.kv_cache_config, sched.vllm_config
    )
    yield SimpleNamespace(layout=request.param, sched=sched, runner=runner)
    sched.close()


def test_the_view_reads_the_full_attention_groups_table_slot_exact(hybrid: Any) -> None:
    """The gate picks the full-attention group on vLLM's config; a hit longer than the window
    comes with vLLM's null block in the other group, and the view's slots are the keyed
    group's blocks as the scheduler handed them out."""
    sched, runner = hybrid.sched, hybrid.runner
    kinds = KV_LAYOUTS[hybrid.layout]
    assert sched.group == kinds.index("full")
    groups = sched.kv_cache_config.kv_cache_groups
    view = get_prefix_cache_group_view(runner.input_batch, BLOCK, groups)
    assert view is not None and view.group_index == sched.group
    plan, b = _run_until(sched, runner, "b")
    assert b.num_computed_tokens == 96 > SLIDING_WINDOW_BLOCKS * BLOCK
    other = 1 - sched.group
    assert 0 in b.block_ids[other][: 96 // BLOCK], f"no null block before the window in {b.block_ids}"
    assert 0 not in b.block_ids[sched.group], "vLLM's null block in the full-attention group"
    n = plan.output.num_scheduled_tokens["b"]
    got = view.step_slots_cpu(["b"], {"b": n}).tolist()
    assert got == _expected_slots(list(b.block_ids[sched.group]), 96, n)
    # The other group's table gives other slots (so the check above can fail), or none at all (Mamba).
    if kinds[other] == "mamba":
        with pytest.raises(OmniPrefixCacheUnmatchError, match="maps no token slots"):
            FullAttentionGroupView(runner.input_batch, BLOCK, other)
    else:
        wrong = FullAttentionGroupView(runner.input_batch, BLOCK, other).step_slots_cpu(["b"], {"b": n}).tolist()
        assert wrong != got


@pytest.mark.parametrize("kernel", [16, 32])
def test_kernel_blocks_smaller_than_the_kv_block_address_the_views_slots(kernel: int, v: Any) -> None:
    """vLLM 0.33 keeps allocator blocks in the input batch's table and maps them to kernel
    blocks in AttentionGroup.map_to_kernel_block_table (kernel block j of block b is
    b * (64 // kernel) + j): the slot a kernel addresses for a position is the view's."""
    bs = 64
    cfg = SimConfig(seed=0, num_blocks=32, block_size=bs)
    trace = [RequestSpec("a", 0, (tuple(range(100, 250)),), 2), RequestSpec("b", 0, (tuple(range(300, 340)),), 2)]
    sched = VllmScheduler(cfg, VllmOptions(), v, trace)
    try:
        runner = RunnerBatch(cfg, VllmOptions(), v, sched.vllm_config.model_config.max_model_len)
        plan = sched.schedule(0)
        order = runner.update_states(plan.output)
        assert sched.prefix_cache_config.block_size == bs  # the gate accepts it
        view = FullAttentionGroupView(runner.input_batch, bs)
        counts = plan.output.num_scheduled_tokens
        slots = view.step_slots_cpu(order, counts).tolist()
        spec = sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        group = AttentionGroup(None, [], spec, 0, kernel_block_size=kernel)  # type: ignore[arg-type]
        table = runner.input_batch.block_table[0].block_table.cpu[: len(order)]
        group.kernel_block_table = torch.zeros((1, *table.shape), dtype=torch.int32).repeat(1, 1, bs // kernel)
        group.kernel_block_offsets = torch.arange(bs // kernel, dtype=torch.int32)
        kernel_table = group.map_to_kernel_block_table(table)
        batch = runner.input_batch
        want = []
        for rid in order:
            row, start = batch.req_id_to_index[rid], int(batch.num_computed_tokens_cpu[batch.req_id_to_index[rid]])
            want += [
                int(kernel_table[row, p // kernel]) * kernel + p % kernel for p in range(start, start + counts[rid])
            ]
        assert slots == want and len(slots) == sum(counts.values())
    finally:
        sched.close()


@pytest.mark.parametrize("layout", HYBRID)
def test_the_tier_connector_keys_its_hashes_by_the_full_attention_groups_blocks(layout: str, v: Any) -> None:
    """The wrapper picks the same group as the gate: a finished request's blocks it binds are
    that group's (its block ids differ from the other group's)."""
    h = OffloadHarness(OffloadOptions(block_size=BLOCK, num_blocks=32, kv_layout=layout), v)
    try:
        full = KV_LAYOUTS[layout].index("full")
        assert h.connector.group_index == full and h.connector.block_size == BLOCK
        prompt = list(range(1, 4 * BLOCK + 1))
        h.add_request("a", prompt, 1)
        records = [h.step()]
        blocks = [list(g) for g in records[0].output.scheduled_new_reqs[0].block_ids]
        while "a" in h.sched.requests:
            records.append(h.step())
            cached = records[-1].output.scheduled_cached_reqs
            for more in (nb for rid, nb in zip(cached.req_ids, cached.new_block_ids) if rid == "a" and nb):
                for ids, new in zip(blocks, more):
                    ids.extend(new)
        records.append(h.step())  # the finish's binds go out with the next step's metadata
        bound = {b.block_hash: b.block_id for r in records if r.tier is not None for b in r.tier.bind}
        req = v.Request("probe", prompt, v.SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
        hashes = h.connector.kv_block_hashes(req)
        assert [bound[x] for x in hashes[:4]] == list(blocks[full][:4])
        assert list(blocks[full][:4]) != list(blocks[1 - full][:4])
    finally:
        h.close()
