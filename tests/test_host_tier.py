"""The host tier on the manager: a block's rows survive its reuse and come back
when a KV connector loads that block into new slots (spec/host_tier.yaml).

The steps are seed-era scheduler outputs carrying the tier's metadata in
``kv_connector_metadata.omni_tier``, as the wrapper connector sends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.specs.types.host_tier import TierState
from omni_prefix_cache.tier.metadata import TierBind, TierLoad, TierStepMetadata
from omni_prefix_cache.tools.simulate.batch import SimInputBatch

BS, HIDDEN = 4, 8


@dataclass
class NewRequest:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None


class InputBatch(SimInputBatch):
    """The slice of vLLM's InputBatch the group view reads (the simulation's), set per step."""

    def __init__(self) -> None:
        super().__init__(BS)

    def set_rows(self, rows: dict[str, tuple[int, list[int]]]) -> None:
        """``rows``: request -> (computed tokens, block ids), in batch order."""
        self.set_step(list(rows), {r: b for r, (_, b) in rows.items()}, {r: c for r, (c, _) in rows.items()})


def forward(tokens: list[int], start: int) -> torch.Tensor:
    """One row per token, a function of its position and token (the row oracle)."""
    return torch.tensor([[tok + pos / 100 + j for j in range(HIDDEN)] for pos, tok in enumerate(tokens, start)])


def meta(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(omni_tier=TierStepMetadata(**fields))


class Engine:
    """One stage: the manager, its helper, the batch and what each request received."""

    def __init__(self, eager: bool, host_tier_bytes: int | None = None) -> None:
        config = PrefixCacheConfig(
            num_blocks=16, block_size=BS, staging_capacity_tokens=64, host_tier_bytes=host_tier_bytes
        )
        self.mgr = OmniPrefixCacheManager(config, eager=eager)
        self.mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.batch = InputBatch()
        self.cache = PrefixCacheEngineHelper(self.mgr, FullAttentionGroupView(self.batch, block_size=BS), consumer="t")
        self.got: dict[str, torch.Tensor] = {}

    def step(self, out: SchedulerOutput, rows: dict[str, tuple[int, list[int]]], new: torch.Tensor | None) -> None:
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


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
OTHER = [51, 52, 53, 54, 55, 56, 57, 58]
HA = (b"a0" * 8, b"a1" * 8)


def _reuse_then_load(engine: Engine) -> None:
    """a fills blocks 0-1, c reuses them, then b (a's prompt + 2) is loaded into blocks 2-3."""
    engine.step(SchedulerOutput({"a": 8}, [NewRequest("a", 0, ([0, 1],))]), {"a": (0, [0, 1])}, forward(PROMPT, 0))
    binds = tuple(TierBind(h, b) for h, b in zip(HA, (0, 1)))
    out = SchedulerOutput({"c": 8}, [NewRequest("c", 0, ([0, 1],))], {"a"}, meta(bind=binds))
    engine.step(out, {"c": (0, [0, 1])}, forward(OTHER, 0))
    load = TierLoad("b", 0, HA)
    out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, ([2, 3, 4],))], {"c"}, meta(loads={"b": load}))
    engine.step(out, {"b": (8, [2, 3, 4])}, forward([19, 20], 8))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_loaded_block_gets_the_rows_of_its_hash_not_of_its_slots(eager: bool) -> None:
    engine = Engine(eager)
    try:
        _reuse_then_load(engine)
        tier = engine.mgr._tier_desk.tier
        assert tier is not None
        assert {tier.state_of(h) for h in HA} == {TierState.HELD}
        assert tier.stats["fills"] == 2 and tier.stats["restored"] == 2
        tier.check_invariants(BS)
        # A later request hits the loaded blocks locally (vLLM cached them under a's hashes).
        out = SchedulerOutput({"d": 1}, [NewRequest("d", 8, ([2, 3, 5],))], {"b"})
        engine.step(out, {"d": (8, [2, 3, 5])}, forward([21], 8))
    finally:
        engine.mgr.shutdown()
    _oracle(engine, {"a": PROMPT, "c": OTHER, "b": [*PROMPT, 19, 20], "d": [*PROMPT, 21]})


def _oracle(engine: Engine, prompts: dict[str, list[int]]) -> None:
    """Every request received exactly its own rows (the row oracle)."""
    for rid, tokens in prompts.items():
        got, want = engine.got.get(rid), forward(tokens, 0)
        if got is None or not torch.equal(got, want):
            bad = (
                None
                if got is None or got.shape != want.shape
                else (got != want).any(dim=1).nonzero().flatten().tolist()
            )
            raise AssertionError(
                f"row oracle: request {rid!r} got {None if got is None else tuple(got.shape)} rows, "
                f"wrong positions {bad}"
            )


def test_a_load_of_a_hash_the_tier_does_not_hold_raises_naming_the_request() -> None:
    engine = Engine(True)
    try:
        engine.step(SchedulerOutput({"a": 8}, [NewRequest("a", 0, ([0, 1],))]), {"a": (0, [0, 1])}, forward(PROMPT, 0))
        load = TierLoad("b", 0, HA)
        out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, ([2, 3, 4],))], {"a"}, meta(loads={"b": load}))
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request 'b' was loaded into block 2 from block hash"):
            engine.cache.begin_step(out)
    finally:
        engine.mgr.shutdown()


def test_a_released_hash_is_not_served_and_its_bytes_are_freed() -> None:
    engine = Engine(True)
    try:
        _reuse_then_load(engine)
        tier = engine.mgr._tier_desk.tier
        assert tier is not None and tier.held_bytes == 2 * BS * HIDDEN * 4
        engine.step(SchedulerOutput({}, [], {"b"}, meta(release=HA)), {}, None)
        assert tier.held_bytes == 0 and not tier.entries
        tier.check_invariants(BS)
    finally:
        engine.mgr.shutdown()


def test_a_load_past_what_vllm_counts_computed_restores_only_the_computed_blocks() -> None:
    """A failed load leaves fewer tokens computed: only those blocks are restored."""
    engine = Engine(True)
    try:
        engine.step(SchedulerOutput({"a": 8}, [NewRequest("a", 0, ([0, 1],))]), {"a": (0, [0, 1])}, forward(PROMPT, 0))
        binds = tuple(TierBind(h, b) for h, b in zip(HA, (0, 1)))
        out = SchedulerOutput({"c": 8}, [NewRequest("c", 0, ([0, 1],))], {"a"}, meta(bind=binds))
        engine.step(out, {"c": (0, [0, 1])}, forward(OTHER, 0))
        out = SchedulerOutput(
            {"b": 6}, [NewRequest("b", 4, ([2, 3, 4],))], {"c"}, meta(loads={"b": TierLoad("b", 0, HA)})
        )
        engine.step(out, {"b": (4, [2, 3, 4])}, forward([15, 16, 17, 18, 19, 20], 4))
        tier = engine.mgr._tier_desk.tier
        assert tier is not None and tier.stats["restored"] == 1
    finally:
        engine.mgr.shutdown()
    _oracle(engine, {"b": [*PROMPT, 19, 20]})


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_a_fill_past_this_sides_bound_is_kept_reported_and_still_restored(eager: bool) -> None:
    """host_tier_bytes below one block: a's fills cannot be held. They used to
    be lost, and the load the scheduler side had already sent raised. Now they
    are kept as a surplus and reported (for the scheduler side to forget): the
    load gets its rows, and the release that follows the forget frees them."""
    engine = Engine(eager, host_tier_bytes=1)
    try:
        _reuse_then_load(engine)
        tier = engine.mgr.components.tier_desk.tier
        assert tier is not None
        assert {tier.state_of(h) for h in HA} == {TierState.SURPLUS}
        assert tier.stats["surplus"] == 2 and tier.stats["restored"] == 2 and tier.stats["lost"] == 0
        assert set(tier.reports.pending()) == set(HA) and tier.held_bytes == 0
        tier.check_invariants(BS)
        engine.step(SchedulerOutput({}, [], {"b"}, meta(release=HA)), {}, None)
        assert not tier.entries and tier.surplus_bytes == 0
        tier.check_invariants(BS)
    finally:
        engine.mgr.shutdown()
    _oracle(engine, {"a": PROMPT, "c": OTHER, "b": [*PROMPT, 19, 20]})


def test_a_failed_fill_is_reported_and_a_later_load_of_it_raises() -> None:
    """A fill whose read fails loses the hash (no rows to keep): it is reported,
    and a load the scheduler side sends anyway is a contract break."""
    from omni_prefix_cache.tier import channel

    engine = Engine(True)
    try:
        engine.step(SchedulerOutput({"a": 8}, [NewRequest("a", 0, ([0, 1],))]), {"a": (0, [0, 1])}, forward(PROMPT, 0))
        engine.mgr.components.tier_desk._fill.plan_fill = lambda h, b: _failed_fill()  # type: ignore[method-assign]
        binds = tuple(TierBind(h, b) for h, b in zip(HA, (0, 1)))
        out = SchedulerOutput({"c": 8}, [NewRequest("c", 0, ([0, 1],))], {"a"}, meta(bind=binds))
        engine.step(out, {"c": (0, [0, 1])}, forward(OTHER, 0))
        engine.step(SchedulerOutput({}, [], {"c"}, meta()), {}, None)  # the next step settles the fills
        tier = engine.mgr.components.tier_desk.tier
        assert tier is not None and tier.stats["lost"] == 2 and not tier.entries
        assert set(channel.drain()) >= set(HA)  # what the worker connector sends the scheduler side
        load = TierLoad("b", 0, HA)
        out = SchedulerOutput({"b": 2}, [NewRequest("b", 8, ([2, 3, 4],))], set(), meta(loads={"b": load}))
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request 'b' was loaded into block 2 .*its fill failed"):
            engine.cache.begin_step(out)
    finally:
        engine.mgr.shutdown()


def _failed_fill() -> Any:
    from concurrent.futures import Future

    fut: Future[Any] = Future()
    fut.set_exception(OmniPrefixCacheUnmatchError("injected: the fill's read failed"))
    return fut
