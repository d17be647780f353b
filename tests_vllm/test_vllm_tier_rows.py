"""Rows through the host tier under vLLM 0.33's real scheduler and OffloadingConnector:
every step's real SchedulerOutput (the wrapper's metadata inside) drives the
manager, and every request gets exactly its own rows, including one whose KV
came back from offload into new blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
from omni_prefix_cache.group_view import FullAttentionGroupView, stage_prefix_cache_config
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.simulate.batch import SimInputBatch
from omni_prefix_cache.tools.simulate.vllm_offload import OffloadHarness, OffloadOptions

BS, WIDTH = 16, 4
A = list(range(1, 4 * BS + 1))


def oracle(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """Position p's row: a function of p and its token (distinct prompts, distinct rows)."""
    return torch.tensor([[tokens[p] * 1000.0 + p + j / 10 for j in range(WIDTH)] for p in range(start, end)])


class Batch(SimInputBatch):
    """The slice of vLLM's InputBatch the group view reads (the simulation's), set per step."""

    def __init__(self) -> None:
        super().__init__(BS)

    def set_rows(self, rows: dict[str, tuple[int, list[int]]]) -> None:
        """``rows``: request -> (computed tokens, block ids), in batch order."""
        self.set_step(list(rows), {r: b for r, (_, b) in rows.items()}, {r: c for r, (c, _) in rows.items()})


class Stage:
    """The library behind the harness: one manager fed each real step."""

    def __init__(self, h: OffloadHarness, eager: bool, host_tier_bytes: int | None = None) -> None:
        self.h = h
        vc = h.vllm_config
        # The stage gate admits the wrapper (a plain OffloadingConnector is refused).
        cfg = stage_prefix_cache_config(
            kv_cache_config=h.kv_cache_config,
            cache_config=vc.cache_config,
            kv_transfer_config=vc.kv_transfer_config,
            scheduler_config=vc.scheduler_config,
            model_config=vc.model_config,
            is_pooling_model=False,
            speculative_config=vc.speculative_config,
        )
        assert cfg is not None
        config = PrefixCacheConfig(
            num_blocks=h.opts.num_blocks, block_size=BS, staging_capacity_tokens=512, host_tier_bytes=host_tier_bytes
        )
        self.mgr = OmniPrefixCacheManager(config, eager=eager)
        self.mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.batch = Batch()
        self.cache = PrefixCacheEngineHelper(self.mgr, FullAttentionGroupView(self.batch, block_size=BS), consumer="t")
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.got: dict[str, torch.Tensor] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1) -> None:
        self.tokens[req_id] = list(prompt)
        self.h.add_request(req_id, prompt, max_tokens)

    def step(self, fail_loads: Any = ()) -> Any:
        record = self.h.step(fail_loads)
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
        self.cache.begin_step(out)
        order = list(out.num_scheduled_tokens)
        self.batch.set_rows({r: (starts[r], self.blocks[r]) for r in order})
        if order:
            rows = torch.cat(
                [oracle(self.tokens[r], starts[r], starts[r] + n) for r, n in out.num_scheduled_tokens.items()]
            )
            k = int(rows.shape[0])
            saved = self.cache.save(rows, None, num_tokens_unpadded=k, num_tokens_padded=k)
            self.cache.output_builder(saved, self._build, self._publish)()
        for rid, tok in record.sampled.items():
            self.tokens[rid].append(tok)
        return record

    @staticmethod
    def _build(view: Any) -> dict[str, torch.Tensor]:
        return {rid: r.clone() for rid, r in (view.hidden_states or {}).items()}

    def _publish(self, payload: dict[str, torch.Tensor], live: Any) -> None:
        for rid in live:
            old = self.got.get(rid)
            self.got[rid] = payload[rid] if old is None else torch.cat([old, payload[rid]])

    def finish(self, req_id: str, prompt: list[int], max_tokens: int = 1, fail_first: Any = ()) -> list[Any]:
        """Run ``req_id`` to its end (``fail_first``: the first step's failed loads)."""
        self.add(req_id, prompt, max_tokens)
        records = [self.step(fail_first)]
        while req_id in self.h.sched.requests:
            records.append(self.step())
            assert len(records) < 50
        return records

    def mismatches(self) -> dict[str, int]:
        """Rows per request that differ from the oracle (missing rows count too)."""
        bad: dict[str, int] = {}
        for rid, got in self.got.items():
            want = oracle(self.tokens[rid], 0, int(got.shape[0]))
            n = int((got != want).any(dim=1).sum())
            if n:
                bad[rid] = n
        return bad


SYNC = 1 << 30  # a sync-load budget every load fits
# scenario -> (OffloadOptions fields, blocks the tier keeps of A's 4, the first step's failed loads,
#              blocks of A2 restored from the tier)
SCENARIOS: dict[str, tuple[dict[str, Any], int, Any, int]] = {
    "async": ({}, 4, (), 4),
    "sync": ({"sync_load_budget_bytes": SYNC}, 4, (), 4),
    "partial-async": ({}, 2, (), 2),
    "partial-sync": ({"sync_load_budget_bytes": SYNC}, 2, (), 2),
    "failed-async": ({}, 4, {"a2": 2}, 2),  # blocks 2-3 fail: vLLM keeps 0-1, recomputes the rest
    "failed-sync": ({"sync_load_budget_bytes": SYNC}, 4, {"a2": 1}, 4),  # restored, then recomputed from block 1
    "small-tier": ({"tier_max_bytes": 6 * BS * 256, "tier_bytes_per_token": 256}, 0, (), 0),  # released: recomputed
}


def _hashes_of(h: OffloadHarness, prompt: list[int]) -> list[bytes]:
    req = h.v.Request("probe", prompt, h.v.SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    return list(h.connector.kv_block_hashes(req))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_request_whose_kv_came_back_from_offload_gets_exactly_its_own_rows(
    v: Any, eager: bool, scenario: str
) -> None:
    opts, kept, fail_first, restored = SCENARIOS[scenario]
    h = OffloadHarness(OffloadOptions(block_size=BS, **opts), v)
    stage = Stage(h, eager)
    try:
        stage.finish("a", A)
        pool = h.sched.kv_cache_manager.block_pool
        hashes = _hashes_of(h, A)
        for i in range(1, 6):  # other prompts take every GPU block until A's are evicted
            stage.finish(f"x{i}", list(range(1000 * i, 1000 * i + 14 * BS)))
            if all(pool.get_cached_block(x, [0]) is None for x in hashes):
                break
        else:
            raise AssertionError("the GPU prefix cache kept A's blocks")
        if kept < 4 and scenario != "small-tier":
            h.connector.index.forget(hashes[kept:])  # the tier holds A's first `kept` blocks only
        records = stage.finish("a2", [*A, 7, 8, 9], 2, fail_first)
        loads = [r.tier.loads["a2"] for r in records if r.tier is not None and "a2" in r.tier.loads]
        assert [len(x.hashes) for x in loads] == ([restored] if restored else [])
        tier = stage.mgr._tier_desk.tier
        assert tier is not None and tier.stats["restored"] == restored
        assert int(stage.got["a2"].shape[0]) == len(A) + 3 + 1  # every position once: 3 computed, 1 decoded
    finally:
        stage.mgr.shutdown()
        h.close()
    assert stage.mismatches() == {}, f"row oracle: mismatched rows per request {stage.mismatches()}"


BLOCK_ROWS = BS * WIDTH * 4  # one block's hidden rows (float32), the only key here
# The worker's PrefixCacheConfig.host_tier_bytes against the scheduler side's omni_tier_max_bytes (1 MiB at
# 256 bytes per token: 256 blocks): below one block, and below what the scheduler side admits.
BUDGETS = {"below-one-block": 1, "below-the-schedulers": 2 * BLOCK_ROWS}


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_fill_the_worker_does_not_keep_is_forgotten_and_vllm_recomputes_it(v: Any, eager: bool, budget: str) -> None:
    """Issue 46: with the worker's bound below what the scheduler side admits,
    every fill past it was lost while the scheduler side's index still offered
    the hash, and the first load of one raised inside new_step_starts. Now the
    worker keeps such a fill as a surplus and reports its hash in the step's
    worker metadata; the index forgets it, so no load of it is offered (vLLM
    recomputes those blocks) and every row is right."""
    h = OffloadHarness(OffloadOptions(block_size=BS, sync_load_budget_bytes=SYNC), v)
    stage = Stage(h, eager, host_tier_bytes=BUDGETS[budget])
    try:
        stage.finish("a", A)
        pool = h.sched.kv_cache_manager.block_pool
        hashes = _hashes_of(h, A)
        for i in range(1, 6):  # other prompts take every GPU block until A's are evicted (their fills)
            stage.finish(f"x{i}", list(range(1000 * i, 1000 * i + 14 * BS)))
            if all(pool.get_cached_block(x, [0]) is None for x in hashes):
                break
        else:
            raise AssertionError("the GPU prefix cache kept A's blocks")
        tier_now = stage.mgr.components.tier_desk.tier
        assert tier_now is not None
        for entry in list(tier_now.entries.values()):  # join the fills in flight on the prefetch thread
            if entry.fill is not None:
                entry.fill.exception()
        stage.step()  # their settle: kept, or kept apart and reported
        stage.step()  # the reports reach the scheduler side (the fake worker drains before the stage steps)
        forgotten = [x for x in hashes if x not in h.connector.index]
        records = stage.finish("a2", [*A, 7, 8, 9], 2)  # before: its load of a lost hash raised in new_step_starts
        loaded = [x for r in records if r.tier is not None and "a2" in r.tier.loads for x in r.tier.loads["a2"].hashes]
        assert forgotten, "the scheduler side's index still offers every hash the worker could not keep"
        assert not set(loaded) & set(forgotten)  # a hash the worker handed back is never loaded
        tier = stage.mgr.components.tier_desk.stats()
        assert tier["host_tier_surplus"] > 0 and tier["host_tier_lost"] == 0
        assert h.connector.forgotten >= len(forgotten)
    finally:
        stage.mgr.shutdown()
        h.close()
    assert stage.mismatches() == {}, f"row oracle: mismatched rows per request {stage.mismatches()}"
