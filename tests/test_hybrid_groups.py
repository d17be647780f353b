"""A hybrid model's steps on the manager: two KV cache groups, a sliding-window
one (group 0, vLLM's null block before its window) and a full-attention one
(group 1, the keyed group). The view, the write layout, the hit planner and
the host tier's restores all read group 1 (``kv_cache_group_index``), and every
request gets exactly its own rows. Keyed by the sliding-window group instead,
a hit longer than the window fails loudly."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tier.metadata import TierBind, TierLoad, TierStepMetadata

BS, HIDDEN, NULL = 4, 8, 0  # block 0 is vLLM's null block
SLIDING, FULL = 0, 1


@dataclass
class NewRequest:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]  # (sliding window, full attention)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    scheduled_cached_reqs: Any = None


class Table:
    """One group of vLLM's MultiGroupBlockTable."""

    def __init__(self, mode: str = "token_to_kv_slot") -> None:
        self.block_size = BS
        self.slot_mapping_mode = SimpleNamespace(value=mode)
        self.block_table = SimpleNamespace(cpu=torch.zeros((1, 1), dtype=torch.int32))


class Tables:
    def __init__(self, *tables: Table) -> None:
        self.block_tables = list(tables)

    def __getitem__(self, i: int) -> Table:
        return self.block_tables[i]


class HybridBatch:
    """The slice of vLLM's InputBatch a group view reads, one block table per group."""

    def __init__(self, groups: int = 2) -> None:
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = torch.zeros((1,), dtype=torch.int32)
        self.block_table = Tables(*(Table() for _ in range(groups)))

    def set_rows(self, rows: dict[str, tuple[int, tuple[list[int], ...]]]) -> None:
        order = list(rows)
        for g, table in enumerate(self.block_table.block_tables):
            width = max([1, *(len(rows[r][1][g]) for r in order)])
            t = torch.zeros((max(1, len(order)), width), dtype=torch.int32)
            for i, r in enumerate(order):
                t[i, : len(rows[r][1][g])] = torch.tensor(rows[r][1][g], dtype=torch.int32)
            table.block_table.cpu = t
        self.req_ids = list(order)
        self.req_id_to_index = {r: i for i, r in enumerate(order)}
        self.num_computed_tokens_cpu = torch.tensor([rows[r][0] for r in order] or [0], dtype=torch.int32)


def forward(tokens: list[int], start: int) -> torch.Tensor:
    """One row per token, a function of its position and token (the row oracle)."""
    return torch.tensor([[tok + pos / 100 + j for j in range(HIDDEN)] for pos, tok in enumerate(tokens, start)])


class Engine:
    def __init__(self, eager: bool, group: int = FULL) -> None:
        config = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=64, kv_cache_group_index=group)
        self.mgr = OmniPrefixCacheManager(config, eager=eager)
        self.mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.batch = HybridBatch()
        self.cache = PrefixCacheEngineHelper(self.mgr, FullAttentionGroupView(self.batch, BS, group), consumer="t")
        self.got: dict[str, torch.Tensor] = {}

    def step(self, out: SchedulerOutput, rows: dict[str, Any], new: torch.Tensor | None) -> None:
        self.cache.begin_step(out)
        self.batch.set_rows(rows)
        if new is None:
            return
        n = int(new.shape[0])
        saved = self.cache.save(new, None, num_tokens_unpadded=n, num_tokens_padded=n)

        def build(view: Any) -> dict[str, torch.Tensor]:
            return {rid: r.clone() for rid, r in (view.hidden_states or {}).items()}

        def publish(payload: dict[str, torch.Tensor], live: Any) -> None:
            for rid in live:
                old = self.got.get(rid)
                self.got[rid] = payload[rid] if old is None else torch.cat([old, payload[rid]])

        self.cache.output_builder(saved, build, publish)()

    def check(self, prompts: dict[str, list[int]]) -> None:
        """The row oracle: every request received exactly its own rows."""
        for rid, tokens in prompts.items():
            got, want = self.got.get(rid), forward(tokens, 0)
            if got is None or not torch.equal(got, want):
                wrong = None if got is None or got.shape != want.shape else (got != want).any(dim=1).nonzero()
                raise AssertionError(f"row oracle: request {rid!r} got wrong rows at positions {wrong}")


PROMPT = list(range(11, 23))  # 3 blocks
TAIL = [91, 92]
# a: sliding-window blocks 1-3, full-attention blocks 4-6. b hits a's first two blocks
# (8 tokens, longer than a one-block window): its sliding-window group holds the null
# block for the first one, its full-attention group a's blocks 4 and 5.
A_BLOCKS = ([1, 2, 3], [4, 5, 6])
B_BLOCKS = ([NULL, 2, 7], [4, 5, 8])


def _a_then_b_hits_past_the_window(engine: Engine) -> None:
    engine.step(SchedulerOutput({"a": 12}, [NewRequest("a", 0, A_BLOCKS)]), {"a": (0, A_BLOCKS)}, forward(PROMPT, 0))
    out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, B_BLOCKS)], {"a"})
    engine.step(out, {"b": (8, B_BLOCKS)}, forward([*PROMPT[:8], *TAIL][8:], 8))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_block_that_moved_between_groups_serves_the_keyed_groups_rows(eager: bool) -> None:
    """The groups share one block pool: c's full-attention blocks 1 and 2, once freed, become
    a's sliding-window blocks, and b's hit (within the window: no null block) names them in
    group 0 beside a's full-attention blocks 4 and 5 in group 1. Their slots still hold c's
    rows (nothing mirrors a sliding-window group): read by group 0, b would get c's rows."""
    other = list(range(61, 69))
    engine = Engine(eager)
    try:
        c_blocks = ([8, 9], [1, 2])
        engine.step(SchedulerOutput({"c": 8}, [NewRequest("c", 0, c_blocks)]), {"c": (0, c_blocks)}, forward(other, 0))
        a_blocks = ([1, 2, 3], [4, 5, 6])
        out = SchedulerOutput({"a": 12}, [NewRequest("a", 0, a_blocks)], {"c"})
        engine.step(out, {"a": (0, a_blocks)}, forward(PROMPT, 0))
        b_blocks = ([1, 2, 7], [4, 5, 10])
        out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, b_blocks)], {"a"})
        engine.step(out, {"b": (8, b_blocks)}, forward(TAIL, 8))
    finally:
        engine.mgr.shutdown()
    engine.check({"c": other, "a": PROMPT, "b": [*PROMPT[:8], *TAIL]})


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_rows_keyed_by_the_full_attention_group_serve_a_hit_longer_than_the_window(eager: bool) -> None:
    engine = Engine(eager)
    try:
        _a_then_b_hits_past_the_window(engine)
    finally:
        engine.mgr.shutdown()
    engine.check({"a": PROMPT, "b": [*PROMPT[:8], *TAIL]})


def test_keyed_by_the_sliding_window_group_the_same_hit_fails_loudly() -> None:
    """Why the gate picks the full-attention group: the null block's slots were never written."""
    engine = Engine(True, group=SLIDING)
    try:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="never written"):
            _a_then_b_hits_past_the_window(engine)
    finally:
        engine.mgr.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_tier_load_restores_the_full_attention_groups_blocks(eager: bool) -> None:
    """The host tier binds and restores blocks of the keyed group (tier_fill reads its block ids)."""
    hashes = (b"h0" * 8, b"h1" * 8)
    engine = Engine(eager)
    try:
        engine.step(
            SchedulerOutput({"a": 12}, [NewRequest("a", 0, A_BLOCKS)]), {"a": (0, A_BLOCKS)}, forward(PROMPT, 0)
        )
        other = list(range(51, 63))
        c_blocks = ([1, 2, 3], [4, 5, 6])  # c reuses a's blocks: the tier keeps a's rows of blocks 4 and 5
        tier = SimpleNamespace(omni_tier=TierStepMetadata(bind=(TierBind(hashes[0], 4), TierBind(hashes[1], 5))))
        engine.step(
            SchedulerOutput({"c": 12}, [NewRequest("c", 0, c_blocks)], {"a"}, tier),
            {"c": (0, c_blocks)},
            forward(other, 0),
        )
        # Loaded by a KV connector into blocks 4 and 5 again (c's rows there until the restore).
        b_blocks = ([NULL, 9, 10], [4, 5, 11])
        load = SimpleNamespace(omni_tier=TierStepMetadata(loads={"b": TierLoad("b", 0, hashes)}))
        out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, b_blocks)], {"c"}, load)
        engine.step(out, {"b": (8, b_blocks)}, forward(TAIL, 8))
        restored = engine.mgr.components.tier_desk.tier
        assert restored is not None and restored.stats["restored"] == 2
    finally:
        engine.mgr.shutdown()
    engine.check({"a": PROMPT, "c": other, "b": [*PROMPT[:8], *TAIL]})


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_resume_loaded_past_its_consumers_restores_the_full_attention_groups_blocks(eager: bool) -> None:
    """b is preempted after its consumer got all 8 prompt rows, c reuses its blocks (the tier
    keeps b's rows), and b resumes with its prompt loaded by a KV connector into blocks 10 and
    11, which e's rows last held. No hit is served (nothing is missing), but the restore must
    land in the keyed group's blocks: d's later local hit on them reads b's rows, not e's."""
    hashes = (b"b0" * 8, b"b1" * 8)
    e_tokens, b_tokens, c_tokens = list(range(31, 39)), PROMPT[:8], list(range(61, 69))
    engine = Engine(eager)
    try:
        e_blocks = ([7, 8], [10, 11])
        engine.step(
            SchedulerOutput({"e": 8}, [NewRequest("e", 0, e_blocks)]), {"e": (0, e_blocks)}, forward(e_tokens, 0)
        )
        b_blocks = ([1, 2], [4, 5])
        out = SchedulerOutput({"b": 8}, [NewRequest("b", 0, b_blocks)], {"e"})
        engine.step(out, {"b": (0, b_blocks)}, forward(b_tokens, 0))
        # b preempted (its blocks freed); c takes blocks 4 and 5, the tier keeps b's rows of them.
        binds = SimpleNamespace(omni_tier=TierStepMetadata(bind=(TierBind(hashes[0], 4), TierBind(hashes[1], 5))))
        c_blocks = ([1, 2], [4, 5])
        out = SchedulerOutput({"c": 8}, [NewRequest("c", 0, c_blocks)], set(), binds)
        engine.step(out, {"c": (0, c_blocks)}, forward(c_tokens, 0))
        resumed = ([NULL, 9, 12], [10, 11, 13])
        cached = SimpleNamespace(
            req_ids=["b"],
            resumed_req_ids={"b"},
            num_computed_tokens=[8],
            new_block_ids=[resumed],
            num_output_tokens=[0],
        )
        load = SimpleNamespace(omni_tier=TierStepMetadata(loads={"b": TierLoad("b", 0, hashes)}))
        out = SchedulerOutput({"b": 1}, [], {"c"}, load, cached)
        engine.step(out, {"b": (8, resumed)}, forward([99], 8))
        d_blocks = ([NULL, 14, 15], [10, 11, 15])
        out = SchedulerOutput({"d": 2}, [NewRequest("d", 8, d_blocks)], {"b"})
        engine.step(out, {"d": (8, d_blocks)}, forward(TAIL, 8))
    finally:
        engine.mgr.shutdown()
    engine.check({"e": e_tokens, "b": [*b_tokens, 99], "c": c_tokens, "d": [*b_tokens, *TAIL]})


def test_the_view_reads_the_configured_table_and_refuses_what_it_cannot_key_by() -> None:
    batch = HybridBatch()
    batch.set_rows({"r": (0, ([7, 8], [2, 3]))})
    assert FullAttentionGroupView(batch, BS, FULL).step_slots_cpu(["r"], {"r": 6}).tolist() == [8, 9, 10, 11, 12, 13]
    assert FullAttentionGroupView(batch, BS, SLIDING).step_slots_cpu(["r"], {"r": 2}).tolist() == [28, 29]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="input batch has 2 block tables.*pass group_index="):
        FullAttentionGroupView(batch, BS)  # a hybrid batch names its keyed group: never group 0 by default
    assert FullAttentionGroupView(HybridBatch(groups=1), BS).group_index == 0
    with pytest.raises(OmniPrefixCacheUnmatchError, match="keyed by KV cache group 2, but the input batch has 2"):
        FullAttentionGroupView(batch, BS, 2)
    batch.block_table.block_tables[0].slot_mapping_mode = SimpleNamespace(value="none")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="maps no token slots"):
        FullAttentionGroupView(batch, BS, 0)


def test_a_view_of_another_group_than_the_config_keys_is_refused() -> None:
    config = PrefixCacheConfig(num_blocks=16, block_size=BS, kv_cache_group_index=FULL)
    view = FullAttentionGroupView(HybridBatch(), BS, SLIDING)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="reads KV cache group 0, but .*kv_cache_group_index is 1"):
        OmniPrefixCacheManager(config, view, eager=True)
    mgr = OmniPrefixCacheManager(config, eager=True)
    try:
        assert mgr.kv_cache_group_index == FULL
        with pytest.raises(OmniPrefixCacheUnmatchError, match="build the view with group_index=1"):
            PrefixCacheEngineHelper(mgr, view)
        PrefixCacheEngineHelper(mgr, FullAttentionGroupView(HybridBatch(), BS, FULL))
    finally:
        mgr.shutdown()


def test_a_hit_without_the_keyed_groups_block_ids_is_refused_naming_the_group() -> None:
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=BS, kv_cache_group_index=FULL), eager=True)
    try:
        hits = mgr.components.hits
        assert hits.hit_blocks("b", 8, B_BLOCKS) == [4, 5]
        with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="block ids of 1 KV cache group.*by group 1"):
            hits.hit_blocks("b", 8, ([2, 3],))
        with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="only 1 group-1 block ids"):
            hits.hit_blocks("b", 8, ([2, 3], [4]))
    finally:
        mgr.shutdown()
