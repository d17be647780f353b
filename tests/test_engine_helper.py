"""The engine helper: begin/save/build in step order, a failed builder discards the rest, commit filters."""

from __future__ import annotations

import threading
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
)
from omni_prefix_cache.engine_helper import OmniPrefixCacheStepDiscardedError, PrefixCacheEngineHelper, SavedStep
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.manager import OmniPrefixCacheManager

BS, W = 4, 4


class Batch:
    """The InputBatch slice the group view reads."""

    def __init__(self) -> None:
        self.block_table = [SimpleNamespace(block_size=BS, block_table=SimpleNamespace(cpu=None))]
        self.set_rows({})

    def set_rows(self, rows: dict[str, tuple[int, list[int]]]) -> None:
        self.req_ids = list(rows)
        self.req_id_to_index = {r: i for i, r in enumerate(rows)}
        self.num_computed_tokens_cpu = torch.tensor([c for c, _ in rows.values()], dtype=torch.int32)
        table = torch.zeros((max(1, len(rows)), 8), dtype=torch.int32)
        for i, (_, blocks) in enumerate(rows.values()):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[0].block_table.cpu = table


def rows(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, W)


class ScriptedAdapter(PrefixCacheSchedulerAdapter):
    """The real adapter's write layout; the step's events given by the test (``scheduler_output.events``)."""

    def translate_step(self, scheduler_output: Any) -> PrefixCacheStep:
        counts = tuple(scheduler_output.num_scheduled_tokens.items())
        return PrefixCacheStep(tuple(scheduler_output.events), counts)


def begin(helper: PrefixCacheEngineHelper, events: list[PrefixCacheRequestEvent], counts: dict[str, int]) -> None:
    helper.begin_step(SimpleNamespace(events=events, num_scheduled_tokens=counts))


class Rig:
    def __init__(self) -> None:
        self.batch = Batch()
        self.mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=BS), eager=True)
        self.mgr.register_policy(ModelCachePolicy())
        view = FullAttentionGroupView(self.batch, BS)
        self.helper = PrefixCacheEngineHelper(self.mgr, view, consumer="out", adapter=ScriptedAdapter())
        self.blocks = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
        self.published: list[tuple[int, dict[str, list[int]]]] = []

    def step(self, events: list[PrefixCacheRequestEvent], spans: dict[str, tuple[int, int]]) -> SavedStep:
        begin(self.helper, events, {r: e - s for r, (s, e) in spans.items()})
        self.batch.set_rows({r: (s, self.blocks[r]) for r, (s, _) in spans.items()})
        hidden = torch.cat([rows(s, e) for s, e in spans.values()])
        n = hidden.shape[0]
        saved = self.helper.save(hidden, None, num_tokens_unpadded=n, num_tokens_padded=n)
        assert saved is not None
        return saved

    def builder(self, saved: SavedStep) -> Any:
        def build(view: Any) -> dict[str, list[int]]:
            return {r: t[:, 0].int().tolist() for r, t in view.hidden_states.items()}

        def publish(payload: dict[str, list[int]], live: frozenset[str]) -> None:
            self.published.append((saved.step_id, {r: payload[r] for r in sorted(live)}))

        return self.helper.output_builder(saved, build, publish)


@pytest.fixture
def rig() -> Any:
    r = Rig()
    yield r
    r.mgr.shutdown()


def ev(rid: str, kind: PrefixCacheEventKind, hit: int = 0, owner: int = 1) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(rid, kind, 0, hit, ((1, 2, 3, 4),), owner=PrefixCacheRequestOwner(owner))


K = PrefixCacheEventKind


def test_builders_run_in_step_order_whatever_thread_calls_them_first(rig: Rig) -> None:
    first = rig.builder(rig.step([ev("a", K.STARTED)], {"a": (0, 4)}))
    second = rig.builder(rig.step([], {"a": (4, 6)}))
    late = threading.Thread(target=second)
    late.start()  # waits for the first builder
    late.join(timeout=0.2)
    assert late.is_alive() and rig.published == []
    first()
    late.join(timeout=10)
    assert [p for _, p in rig.published] == [{"a": [0, 1, 2, 3]}, {"a": [4, 5]}]


def test_a_failed_builder_discards_every_later_step(rig: Rig) -> None:
    s1 = rig.step([ev("a", K.STARTED)], {"a": (0, 4)})

    def broken(view: Any) -> None:
        raise RuntimeError("payload build failed")

    b1 = rig.helper.output_builder(s1, broken, lambda p, live: None)
    s2 = rig.step([], {"a": (4, 6)})
    b2 = rig.builder(s2)
    s3 = rig.step([], {"a": (6, 7)})
    b3 = rig.helper.discard_builder(s3)
    with pytest.raises(RuntimeError, match="payload build failed"):
        b1()
    with pytest.raises(OmniPrefixCacheStepDiscardedError, match=f"step {s2.step_id} discarded.*RuntimeError"):
        b2()
    with pytest.raises(OmniPrefixCacheStepDiscardedError, match=f"step {s3.step_id}"):
        b3()
    assert rig.published == []
    for s in (s2, s3):  # consumed by the discard: a second consume is refused
        with pytest.raises(OmniPrefixCacheUnmatchError):
            rig.mgr.discard_step(s.step_id)


def test_resume_delivers_each_position_once_through_the_builder(rig: Rig) -> None:
    rig.builder(rig.step([ev("a", K.STARTED)], {"a": (0, 6)}))()
    rig.helper.discard_builder(rig.step([], {"a": (6, 9)}))()
    # Preempted; resumes with an 8-token hit: 6 and 7 come back from the cache, 8 is recomputed.
    rig.builder(rig.step([ev("a", K.RESUMED, hit=8)], {"a": (8, 10)}))()
    # Preempted again with only one block cached: the replayed 4-9 are not delivered again.
    rig.builder(rig.step([ev("a", K.RESUMED, hit=4)], {"a": (4, 11)}))()
    assert [p["a"] for _, p in rig.published] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [10]]


def test_commit_hands_off_only_live_owners(rig: Rig) -> None:
    saved = rig.step([ev("a", K.STARTED), ev("b", K.STARTED, owner=2)], {"a": (0, 4), "b": (0, 4)})

    def build(view: Any) -> dict[str, list[int]]:
        # While the payload is built (no lock held), the engine re-admits "b" under a newer owner.
        begin(rig.helper, [ev("b", K.STARTED, owner=3)], {})
        return {r: t[:, 0].int().tolist() for r, t in view.hidden_states.items()}

    handed: list[frozenset[str]] = []
    done = rig.helper.output_builder(saved, build, lambda payload, live: handed.append(live))()
    assert handed == [frozenset({"a"})] and done.live == frozenset({"a"})
    assert set(done.view.token_ranges) == {"a", "b"}  # viewed while b's owner was current
    assert done.outputs._progress["a"].delivered_upto == {"out": 4}
    assert done.outputs._progress["b"].delivered_upto == {}  # dropped, not acknowledged


def test_save_needs_a_begun_step_and_an_empty_step_saves_nothing(rig: Rig) -> None:
    with pytest.raises(OmniPrefixCacheUnmatchError, match="save without a begun step"):
        rig.helper.save(rows(0, 1), None, num_tokens_unpadded=1, num_tokens_padded=1)
    begin(rig.helper, [], {})
    assert rig.helper.save(None, None, num_tokens_unpadded=0, num_tokens_padded=0) is None
    with pytest.raises(OmniPrefixCacheUnmatchError, match="save without a begun step"):
        rig.helper.save(None, None, num_tokens_unpadded=0, num_tokens_padded=0)


def test_outputs_of_an_owner_retired_in_flight_build_without_a_gap(rig: Rig) -> None:
    """vLLM reuses a finished id at once (a follow-up turn): the old owner's last two outputs are still
    unbuilt when the new owner starts. The first commit drops the old rows unacknowledged, so a view of
    the second would start past the old owner's watermark; the builder must not raise there."""
    rig.builder(rig.step([ev("a", K.STARTED)], {"a": (0, 4)}))()
    late = [rig.builder(rig.step([], {"a": (4, 5)})), rig.builder(rig.step([], {"a": (5, 6)}))]
    begin(rig.helper, [ev("a", K.FINISHED), ev("a", K.STARTED, owner=2)], {})
    done = [build() for build in late]
    assert [d.live for d in done] == [frozenset(), frozenset()]
    assert [p for _, p in rig.published] == [{"a": [0, 1, 2, 3]}, {}, {}]
