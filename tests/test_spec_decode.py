"""Speculative decoding (issue 47): the accepted-rows input, its refusals, the
rollback rules and the rejected drafts' slots.

A request's rows are a function of (position, token): a rejected draft's row
differs from the row its position gets once the real token is computed, so
every check below compares against the rows the real tokens give.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig
from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
    accepted_rows_of,
)
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper, SavedStep
from omni_prefix_cache.group_view import FullAttentionGroupView, check_prefix_cache_token_accounting
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheAcceptedRowsError,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.steps.slot_occupancy import SlotState

BS, W = 4, 3
K = PrefixCacheEventKind


def truth(pos: int) -> int:
    """The token a request holds at ``pos`` (the sequence the model samples)."""
    return 10 + pos


def row(pos: int, token: int) -> list[float]:
    return [pos * 1000.0 + token, float(token), float(pos)]


def rows(positions: range, tokens: list[int] | None = None) -> torch.Tensor:
    toks = tokens if tokens is not None else [truth(p) for p in positions]
    return torch.tensor([row(p, t) for p, t in zip(positions, toks, strict=True)])


class Batch:
    """The InputBatch slice the group view reads."""

    def __init__(self) -> None:
        self.block_table = [SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=None))]
        self.set_rows({})

    def set_rows(self, spans: dict[str, tuple[int, list[int]]]) -> None:
        self.req_ids = list(spans)
        self.req_id_to_index = {r: i for i, r in enumerate(spans)}
        self.num_computed_tokens_cpu = torch.tensor([c for c, _ in spans.values()], dtype=torch.int32)
        table = torch.zeros((max(1, len(spans)), 8), dtype=torch.int32)
        for i, (_, blocks) in enumerate(spans.values()):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[0].block_table.cpu = table


class Rig:
    """One manager, an input batch and the adapter's write layouts."""

    def __init__(self, eager: bool = True) -> None:
        self.batch = Batch()
        self.mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_depth=4), eager=eager)
        self.mgr.register_policy(ModelCachePolicy())
        self.view = FullAttentionGroupView(self.batch, BS)
        self.adapter = PrefixCacheSchedulerAdapter()
        self.blocks: dict[str, list[int]] = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
        self.owner = {r: PrefixCacheRequestOwner(i + 1) for i, r in enumerate("abc")}

    def event(self, rid: str, kind: K, hit: int = 0, blocks: list[int] | None = None) -> PrefixCacheRequestEvent:
        groups = (tuple(self.blocks[rid] if blocks is None else blocks),)
        return PrefixCacheRequestEvent(rid, kind, 0, hit, groups, owner=self.owner[rid])

    def step(
        self,
        events: list[PrefixCacheRequestEvent],
        spans: dict[str, tuple[int, int]],
        drafts: dict[str, int] | None = None,
        tokens: dict[str, list[int]] | None = None,
    ) -> int:
        """new_step_starts, then save_outputs of ``spans`` (rid -> [start, end)),
        the last ``drafts[rid]`` positions being drafts with ``tokens[rid]``
        as the step's tokens (the real ones by default)."""
        counts = {r: e - s for r, (s, e) in spans.items()}
        step = PrefixCacheStep(tuple(events), tuple(counts.items()), draft_tokens=tuple((drafts or {}).items()))
        self.mgr.new_step_starts(step)
        self.batch.set_rows({r: (s, self.blocks[r]) for r, (s, _) in spans.items()})
        hidden = torch.cat([rows(range(s, e), (tokens or {}).get(r)) for r, (s, e) in spans.items()])
        layout = self.adapter.build_write_layout(self.view, num_scheduled_tokens=counts)
        n = int(hidden.shape[0])
        return self.mgr.save_outputs(hidden, None, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)

    def tenure(self, rid: str) -> Any:
        return self.mgr.components.requests.current[rid]

    def state(self, slot: int) -> str:
        return SlotState(int(self.mgr.components.occupancy.get_slot_status(HIDDEN_KEY).state[slot])).name

    def slot(self, rid: str, pos: int) -> int:
        return self.blocks[rid][pos // BS] * BS + pos % BS


@pytest.fixture(params=[True, False], ids=["eager", "threaded"])
def rig(request: pytest.FixtureRequest) -> Any:
    r = Rig(eager=request.param)
    yield r
    r.mgr.shutdown()


def prefill(rig: Rig, rid: str = "a", n: int = 6) -> None:
    """``rid`` computes its prompt [0, n) and samples the token at n."""
    sid = rig.step([rig.event(rid, K.STARTED)], {rid: (0, n)})
    rig.mgr.materialize(sid, [rid])


def drafted(rig: Rig, rid: str, start: int, drafts: int, good: int) -> int:
    """A decode step at ``start`` with ``drafts`` drafts, the first ``good`` right."""
    toks = [truth(start)] + [truth(start + 1 + j) + (0 if j < good else 7) for j in range(drafts)]
    return rig.step([], {rid: (start, start + 1 + drafts)}, {rid: drafts}, {rid: toks})


# ------------------------------------------------------------------ the adapter's inputs


def test_translate_step_reads_the_draft_counts_and_the_runner_output_gives_the_accepted_rows() -> None:
    adapter = PrefixCacheSchedulerAdapter()
    so = SimpleNamespace(
        num_scheduled_tokens={"a": 4, "b": 1, "c": 3},
        scheduled_spec_decode_tokens={"a": [7, 8, 9], "b": [], "c": [-1, -1]},
    )
    assert adapter.translate_step(so).draft_tokens == (("a", 3), ("c", 2))
    assert adapter.translate_step(SimpleNamespace(num_scheduled_tokens={"a": 1})).draft_tokens == ()
    out = SimpleNamespace(req_ids=["a", "b", "c"], sampled_token_ids=[[1, 2], [3], []])
    assert accepted_rows_of(out) == {"a": 2, "b": 1, "c": 0}
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="2 req_ids but 1 sampled_token_ids"):
        accepted_rows_of(SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[1]]))


# ------------------------------------------------------------------ materialize


def test_materialize_returns_the_accepted_rows_only_and_the_tenure_counts_them(rig: Rig) -> None:
    prefill(rig)
    sid = drafted(rig, "a", 6, drafts=3, good=1)  # positions 6, 7 right; 8, 9 rejected
    t = rig.tenure("a")
    # A save counts only the rows before the drafts.
    assert (t.computed_upto, t.saved_upto, t.rows_upto) == (7, 7, 7)
    out = rig.mgr.materialize(sid, ["a"], accepted_rows={"a": 2})
    assert out.token_ranges["a"] == (6, 8) and out.scheduled_token_ranges["a"] == (6, 8)
    assert torch.equal(out.hidden_states["a"], rows(range(6, 8)))
    assert (t.computed_upto, t.saved_upto, t.rows_upto) == (8, 8, 8)


def test_every_draft_accepted_and_none_accepted(rig: Rig) -> None:
    prefill(rig)
    out = rig.mgr.materialize(drafted(rig, "a", 6, drafts=2, good=2), ["a"], accepted_rows={"a": 3})
    assert out.token_ranges["a"] == (6, 9) and torch.equal(out.hidden_states["a"], rows(range(6, 9)))
    out = rig.mgr.materialize(drafted(rig, "a", 9, drafts=2, good=0), ["a"], accepted_rows={"a": 1})
    assert out.token_ranges["a"] == (9, 10) and torch.equal(out.hidden_states["a"], rows(range(9, 10)))


def test_plain_decoding_needs_no_accepted_rows(rig: Rig) -> None:
    prefill(rig)
    out = rig.mgr.materialize(rig.step([], {"a": (6, 7)}), ["a"])
    assert out.token_ranges["a"] == (6, 7)
    # Counts of requests without drafts (the runner's whole batch) change nothing.
    out = rig.mgr.materialize(rig.step([], {"a": (7, 8)}), ["a"], accepted_rows={"a": 1})
    assert out.token_ranges["a"] == (7, 8)


def test_a_drafted_step_without_accepted_rows_fails_loudly_and_stays_saved(rig: Rig) -> None:
    prefill(rig)
    prefill(rig, "b")
    step = PrefixCacheStep((), (("a", 3), ("b", 1)), draft_tokens=(("a", 2),))
    rig.mgr.new_step_starts(step)
    rig.batch.set_rows({"a": (6, rig.blocks["a"]), "b": (6, rig.blocks["b"])})
    layout = rig.adapter.build_write_layout(rig.view, num_scheduled_tokens={"a": 3, "b": 1})
    hidden = torch.cat([rows(range(6, 9)), rows(range(6, 7))])
    sid = rig.mgr.save_outputs(hidden, None, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheAcceptedRowsError, match=r"requests \['a'\] have speculative drafts"):
        rig.mgr.materialize(sid, ["a", "b"])
    with pytest.raises(OmniPrefixCacheAcceptedRowsError, match=r"requests \['a'\] have speculative drafts"):
        rig.mgr.materialize(sid, ["a", "b"], accepted_rows={"b": 1})
    # Nothing was consumed: the runner passes the counts and gets the rows.
    out = rig.mgr.materialize(sid, ["a", "b"], accepted_rows={"a": 3, "b": 1})
    assert out.token_ranges == {"a": (6, 9), "b": (6, 7)}


@pytest.mark.parametrize(
    "given, error, match",
    [
        ({"a": 4}, OmniPrefixCacheAcceptedRowsError, r"more accepted rows than the request's drafts plus one.*'a': 4"),
        ({"a": 2, "z": 1}, OmniPrefixCacheAcceptedRowsError, r"requests \['z'\] are not in the step"),
        ({"a": -1}, OmniPrefixCacheInvalidArgumentError, r"accepted_rows\['a'\] must be >= 0"),
        ({"a": True}, OmniPrefixCacheInvalidTypeError, "must be an int, got bool"),
        ({"a": 1.0}, OmniPrefixCacheInvalidTypeError, "must be an int, got float"),
        ([2], OmniPrefixCacheInvalidTypeError, "accepted_rows must be a mapping"),
        ({1: 2}, OmniPrefixCacheInvalidTypeError, "request id must be a str"),
    ],
)
def test_bad_accepted_rows_are_refused_before_anything_moves(rig: Rig, given: Any, error: type, match: str) -> None:
    prefill(rig)
    sid = drafted(rig, "a", 6, drafts=2, good=1)
    with pytest.raises(error, match=match):
        rig.mgr.materialize(sid, ["a"], accepted_rows=given)
    with pytest.raises(error, match=match):
        rig.mgr.discard_step(sid, accepted_rows=given)
    assert rig.tenure("a").rows_upto == 7
    assert rig.mgr.materialize(sid, ["a"], accepted_rows={"a": 2}).token_ranges["a"] == (6, 8)


def test_a_step_with_drafts_is_validated_at_new_step_and_needs_a_write_layout(rig: Rig) -> None:
    prefill(rig)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="'a' has 3 speculative draft tokens but 3 scheduled"):
        rig.mgr.new_step_starts(PrefixCacheStep((), (("a", 3),), draft_tokens=(("a", 3),)))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="'x' has 1 speculative draft tokens but 0 scheduled"):
        rig.mgr.new_step_starts(PrefixCacheStep((), (("a", 3),), draft_tokens=(("x", 1),)))
    seed_era = SimpleNamespace(
        scheduled_new_reqs=[], finished_req_ids=set(), num_scheduled_tokens={"a": 2},
        scheduled_spec_decode_tokens={"a": [5]},
    )  # fmt: skip
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="speculative decoding needs the event API"):
        rig.mgr.new_step_starts(seed_era)
    rig.mgr.new_step_starts(PrefixCacheStep((), (("a", 2),), draft_tokens=(("a", 1),)))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="it needs a write_layout"):
        rig.mgr.save_outputs(rows(range(6, 8)), None, num_tokens_unpadded=2, num_tokens_padded=2)


# ------------------------------------------------------------------ the rules over time


def test_a_lagged_materialize_never_moves_a_watermark_back_nor_a_slot_a_later_save_wrote(rig: Rig) -> None:
    prefill(rig)
    first = drafted(rig, "a", 6, drafts=3, good=0)  # 6 right; 7, 8, 9 rejected
    second = drafted(rig, "a", 7, drafts=1, good=1)  # vLLM rolled back to 7: 7 and 8 right
    t = rig.tenure("a")
    assert t.rows_upto == 8
    # The first step's output comes late: its rejected rows' slots that the second wrote stay its.
    out = rig.mgr.materialize(first, ["a"], accepted_rows={"a": 1})
    assert out.token_ranges["a"] == (6, 7) and torch.equal(out.hidden_states["a"], rows(range(6, 7)))
    assert t.rows_upto == 8  # never back
    assert rig.state(rig.slot("a", 9)) == "REJECTED"
    assert rig.state(rig.slot("a", 7)) != "REJECTED" and rig.state(rig.slot("a", 8)) != "REJECTED"
    out = rig.mgr.materialize(second, ["a"], accepted_rows={"a": 2})
    assert torch.equal(out.hidden_states["a"], rows(range(7, 9))) and t.rows_upto == 9


def test_a_rejected_drafts_slot_refuses_a_hit_until_a_save_writes_it_again(rig: Rig) -> None:
    prefill(rig, n=7)  # block 0 full, position 7 sampled
    sid = drafted(rig, "a", 7, drafts=2, good=0)  # 7 right; 8 rejected (in block 2)
    rig.mgr.materialize(sid, ["a"], accepted_rows={"a": 1})
    bad = rig.slot("a", 8)
    assert rig.state(bad) == "REJECTED"
    # A hit claiming position 8 (a runner that skipped vLLM's rollback) is refused, for every key.
    rig.blocks["b"] = rig.blocks["a"][:3]
    sid = rig.step([rig.event("b", K.STARTED, hit=12, blocks=rig.blocks["a"][:3])], {"b": (12, 13)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="rejected speculative drafts"):
        rig.mgr.materialize(sid, ["b"])
    # The request computes position 8 for real: the slot serves its row from then on.
    rig.mgr.materialize(rig.step([], {"a": (8, 9)}), ["a"])
    assert rig.state(bad) != "REJECTED"
    rig.blocks["c"] = [*rig.blocks["a"][:3], 12]
    sid = rig.step([rig.event("c", K.STARTED, hit=8, blocks=rig.blocks["a"][:2])], {"c": (8, 9)})
    out = rig.mgr.materialize(sid, ["c"])
    assert torch.equal(out.hidden_states["c"], rows(range(9)))


def test_a_same_step_hit_on_a_rejected_slot_the_step_rewrites_gets_this_steps_row(rig: Rig) -> None:
    prefill(rig, n=7)
    rig.mgr.materialize(drafted(rig, "a", 7, drafts=1, good=0), ["a"], accepted_rows={"a": 1})
    assert rig.state(rig.slot("a", 7)) != "REJECTED" and rig.state(rig.slot("a", 8)) == "REJECTED"
    # The step computing position 8 (block 1 full) also admits "c" hitting blocks 0-1 (vLLM caches the
    # block at allocation): planned at save, after this step's write, never refused.
    rig.blocks["c"] = [*rig.blocks["a"][:2], 12]
    hit = rig.event("c", K.STARTED, hit=8, blocks=rig.blocks["a"][:2])
    out = rig.mgr.materialize(rig.step([hit], {"a": (8, 9), "c": (8, 9)}), ["a", "c"])
    assert torch.equal(out.hidden_states["c"], rows(range(9)))


def test_a_resume_recovers_exactly_the_accepted_positions_the_slowest_consumer_missed(rig: Rig) -> None:
    prompt = rig.mgr.materialize(rig.step([rig.event("a", K.STARTED)], {"a": (0, 4)}), ["a"])
    first = rig.mgr.materialize(rig.step([], {"a": (4, 5)}), ["a"])
    out = rig.mgr.materialize(drafted(rig, "a", 5, drafts=3, good=2), ["a"], accepted_rows={"a": 3})
    assert out.token_ranges["a"] == (5, 8)
    for consumer, outputs in (("fast", [prompt, first, out]), ("slow", [prompt, first])):
        for o in outputs:
            rig.mgr.ack_delivery(rig.mgr.delivery_view(o, ["a"], consumer=consumer))
    t = rig.tenure("a")
    assert t.delivered_upto == {"fast": 8, "slow": 5}
    # Preempted, then resumed with its cached blocks [0, 8) (accepted drafts included, the rejected one
    # at 8 recomputed): the hit recovers from the slowest consumer, never past the accepted end.
    sid = rig.step([rig.event("a", K.RESUMED, hit=8)], {"a": (8, 9)})
    out = rig.mgr.materialize(sid, ["a"])
    assert out.token_ranges["a"] == (5, 9) and torch.equal(out.hidden_states["a"], rows(range(5, 9)))
    assert rig.mgr.delivery_view(out, ["a"], consumer="fast").token_ranges["a"] == (8, 9)
    assert rig.mgr.delivery_view(out, ["a"], consumer="slow").token_ranges["a"] == (5, 9)


def test_discard_counts_accepted_rows_only_when_given_them(rig: Rig) -> None:
    prefill(rig)
    rig.mgr.discard_step(drafted(rig, "a", 6, drafts=2, good=1))  # nothing known: the drafts never count
    t = rig.tenure("a")
    assert t.rows_upto == 7 and rig.state(rig.slot("a", 8)) != "REJECTED"
    rig.mgr.discard_step(drafted(rig, "a", 7, drafts=2, good=1), accepted_rows={"a": 2})
    assert t.rows_upto == 9 and rig.state(rig.slot("a", 9)) == "REJECTED"


def test_a_tenure_retired_before_its_drafted_step_materializes_counts_its_accepted_rows(rig: Rig) -> None:
    prefill(rig)
    sid = drafted(rig, "a", 6, drafts=2, good=2)
    old = rig.tenure("a")
    rig.owner["a"] = PrefixCacheRequestOwner(1, 1)  # a replacement retires the tenure the step saved under
    rig.mgr.new_step_starts(PrefixCacheStep((rig.event("a", K.REPLACED),), ()))
    out = rig.mgr.materialize(sid, ["a"], accepted_rows={"a": 3})
    assert out.token_ranges["a"] == (6, 9) and torch.equal(out.hidden_states["a"], rows(range(6, 9)))
    assert old.retired and old.rows_upto == 9  # accept moves a RETIRED tenure too (its late acks take them)


# ------------------------------------------------------------------ the engine helper


def helper_step(rig: Rig, helper: PrefixCacheEngineHelper, start: int, drafts: int, good: int) -> SavedStep:
    toks = [truth(start)] + [truth(start + 1 + j) + (0 if j < good else 7) for j in range(drafts)]
    so = SimpleNamespace(
        num_scheduled_tokens={"a": 1 + drafts}, scheduled_spec_decode_tokens={"a": list(range(drafts))}
    )
    helper.begin_step(so)
    rig.batch.set_rows({"a": (start, rig.blocks["a"])})
    hidden = rows(range(start, start + 1 + drafts), toks)
    saved = helper.save(hidden, None, num_tokens_unpadded=1 + drafts, num_tokens_padded=1 + drafts)
    assert saved is not None and saved.drafts == (("a", drafts),)
    return saved


def test_the_output_builder_takes_the_accepted_rows_when_made_or_when_it_runs(rig: Rig) -> None:
    helper = PrefixCacheEngineHelper(rig.mgr, rig.view, consumer="out")
    helper.begin_step(SimpleNamespace(num_scheduled_tokens={"a": 6}, scheduled_new_reqs=[
        SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=(rig.blocks["a"],))]))  # fmt: skip
    rig.batch.set_rows({"a": (0, rig.blocks["a"])})
    saved = helper.save(rows(range(6)), None, num_tokens_unpadded=6, num_tokens_padded=6)
    got: list[list[float]] = []

    def build(view: Any) -> list[float]:
        return view.hidden_states["a"][:, 0].tolist()

    def publish(payload: list[float], live: frozenset[str]) -> None:
        got.extend(payload)

    assert saved is not None
    helper.output_builder(saved, build, publish)()
    runner_output = SimpleNamespace(req_ids=["a"], sampled_token_ids=[[1, 2]])
    helper.output_builder(
        helper_step(rig, helper, 6, 2, 1), build, publish, accepted_rows=accepted_rows_of(runner_output)
    )()
    helper.output_builder(helper_step(rig, helper, 8, 3, 3), build, publish)(accepted_rows={"a": 4})
    assert got == rows(range(12))[:, 0].tolist()
    # Given twice, or not at all: refused, and the step is discarded (its page released).
    twice = helper.output_builder(helper_step(rig, helper, 12, 1, 1), build, publish, accepted_rows={"a": 2})
    with pytest.raises(OmniPrefixCacheAcceptedRowsError, match="accepted_rows given twice"):
        twice(accepted_rows={"a": 2})
    assert not rig.mgr.components.steps  # the refused step was discarded
    fresh = PrefixCacheEngineHelper(rig.mgr, rig.view, consumer="out", adapter=helper.adapter)
    missing = helper_step(rig, fresh, 12, 1, 1)
    with pytest.raises(OmniPrefixCacheAcceptedRowsError, match=r"requests \['a'\] have speculative drafts"):
        fresh.output_builder(missing, build, publish)()
    assert missing.step_id not in rig.mgr.components.steps
    assert got == rows(range(12))[:, 0].tolist()


# ------------------------------------------------------------------ the stage gate


@pytest.mark.parametrize(
    "method", ["ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp", "deepseek_mtp", "dflash", "dspark"]
)
def test_the_gate_accepts_methods_whose_target_verifies_every_draft_position(method: str) -> None:
    cache = SimpleNamespace(block_size=BS, prefix_match_unit=None)
    check_prefix_cache_token_accounting(cache, SimpleNamespace(method=method, enable_adaptive_verification=False))


@pytest.mark.parametrize(
    "config, why",
    [
        (SimpleNamespace(method="ngram_gpu"), "trims each step's drafts inside the model runner"),
        (SimpleNamespace(method="extract_hidden_states"), "it is no speculation"),
        (SimpleNamespace(method="dspark", enable_adaptive_verification=True), "adaptive verification trims"),
        (SimpleNamespace(method="tree_of_drafts"), "not known to verify its drafts"),
    ],
)
def test_the_gate_refuses_modes_whose_target_rows_are_not_one_per_scheduled_position(config: Any, why: str) -> None:
    cache = SimpleNamespace(block_size=BS, prefix_match_unit=None)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=f"speculative decoding with method=.*{why}"):
        check_prefix_cache_token_accounting(cache, config)
