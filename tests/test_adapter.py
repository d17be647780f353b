"""The scheduler adapter: scheduler output -> request events, step sequence, write layout.

Scheduler outputs here are duck-typed namespaces, the way an engine without
vLLM (or vLLM's own dataclasses, see tests_vllm) hands them over.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from dataclasses import FrozenInstanceError
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_prefix_cache.adapter import (
    PrefixCacheEventKind as K,
)
from omni_prefix_cache.adapter import (
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
    PrefixCacheWrite,
)
from omni_prefix_cache.interface import (
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheRequestProgress,
    StageCacheOutputs,
)

Own = PrefixCacheRequestOwner


def new_req(req_id: str, computed: int = 0, blocks: Any = None, *, spelling: str = "req_id") -> SimpleNamespace:
    return SimpleNamespace(**{spelling: req_id}, num_computed_tokens=computed, block_ids=blocks)


def cached(
    req_ids: list[str],
    computed: list[int],
    *,
    resumed: Iterable[str] = (),
    new_blocks: list[Any] | None = None,
    outputs: list[int] | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        req_ids=req_ids,
        num_computed_tokens=computed,
        resumed_req_ids=set(resumed),
        new_block_ids=new_blocks if new_blocks is not None else [None] * len(req_ids),
        num_output_tokens=outputs if outputs is not None else [0] * len(req_ids),
    )


def out(
    new: Iterable[SimpleNamespace] = (),
    sched: dict[str, int] | None = None,
    *,
    cached_reqs: SimpleNamespace | None = None,
    finished: Iterable[str] = (),
    **extra: Any,
) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs if cached_reqs is not None else cached([], []),
        num_scheduled_tokens=dict(sched or {}),
        finished_req_ids=set(finished),
        **extra,
    )


def kinds(events: tuple[PrefixCacheRequestEvent, ...]) -> list[tuple[str, K]]:
    return [(e.req_id, e.kind) for e in events]


# ---------------------------------------------------------------- value types


def test_owner_orders_by_admission_then_generation_and_values_are_frozen() -> None:
    assert Own(1, 5) < Own(2, 0) < Own(2, 1)
    assert Own(3) == Own(3, 0)
    event = PrefixCacheRequestEvent("a", K.STARTED)
    with pytest.raises(FrozenInstanceError):
        event.hit_end = 4  # type: ignore[misc]
    assert K("resumed") is K.RESUMED and K.REPLACED == "replaced"


def test_step_iterates_over_its_events() -> None:
    events = (PrefixCacheRequestEvent("a", K.STARTED), PrefixCacheRequestEvent("b", K.FINISHED))
    assert list(PrefixCacheStep(events, (("a", 3),))) == list(events)


def test_adapter_imports_no_torch() -> None:
    code = "import sys, omni_prefix_cache.adapter; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


# ---------------------------------------------------------------- new and cached requests


def test_new_request_event_carries_hit_blocks_and_scheduled_tokens() -> None:
    ad = PrefixCacheSchedulerAdapter()
    (e,) = ad.translate_scheduler_output(out([new_req("a", 8, [[3, 4, 5]])], {"a": 6}))
    want = PrefixCacheRequestEvent("a", K.STARTED, 0, 8, ((3, 4, 5),), 6, 0, None, True)
    assert e == want and hash(e) == hash(want) and repr(e) == repr(want)


def test_flat_block_ids_are_one_group_and_grouped_ids_are_kept_per_group() -> None:
    ad = PrefixCacheSchedulerAdapter()
    events = ad.translate_scheduler_output(
        out(
            [
                new_req("flat", 0, [1, 2]),
                new_req("grouped", 0, ([1, 2], [7])),
                new_req("numpy", 0, np.array([5, 6], dtype=np.int32)),
                new_req("none", 0, None),
            ],
            {},
        )
    )
    got = {e.req_id: e.block_ids for e in events}
    assert got == {"flat": ((1, 2),), "grouped": ((1, 2), (7,)), "numpy": ((5, 6),), "none": ()}
    assert all(type(b) is int for groups in got.values() for g in groups for b in g)


def test_request_id_spelling_is_read_too_and_missing_id_raises() -> None:
    ad = PrefixCacheSchedulerAdapter()
    (e,) = ad.translate_scheduler_output(out([new_req("x", spelling="request_id")], {"x": 2}))
    assert (e.req_id, e.scheduled_tokens) == ("x", 2)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="neither req_id nor request_id"):
        ad.translate_scheduler_output(out([SimpleNamespace(num_computed_tokens=0)]))


def test_seen_id_without_new_owner_is_extended_and_new_owner_starts_again() -> None:
    ad = PrefixCacheSchedulerAdapter()
    assert kinds(ad.translate_scheduler_output(out([new_req("a")]))) == [("a", K.STARTED)]
    # A streaming continuation: same id, no owner declared.
    assert kinds(ad.translate_scheduler_output(out([new_req("a")]))) == [("a", K.EXTENDED)]
    # The engine now declares an owner: first owner seen for the id is a start.
    owners = {"a": Own(1)}
    assert kinds(ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners=owners))) == [("a", K.STARTED)]
    assert kinds(ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners=owners))) == [("a", K.EXTENDED)]
    (e,) = ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(1, 1)}))
    assert (e.kind, e.owner) == (K.STARTED, Own(1, 1))


def test_cached_requests_resumed_first_sorted_then_the_rest_in_order() -> None:
    ad = PrefixCacheSchedulerAdapter()
    data = cached(
        ["z", "r2", "y", "r1"],
        [10, 16, 11, 8],
        resumed={"r2", "r1"},
        new_blocks=[None, [[4, 5]], None, [9]],
        outputs=[3, 0, 2, 1],
    )
    events = ad.translate_scheduler_output(out([], {"z": 1, "r2": 2, "y": 1, "r1": 4}, cached_reqs=data))
    assert kinds(events) == [("r1", K.RESUMED), ("r2", K.RESUMED), ("z", K.EXTENDED), ("y", K.EXTENDED)]
    by = {e.req_id: e for e in events}
    assert (by["r1"].hit_end, by["r1"].block_ids, by["r1"].scheduled_tokens) == (8, ((9,),), 4)
    assert (by["r2"].hit_end, by["r2"].block_ids) == (16, ((4, 5),))
    assert (by["z"].hit_end, by["z"].block_ids, by["z"].num_output_tokens) == (10, (), 3)


def test_resumed_ids_come_sorted_whatever_order_the_scheduler_lists_them() -> None:
    ids = [f"r{i}" for i in (7, 3, 9, 1, 5, 8, 2, 6, 4)]  # a set lists 9 ids sorted by chance once in 9!
    data = cached(ids, [0] * len(ids), resumed=ids)
    events = PrefixCacheSchedulerAdapter().translate_scheduler_output(out(cached_reqs=data))
    assert [e.req_id for e in events] == sorted(ids)
    assert {e.kind for e in events} == {K.RESUMED}


def test_a_cached_request_is_observed_so_a_later_new_entry_extends_it() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out(cached_reqs=cached(["a"], [4])))
    assert kinds(ad.translate_scheduler_output(out([new_req("a")]))) == [("a", K.EXTENDED)]


def test_event_order_is_controls_new_cached_terminal() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("c"), new_req("f"), new_req("r")]))
    step = out(
        [new_req("n")],
        cached_reqs=cached(["c"], [4]),
        finished={"f"},
        prefix_cache_replacements=(PrefixCacheRequestEvent("r", K.REPLACED, owner=Own(9)),),
    )
    assert kinds(ad.translate_scheduler_output(step)) == [
        ("r", K.REPLACED),
        ("n", K.STARTED),
        ("c", K.EXTENDED),
        ("f", K.FINISHED),
    ]


# ---------------------------------------------------------------- owners


def test_events_of_an_older_owner_are_dropped() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("a"), new_req("b")], prefix_cache_owners={"a": Own(2), "b": Own(2)}))
    stale = {"a": Own(1), "b": Own(1, 7)}
    assert ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners=stale)) == ()
    assert ad.translate_scheduler_output(out(cached_reqs=cached(["b"], [4]), prefix_cache_owners=stale)) == ()
    # The newer owner is still the observed one: it extends.
    assert kinds(ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(2)}))) == [
        ("a", K.EXTENDED)
    ]


def test_replacement_control_sets_the_owner_and_a_stale_control_is_skipped() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(3, 1)}))
    control = PrefixCacheRequestEvent("a", K.REPLACED, owner=Own(3, 2), lookup_complete=False)
    assert ad.translate_scheduler_output(out(prefix_cache_replacements=[control])) == (control,)
    # The replaced generation now rules: the old generation's scheduling is stale.
    assert ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(3, 1)})) == ()
    old = PrefixCacheRequestEvent("a", K.REPLACED, owner=Own(3, 1))
    assert ad.translate_scheduler_output(out(prefix_cache_replacements=[old])) == ()


@pytest.mark.parametrize(
    "control",
    [PrefixCacheRequestEvent("bad", K.STARTED, owner=Own(1)), PrefixCacheRequestEvent("bad", K.REPLACED)],
    ids=["not-replaced", "no-owner"],
)
def test_a_malformed_control_raises_naming_the_request_and_changes_nothing(control: PrefixCacheRequestEvent) -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("f")], prefix_cache_owners={"f": Own(1)}))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="'bad'") as info:
        ad.translate_scheduler_output(out(finished={"f"}, prefix_cache_replacements=[control]))
    assert isinstance(info.value, OmniPrefixCacheUnmatchError)
    # "f" was not forgotten by the refused step: its owner still extends.
    assert kinds(ad.translate_scheduler_output(out([new_req("f")], prefix_cache_owners={"f": Own(1)}))) == [
        ("f", K.EXTENDED)
    ]


def test_finished_and_aborted_sorted_with_their_owner_and_forgotten() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("b"), new_req("a")], prefix_cache_owners={"a": Own(1), "b": Own(2)}))
    events = ad.translate_scheduler_output(out(finished={"b", "a"}, aborted_req_ids={"a"}))
    assert [(e.req_id, e.kind, e.owner) for e in events] == [("a", K.ABORTED, Own(1)), ("b", K.FINISHED, Own(2))]
    # Forgotten: the id comes back as a new admission even with no owner declared.
    assert kinds(ad.translate_scheduler_output(out([new_req("a")]))) == [("a", K.STARTED)]


def test_aborted_ids_alone_are_terminal_and_finished_is_never_guessed_aborted() -> None:
    ad = PrefixCacheSchedulerAdapter()
    events = ad.translate_scheduler_output(out(finished={"f"}, aborted_req_ids=["x"]))
    assert kinds(events) == [("f", K.FINISHED), ("x", K.ABORTED)]


def test_an_older_terminal_owner_does_not_forget_the_newer_admission() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(5)}))
    (e,) = ad.translate_scheduler_output(out(finished={"a"}, prefix_cache_terminal_owners={"a": Own(4)}))
    assert (e.kind, e.owner) == (K.FINISHED, Own(4))
    # Own(5) is still observed: its next step extends, an Own(4) leftover is dropped.
    assert kinds(ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(5)}))) == [
        ("a", K.EXTENDED)
    ]
    assert ad.translate_scheduler_output(out([new_req("a")], prefix_cache_owners={"a": Own(4)})) == ()
    # The matching terminal owner forgets it.
    ad.translate_scheduler_output(out(finished={"a"}, prefix_cache_terminal_owners={"a": Own(5)}))
    assert kinds(ad.translate_scheduler_output(out([new_req("a")]))) == [("a", K.STARTED)]


def test_id_finished_and_readmitted_in_one_step_starts_again() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_scheduler_output(out([new_req("a")]))
    events = ad.translate_scheduler_output(out([new_req("a", 4)], {"a": 2}, finished={"a"}))
    assert kinds(events) == [("a", K.STARTED), ("a", K.FINISHED)]


# ---------------------------------------------------------------- steps


def test_translate_step_keeps_scheduled_counts_and_sequence() -> None:
    ad = PrefixCacheSchedulerAdapter()
    step = ad.translate_step(out([new_req("a")], {"a": np.int64(3), "b": 1}, prefix_cache_step_sequence=0))
    assert step.sequence == 0 and step.scheduled_tokens == (("a", 3), ("b", 1))
    assert type(step.scheduled_tokens[0][1]) is int
    assert kinds(step.events) == [("a", K.STARTED)]


def test_a_replayed_step_sequence_is_an_empty_step_and_observes_nothing() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_step(out([new_req("a")], {"a": 1}, prefix_cache_step_sequence=4))
    for seq in (4, 2):
        replay = ad.translate_step(out([new_req("b")], {"b": 1}, prefix_cache_step_sequence=seq))
        assert replay == PrefixCacheStep((), (), seq)
    # "b" was never observed by the replays.
    step = ad.translate_step(out([new_req("b")], {"b": 1}, prefix_cache_step_sequence=5))
    assert kinds(step.events) == [("b", K.STARTED)]


def test_steps_without_sequence_are_never_replays() -> None:
    ad = PrefixCacheSchedulerAdapter()
    ad.translate_step(out([new_req("a")], prefix_cache_step_sequence=9))
    step = ad.translate_step(out([new_req("b")]))
    assert step.sequence is None and kinds(step.events) == [("b", K.STARTED)]


# ---------------------------------------------------------------- write layout


class FakeView:
    """Batch order, per request its start; slots are position + 100 * row."""

    block_size = 4

    def __init__(self, order: list[str], start: dict[str, int]) -> None:
        self.order, self.start = order, start
        self.slot_calls: list[tuple[list[str], dict[str, int]]] = []

    def batch_req_ids(self) -> list[str]:
        return list(self.order)

    def token_range(self, req_id: str, count: int) -> tuple[int, int]:
        return self.start[req_id], self.start[req_id] + count

    def step_slots_cpu(self, req_ids: list[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        self.slot_calls.append((list(req_ids), dict(num_scheduled)))
        out: list[int] = []
        for row, r in enumerate(req_ids):
            out += [100 * row + p for p in range(self.start[r], self.start[r] + num_scheduled.get(r, 0))]
        return torch.tensor(out, dtype=torch.int64)


def test_write_layout_packs_rows_in_batch_order() -> None:
    view = FakeView(["b", "idle", "a"], {"a": 8, "b": 2, "idle": 5})
    layout = PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"a": 3, "b": 2})
    assert layout.writes == (
        PrefixCacheWrite("b", 0, 2, 2, 4),
        PrefixCacheWrite("idle", 2, 2, 5, 5),
        PrefixCacheWrite("a", 2, 5, 8, 11),
    )
    assert layout.total_rows == 5
    assert view.slot_calls == [(["b", "idle", "a"], {"a": 3, "b": 2})]
    assert layout.slots_cpu.tolist() == [2, 3, 208, 209, 210]


def test_write_layout_over_the_full_attention_view_uses_its_token_range() -> None:
    from omni_prefix_cache.group_view import FullAttentionGroupView

    table = torch.tensor([[1, 2, 0], [5, 6, 7]], dtype=torch.int32)
    group = SimpleNamespace(block_table=SimpleNamespace(cpu=table), block_size=4)
    batch = SimpleNamespace(
        req_ids=["x", "y"],
        req_id_to_index={"x": 0, "y": 1},
        num_computed_tokens_cpu=np.array([6, 1], dtype=np.int32),
        block_table=_Tables(group),
    )
    view = FullAttentionGroupView(batch, 4)
    assert view.token_range("x", 2) == (6, 8)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="'nope'"):
        view.token_range("nope", 1)
    layout = PrefixCacheSchedulerAdapter().build_write_layout(view, num_scheduled_tokens={"x": 2, "y": 3})
    assert [(w.req_id, w.row_start, w.row_end, w.token_start, w.token_end) for w in layout.writes] == [
        ("x", 0, 2, 6, 8),
        ("y", 2, 5, 1, 4),
    ]
    # x: block 2, offsets 2-3; y: block 5 offsets 1-3.
    assert layout.slots_cpu.tolist() == [10, 11, 21, 22, 23]


class _Tables:
    def __init__(self, group: Any) -> None:
        self.block_tables = [group]

    def __getitem__(self, idx: int) -> Any:
        return self.block_tables[idx]


# ---------------------------------------------------------------- interface additions


def test_stage_outputs_defaults_keep_seed_construction_working() -> None:
    outs = StageCacheOutputs({"a": torch.zeros(1)}, {})
    assert outs.token_ranges == {} and outs.scheduled_token_ranges == {}
    assert outs.cached_mm_keys == frozenset() and outs.token_mm_keys == frozenset()
    assert outs._progress == {} and outs._consumer is None
    # Mutable defaults are per instance, and the private fields stay out of repr.
    outs.token_ranges["a"] = (0, 1)
    assert StageCacheOutputs(None, {}).token_ranges == {}
    assert "_progress" not in repr(outs) and "_consumer" not in repr(outs)


def test_request_progress_defaults_are_per_instance() -> None:
    p, q = PrefixCacheRequestProgress(), PrefixCacheRequestProgress()
    p.delivered_upto["talker"] = 4
    assert q.delivered_upto == {}
    assert (q.computed_upto, q.saved_upto, q.owner, q.lookup, q.retired) == (0, 0, None, None, False)


def test_policy_refuses_mm_written_in_sample_with_full_hidden_states() -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="no full-prompt hidden states"):
        ModelCachePolicy(mm_outputs_written_in_sample=True)
    assert ModelCachePolicy(needs_full_hidden_states=False, mm_outputs_written_in_sample=True).hidden_key is None
    model = SimpleNamespace(requires_full_prefix_cached_hidden_states=False, mm_outputs_written_in_sample=True)
    assert ModelCachePolicy.from_model(model).mm_outputs_written_in_sample is True
    with pytest.raises(OmniPrefixCacheInvalidArgumentError):
        ModelCachePolicy.from_model(SimpleNamespace(mm_outputs_written_in_sample=True))
    assert ModelCachePolicy.from_model(SimpleNamespace()).mm_outputs_written_in_sample is False
