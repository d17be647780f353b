"""A seed-era engine behind the host tier under vLLM 0.33's real scheduler and
OffloadingConnector (wrapped by OmniTierConnector), with the fake worker of
tools/simulate/vllm_offload.py: each step's real SchedulerOutput goes straight
to ``new_step_starts`` (no adapter), ``save_outputs`` takes its slots from the
group view, and ``materialize``'s token ranges label the rows.

A request preempted and resumed comes back in ``scheduled_cached_reqs`` with
``resumed_req_ids``; the connector loads its prefix into fresh blocks, which
other requests wrote before. Issue 46: that step gave it no event, the load
was skipped, and the next request hitting those blocks (vLLM caches them under
the loaded hashes) was served the old tenant's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.simulate.batch import SimInputBatch
from omni_prefix_cache.tools.simulate.vllm_offload import OffloadHarness, OffloadOptions
from omni_prefix_cache.tools.simulate.vllm_setup import preempt_request

BS, WIDTH = 16, 4
A = list(range(1, 4 * BS + 1))
SYNC = 1 << 30  # a sync-load budget every load fits


def oracle(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """Position p's row: a function of p and its token (distinct prompts, distinct rows)."""
    return torch.tensor([[tokens[p] * 1000.0 + p + j / 10 for j in range(WIDTH)] for p in range(start, end)])


class SeedStage:
    """The library behind the harness, driven the seed-era way."""

    def __init__(self, h: OffloadHarness) -> None:
        self.h = h
        self.batch = SimInputBatch(BS)
        config = PrefixCacheConfig(num_blocks=h.opts.num_blocks, block_size=BS, staging_capacity_tokens=512)
        view = FullAttentionGroupView(self.batch, block_size=BS)
        self.mgr = OmniPrefixCacheManager(config, view, eager=True)
        self.mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.outputs: list[tuple[str, tuple[int, int], torch.Tensor]] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1) -> None:
        self.tokens[req_id] = list(prompt)
        self.h.add_request(req_id, prompt, max_tokens)

    def step(self) -> Any:
        record = self.h.step()
        out = record.output
        starts: dict[str, int] = {}
        for n in out.scheduled_new_reqs:
            self.blocks[n.req_id] = list(n.block_ids[0])
            starts[n.req_id] = int(n.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, c, nb in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            new = [] if nb is None else list(nb[0])
            self.blocks[rid] = new if rid in cached.resumed_req_ids else self.blocks[rid] + new
            starts[rid] = int(c)
        self.mgr.new_step_starts(out)  # the seed-era form: vLLM's SchedulerOutput itself
        order = list(out.num_scheduled_tokens)
        self.batch.set_step(order, {r: self.blocks[r] for r in order}, {r: starts[r] for r in order})
        if order:
            rows = torch.cat(
                [oracle(self.tokens[r], starts[r], starts[r] + n) for r, n in out.num_scheduled_tokens.items()]
            )
            k = int(rows.shape[0])
            sid = self.mgr.save_outputs(rows, None, num_tokens_unpadded=k, num_tokens_padded=k)
            got = self.mgr.materialize(sid, order)
            assert got.hidden_states is not None
            self.outputs += [(rid, span, got.hidden_states[rid]) for rid, span in got.token_ranges.items()]
        for rid, tok in record.sampled.items():
            self.tokens[rid].append(tok)
        return record

    def finish(self, req_id: str, prompt: list[int], max_tokens: int = 1) -> list[Any]:
        self.add(req_id, prompt, max_tokens)
        records = [self.step()]
        while req_id in self.h.sched.requests:
            records.append(self.step())
            assert len(records) < 50
        return records

    def mismatches(self, only: set[str] | None = None) -> dict[str, list[tuple[int, int]]]:
        """Per request, the outputs (as ranges) whose rows are not the oracle's at the positions they name."""
        bad: dict[str, list[tuple[int, int]]] = {}
        for rid, (start, end), rows in self.outputs:
            if only is not None and rid not in only:
                continue
            tokens = self.tokens[rid]
            want = oracle(tokens, start, end) if end <= len(tokens) else None
            if want is None or not torch.equal(rows, want):
                bad.setdefault(rid, []).append((start, end))
        return bad


def test_a_resumed_requests_load_is_restored_on_the_seed_era_path(v: Any) -> None:
    h = OffloadHarness(OffloadOptions(block_size=BS, sync_load_budget_bytes=SYNC), v)
    stage = SeedStage(h)
    try:
        stage.finish("a", A)
        pool = h.sched.kv_cache_manager.block_pool
        req = h.v.Request("probe", A, h.v.SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
        hashes = list(h.connector.kv_block_hashes(req))
        for i in range(1, 6):  # other prompts take every GPU block until A's are evicted
            stage.finish(f"x{i}", list(range(1000 * i, 1000 * i + 14 * BS)))
            if all(pool.get_cached_block(x, [0]) is None for x in hashes):
                break
        else:
            raise AssertionError("the GPU prefix cache kept A's blocks")
        stage.add("a2", [*A, 7, 8, 9], 4)
        stage.step()  # sync load of A's 4 blocks, prefill of the rest
        stage.step()  # decode
        a2_blocks = set(h.sched.kv_cache_manager.get_block_ids("a2")[0])
        preempt_request(h.sched, h.request("a2"), 0.0)
        h.sched.kv_cache_manager.evict_blocks(a2_blocks)  # its blocks leave vLLM's prefix cache: the resume loads
        records = []
        while "a2" in h.sched.requests and len(records) < 20:
            records.append(stage.step())
        resumed = [r for r in records if "a2" in r.output.scheduled_cached_reqs.resumed_req_ids]
        assert resumed and resumed[0].tier is not None and "a2" in resumed[0].tier.loads
        loaded_into = set(stage.blocks["a2"][:4])
        assert loaded_into - a2_blocks, "the resume's load landed only in a2's own old blocks: nothing stale to serve"
        # c hits the loaded blocks locally (vLLM cached them under A's hashes).
        stage.finish("c", [*A, 5])
        restored = stage.mgr.components.tier_desk.stats()["host_tier_restored"]
    finally:
        stage.mgr.shutdown()
        h.close()
    assert stage.mismatches({"c"}) == {}, f"row oracle: c was served other requests' rows: {stage.mismatches({'c'})}"
    assert stage.mismatches() == {}, f"row oracle: outputs whose rows are not their positions' {stage.mismatches()}"
    assert restored >= 4 + 4  # a2's first load and its resume's
