"""The host tier behind a seed-era engine (issue 46): a scheduler output passed
straight to ``new_step_starts`` (no adapter, no write layout: the group view
gives the slots). A resumed request gets an event naming its hit and blocks in both forms, the
seed-era one (the live request re-enters ``scheduled_new_reqs`` with a hit
below where it got) and vLLM 0.33's (``scheduled_cached_reqs`` with
``resumed_req_ids``), so a KV connector's load of its prefix into blocks
another request wrote is restored, never skipped: a later hit on those blocks
reads the loaded hashes' rows. Its rows, and a recompute's, are labelled with
their own positions (the step's rows only, as a seed-era engine always got).
A load no event names refuses the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tier.metadata import TierBind, TierLoad, TierStepMetadata
from omni_prefix_cache.tools.simulate.batch import SimInputBatch

BS, HIDDEN = 4, 8
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
OTHER = [51, 52, 53, 54, 55, 56, 57, 58]
HA = (b"a0" * 8, b"a1" * 8)  # the tier's hashes of PROMPT's two blocks


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
    scheduled_cached_reqs: Any = None  # vLLM 0.33's CachedRequestData, or None (the seed-era form)


def cached(*entries: tuple[str, int, list[int] | None], resumed: tuple[str, ...] = ()) -> SimpleNamespace:
    """vLLM 0.33's ``CachedRequestData``: ``(req_id, num_computed_tokens, new block ids)`` per entry."""
    return SimpleNamespace(
        req_ids=[rid for rid, _, _ in entries],
        resumed_req_ids=set(resumed),
        num_computed_tokens=[c for _, c, _ in entries],
        new_block_ids=[None if b is None else (b,) for _, _, b in entries],
    )


def meta(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(omni_tier=TierStepMetadata(**fields))


def forward(tokens: list[int], start: int) -> torch.Tensor:
    """One row per token, a function of its position and token (the row oracle)."""
    return torch.tensor([[tok + pos / 100 + j for j in range(HIDDEN)] for pos, tok in enumerate(tokens, start)])


class SeedEngine:
    """A seed-era engine: new_step_starts(scheduler output), save_outputs
    without a layout (the view's slots), materialize; every output kept by
    the positions its token range says."""

    def __init__(self) -> None:
        self.batch = SimInputBatch(BS)
        config = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=64)
        self.mgr = OmniPrefixCacheManager(config, FullAttentionGroupView(self.batch, block_size=BS), eager=True)
        self.mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.outputs: list[tuple[str, tuple[int, int], torch.Tensor]] = []

    def step(self, out: SchedulerOutput, rows: dict[str, tuple[int, list[int], list[int]]]) -> None:
        """``rows``: request -> (position its rows start at, its blocks, its tokens this step)."""
        self.mgr.new_step_starts(out)
        self.batch.set_step(
            list(rows), {r: b for r, (_, b, _) in rows.items()}, {r: s for r, (s, _, _) in rows.items()}
        )
        if not rows:
            return
        new = torch.cat([forward(toks, start) for start, _, toks in rows.values()])
        n = int(new.shape[0])
        sid = self.mgr.save_outputs(new, None, num_tokens_unpadded=n, num_tokens_padded=n)
        got = self.mgr.materialize(sid, list(rows))
        assert got.hidden_states is not None
        for rid, span in got.token_ranges.items():
            self.outputs.append((rid, span, got.hidden_states[rid]))

    def check(self, tokens: dict[str, list[int]]) -> None:
        """Row oracle: every output's rows are its request's rows at the positions its range names."""
        for rid, (start, end), rows in self.outputs:
            if rid not in tokens:
                continue
            want = forward(tokens[rid][start:end], start)
            if rows.shape != want.shape or not torch.equal(rows, want):
                bad = [] if rows.shape != want.shape else (rows != want).any(dim=1).nonzero().flatten().tolist()
                raise AssertionError(
                    f"row oracle: request {rid!r} got rows {tuple(rows.shape)} as positions [{start}, {end}); "
                    f"wrong rows at offsets {bad}"
                )


def _preempt_then_load(engine: SeedEngine, resume: str) -> None:
    """p computes PROMPT (blocks 0-1) and finishes, the tier binds its hashes;
    a hits them and computes 2 more; a is preempted, y reuses blocks 0-1 (the
    tier fills), y finishes; a resumes with a load of PROMPT's blocks into
    blocks 0-1 again (y's rows there now); then c hits those blocks."""
    step = engine.step
    step(SchedulerOutput({"p": 8}, [NewRequest("p", 0, ([0, 1],))]), {"p": (0, [0, 1], PROMPT)})
    binds = tuple(TierBind(h, b) for h, b in zip(HA, (0, 1)))
    out = SchedulerOutput({"a": 2}, [NewRequest("a", 8, ([0, 1, 2],))], {"p"}, meta(bind=binds))
    step(out, {"a": (8, [0, 1, 2], [19, 20])})
    step(SchedulerOutput({"y": 8}, [NewRequest("y", 0, ([0, 1],))]), {"y": (0, [0, 1], OTHER)})  # a preempted
    step(SchedulerOutput({}, [], {"y"}), {})
    load = meta(loads={"a": TierLoad("a", 0, HA)})
    if resume == "new list":  # the seed-era form: a (live, at 10) re-enters the new list with its hit 8
        out = SchedulerOutput({"a": 2}, [NewRequest("a", 8, ([0, 1, 3],))], set(), load)
    else:  # vLLM 0.33: a cached request named in resumed_req_ids, its new block list whole
        out = SchedulerOutput({"a": 2}, [], set(), load, cached(("a", 8, [0, 1, 3]), resumed=("a",)))
    step(out, {"a": (8, [0, 1, 3], [19, 20])})
    step(SchedulerOutput({"c": 1}, [NewRequest("c", 8, ([0, 1, 4],))]), {"c": (8, [0, 1, 4], [21])})


@pytest.mark.parametrize("resume", ["new list", "cached"])
def test_a_resumed_requests_load_is_restored_and_a_later_hit_reads_its_hashes_rows(resume: str) -> None:
    """Before: the seed-era step gave a no event, so the load was skipped and
    c's hit on blocks 0-1 was served y's rows; a's own rows were labelled
    [10, 12) (its position before the preemption) instead of [8, 10)."""
    engine = SeedEngine()
    try:
        _preempt_then_load(engine, resume)
        restored = engine.mgr.components.tier_desk.stats()["host_tier_restored"]
    finally:
        engine.mgr.shutdown()
    engine.check({"c": [*PROMPT, 21]})  # c's hit on blocks 0-1 reads PROMPT's rows, not y's
    engine.check({"p": PROMPT, "a": [*PROMPT, 19, 20], "y": OTHER})
    assert restored == 2
    # a's first step (its hit on p's blocks, then 2 rows), then the resumed one: the 2 rows it recomputed,
    # labelled from its hit (a seed-era engine gets its step's rows, as it always did).
    assert [span for rid, span, _ in engine.outputs if rid == "a"] == [(0, 10), (8, 10)]


def test_a_recompute_after_a_failed_load_is_labelled_with_its_own_positions() -> None:
    """vLLM 0.33 recomputes a failed sync load from the failed block: the
    cached request comes back with num_computed_tokens below where it got.
    Its rows used to be labelled as if they continued ([10, 16) here)."""
    engine = SeedEngine()
    try:
        tokens = [*PROMPT, 19, 20]
        engine.step(SchedulerOutput({"a": 10}, [NewRequest("a", 0, ([0, 1, 2],))]), {"a": (0, [0, 1, 2], tokens)})
        out = SchedulerOutput({"a": 6}, [], set(), None, cached(("a", 4, None)))
        engine.step(out, {"a": (4, [0, 1, 2], tokens[4:])})
    finally:
        engine.mgr.shutdown()
    assert [span for _, span, _ in engine.outputs] == [(0, 10), (4, 10)]
    engine.check({"a": tokens})


def test_a_live_request_reentering_the_new_list_without_a_hit_stays_a_continuation() -> None:
    """The seed suite's streaming continuation: re-entering with no hit (or
    its own position) is ordinary progress, not a resume."""
    engine = SeedEngine()
    try:
        engine.step(SchedulerOutput({"a": 4}, [NewRequest("a", 0, ([0],))]), {"a": (0, [0], PROMPT[:4])})
        engine.step(SchedulerOutput({"a": 2}, [NewRequest("a", 0, ([0, 1],))]), {"a": (4, [0, 1], PROMPT[4:6])})
        engine.step(SchedulerOutput({"a": 2}, [NewRequest("a", 6, ([0, 1],))]), {"a": (6, [0, 1], PROMPT[6:8])})
    finally:
        engine.mgr.shutdown()
    assert [span for _, span, _ in engine.outputs] == [(0, 4), (4, 6), (6, 8)]
    engine.check({"a": PROMPT})


def test_a_load_no_event_names_refuses_the_step_before_anything_moves() -> None:
    engine = SeedEngine()
    try:
        engine.step(SchedulerOutput({"p": 8}, [NewRequest("p", 0, ([0, 1],))]), {"p": (0, [0, 1], PROMPT)})
        binds = tuple(TierBind(h, b) for h, b in zip(HA, (0, 1)))
        engine.step(SchedulerOutput({}, [], {"p"}, meta(bind=binds)), {})
        # b is loaded but the step names no hit of it (not even as new): refused, nothing applied.
        out = SchedulerOutput({"z": 1}, [NewRequest("z", 0, ([5],))], set(), meta(loads={"b": TierLoad("b", 0, HA)}))
        live = set(engine.mgr._live)
        with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"load of request 'b'.*no event of the step"):
            engine.mgr.new_step_starts(out)
        assert engine.mgr._live == live  # z was not admitted
    finally:
        engine.mgr.shutdown()
