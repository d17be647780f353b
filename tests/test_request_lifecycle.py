"""The request lifecycle and per-consumer delivery, on the real manager.

Each test drives the event API (spec/request_lifecycle.yaml, spec/delivery.yaml
and their operations in spec/protocol.yaml) with rows whose value is their
token position, so every served row says where it came from.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omni_prefix_cache import OmniPrefixCacheManager, PrefixCacheConfig
from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    PrefixCacheRequestProgress,
    StageCacheOutputs,
    output_progress,
)
from omni_prefix_cache.requests.delivery import OmniPrefixCacheDeliveryGapError
from omni_prefix_cache.specs.types.request_lifecycle import RequestState

K = PrefixCacheEventKind
BS = 4
W = 3


class Engine:
    """A tiny engine: each request has a fixed block table; a step saves
    rows valued ``position`` (plus ``offset`` per request, so two tenures
    of one id can be told apart)."""

    def __init__(self) -> None:
        self.m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=32, block_size=BS), eager=True)
        self.blocks: dict[str, list[int]] = {}
        self.offset: dict[str, float] = {}
        self.seq = 0

    def step(self, events: list[PrefixCacheRequestEvent], writes: dict[str, tuple[int, int]], mm: bool = False) -> int:
        self.seq += 1
        counts = tuple((r, e - s) for r, (s, e) in writes.items())
        self.m.new_step_starts(PrefixCacheStep(tuple(events), counts, self.seq))
        layout_writes, slots, rows, cursor = [], [], [], 0
        for rid, (s, e) in writes.items():
            layout_writes.append(PrefixCacheWrite(rid, cursor, cursor + e - s, s, e))
            cursor += e - s
            slots += [self.blocks[rid][p // BS] * BS + p % BS for p in range(s, e)]
            rows.append(torch.arange(s, e, dtype=torch.float32)[:, None].repeat(1, W) + self.offset.get(rid, 0.0))
        layout = PrefixCacheWriteLayout(tuple(layout_writes), cursor, torch.tensor(slots, dtype=torch.int64))
        hidden = torch.cat(rows) if rows else torch.empty((0, W))
        extra = {}
        if mm:
            extra = {"codes": hidden[:, :1].clone() * 10, "meta": torch.tensor([7.0])}
        return self.m.save_outputs(
            hidden, extra, num_tokens_unpadded=cursor, num_tokens_padded=cursor, write_layout=layout
        )

    def ev(
        self, rid: str, kind: PrefixCacheEventKind, hit: int = 0, owner: int | None = 1, gen: int = 0, **kw: object
    ) -> PrefixCacheRequestEvent:
        own = None if owner is None else PrefixCacheRequestOwner(owner, gen)
        blocks = (tuple(self.blocks.get(rid, ())),) if hit else ()
        return PrefixCacheRequestEvent(rid, kind, 0, hit, blocks, owner=own, **kw)  # type: ignore[arg-type]


@pytest.fixture
def eng() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.m.shutdown()


def positions(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t[:, 0].tolist()]


def deliver(m: OmniPrefixCacheManager, out: StageCacheOutputs, rid: str, consumer: str) -> list[int]:
    view = m.delivery_view(out, [rid], consumer=consumer)
    m.ack_delivery(view)
    assert view.hidden_states is not None
    return positions(view.hidden_states[rid])


def test_resume_after_a_discarded_step_recovers_every_row(eng: Engine) -> None:
    eng.blocks["a"] = [3, 5, 6]
    eng.m.discard_step(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 8)}))
    # Preempted; resumes with an 8-token hit: the talker never got rows 0-7.
    sid = eng.step([eng.ev("a", K.RESUMED, hit=8)], {"a": (8, 10)})
    out = eng.m.materialize(sid, ["a"])
    assert out.token_ranges == {"a": (0, 10)} and out.scheduled_token_ranges == {"a": (8, 10)}
    assert out.hidden_states is not None and positions(out.hidden_states["a"]) == list(range(10))
    assert deliver(eng.m, out, "a", "talker") == list(range(10))
    assert output_progress(out)["a"].delivered_upto == {"talker": 10}


def test_growing_hit_delivers_from_the_watermark(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 4, 7]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 6)}), ["a"])
    assert deliver(eng.m, out, "a", "talker") == list(range(6))
    eng.m.discard_step(eng.step([eng.ev("a", K.EXTENDED)], {"a": (6, 12)}))
    sid = eng.step([eng.ev("a", K.RESUMED, hit=12)], {"a": (12, 14)})
    out = eng.m.materialize(sid, ["a"])
    assert out.token_ranges == {"a": (6, 14)}
    assert deliver(eng.m, out, "a", "talker") == list(range(6, 14))


def test_shrinking_hit_saves_the_replay_and_delivers_only_the_new_suffix(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 4, 7]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 12)}), ["a"])
    assert deliver(eng.m, out, "a", "talker") == list(range(12))
    # Resumed with only 4 tokens cached: 4-13 are recomputed, 4-11 were delivered already.
    out = eng.m.materialize(eng.step([eng.ev("a", K.RESUMED, hit=4)], {"a": (4, 14)}), ["a"])
    assert out.token_ranges == {"a": (4, 14)}  # no hit left to recover: the step's rows
    assert deliver(eng.m, out, "a", "talker") == [12, 13]
    # The replayed rows were saved: a new request hitting those blocks reads them.
    eng.blocks["b"] = [1, 2, 4, 8]
    out = eng.m.materialize(eng.step([eng.ev("b", K.STARTED, hit=12, owner=2)], {"b": (12, 13)}), ["b"])
    assert out.hidden_states is not None and positions(out.hidden_states["b"]) == list(range(13))


def test_a_gap_raises_and_moves_nothing(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    eng.m.discard_step(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}))
    out = eng.m.materialize(eng.step([eng.ev("a", K.EXTENDED)], {"a": (4, 6)}), ["a"])
    with pytest.raises(OmniPrefixCacheDeliveryGapError, match=r"request 'a' consumer 'talker'.*delivered up to 0"):
        eng.m.delivery_view(out, ["a"], consumer="talker")
    assert output_progress(out)["a"].delivered_upto == {}


def test_ack_checks_the_whole_view_before_moving(eng: Engine) -> None:
    eng.blocks["a"], eng.blocks["b"] = [1, 2], [3, 4]
    out = eng.m.materialize(
        eng.step([eng.ev("a", K.STARTED), eng.ev("b", K.STARTED, owner=2)], {"a": (0, 4), "b": (0, 4)}), ["a", "b"]
    )
    view = eng.m.delivery_view(out, ["a", "b"], consumer="c")
    # b's watermark jumps (another view acknowledged later rows first): acking this view now is fine...
    progress = output_progress(out)
    progress["b"].delivered_upto["c"] = 0
    eng.m.ack_delivery(view)
    assert progress["a"].delivered_upto == {"c": 4} and progress["b"].delivered_upto == {"c": 4}
    # ... but a view that starts past a watermark is refused whole.
    out2 = eng.m.materialize(eng.step([], {"a": (4, 6), "b": (4, 6)}), ["a", "b"])
    view2 = eng.m.delivery_view(out2, ["a", "b"], consumer="c")
    progress["b"].delivered_upto["c"] = 2  # rewound by hand: 2-3 now look undelivered
    with pytest.raises(OmniPrefixCacheDeliveryGapError, match="request 'b'"):
        eng.m.ack_delivery(view2)
    assert progress["a"].delivered_upto == {"c": 4}


def test_discard_is_not_delivery(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 3]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}), ["a"])
    assert deliver(eng.m, out, "a", "talker") == [0, 1, 2, 3]
    eng.m.discard_step(eng.step([], {"a": (4, 6)}))
    # An unacknowledged view is not delivery either.
    out = eng.m.materialize(eng.step([], {"a": (6, 8)}), ["a"])
    with pytest.raises(OmniPrefixCacheDeliveryGapError):
        eng.m.delivery_view(out, ["a"], consumer="talker")
    assert output_progress(out)["a"].delivered_upto == {"talker": 4}


def test_two_consumers_keep_their_own_watermarks_and_resume_recovers_for_the_slowest(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 3, 4]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 8)}), ["a"])
    assert deliver(eng.m, out, "a", "builder") == list(range(8))
    eng.m.delivery_view(out, ["a"], consumer="lagging")  # viewed, never acknowledged
    out = eng.m.materialize(eng.step([], {"a": (8, 12)}), ["a"])
    assert deliver(eng.m, out, "a", "builder") == list(range(8, 12))
    # The lagging consumer acknowledged nothing (a consumer known to the
    # manager counts from 0); the request is preempted and resumes.
    out = eng.m.materialize(eng.step([eng.ev("a", K.RESUMED, hit=12)], {"a": (12, 13)}), ["a"])
    assert out.token_ranges == {"a": (0, 13)}
    assert deliver(eng.m, out, "a", "builder") == [12]
    assert deliver(eng.m, out, "a", "lagging") == list(range(13))


def test_a_late_ack_after_id_reuse_advances_only_its_own_tenure(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    old = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}), ["a"])
    old_view = eng.m.delivery_view(old, ["a"], consumer="talker")
    eng.step([eng.ev("a", K.FINISHED)], {})  # the step of the finish saves nothing
    eng.blocks["a"], eng.offset["a"] = [5, 6], 100.0
    new = eng.m.materialize(eng.step([eng.ev("a", K.STARTED, owner=2)], {"a": (0, 2)}), ["a"])
    eng.m.ack_delivery(old_view)  # the old builder acknowledges late
    assert output_progress(old)["a"].delivered_upto == {"talker": 4}
    assert output_progress(new)["a"].delivered_upto == {}
    assert deliver(eng.m, new, "a", "talker") == [100, 101]
    # The finished tenure was retired by the new admission: commit filters it.
    assert eng.m.commit_output(old, lambda live: None) == frozenset()
    assert output_progress(old)["a"].state is RequestState.RETIRED


def test_replaced_resets_progress_keeps_the_writes_and_filters_the_old_output(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    old = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 8)}), ["a"])
    eng.blocks["a"], eng.offset["a"] = [9, 10], 50.0
    replaced = eng.ev("a", K.REPLACED, owner=1, gen=1)
    new = eng.m.materialize(eng.step([replaced], {"a": (0, 3)}), ["a"])
    handed: list[frozenset[str]] = []
    view = eng.m.delivery_view(old, ["a"], consumer="talker")
    assert eng.m.commit_output(old, handed.append, delivery=view) == frozenset()
    assert handed == [frozenset()] and output_progress(old)["a"].delivered_upto == {}
    view = eng.m.delivery_view(new, ["a"], consumer="talker")
    assert eng.m.commit_output(new, handed.append, delivery=view) == frozenset({"a"})
    assert output_progress(new)["a"].delivered_upto == {"talker": 3}
    # The producer's rows of the replaced content still landed in the cache.
    eng.blocks["b"] = [1, 2, 11]
    out = eng.m.materialize(eng.step([eng.ev("b", K.STARTED, hit=8, owner=3)], {"b": (8, 9)}), ["b"])
    assert out.hidden_states is not None and positions(out.hidden_states["b"])[:8] == list(range(8))


def test_an_older_owner_never_moves_the_current_tenure(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    eng.m.discard_step(eng.step([eng.ev("a", K.STARTED, owner=5)], {"a": (0, 4)}))
    tenure = eng.m.components.requests.current["a"]
    eng.m.discard_step(eng.step([eng.ev("a", K.FINISHED, owner=4), eng.ev("a", K.STARTED, owner=4)], {"a": (4, 5)}))
    assert eng.m.components.requests.current["a"] is tenure and tenure.state is RequestState.RUNNING


def test_an_owner_change_without_a_lifecycle_event_raises_before_anything_moves(eng: Engine) -> None:
    eng.blocks["a"], eng.blocks["b"] = [1, 2], [3]
    eng.m.discard_step(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"request 'a' changed owner"):
        eng.step([eng.ev("b", K.STARTED, owner=2), eng.ev("a", K.EXTENDED, owner=2)], {"a": (4, 5)})
    assert "b" not in eng.m.components.requests.current
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="without a REPLACED event"):
        eng.step([eng.ev("a", K.STARTED, gen=1)], {"a": (4, 5)})


def test_a_replayed_step_sequence_applies_nothing(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    eng.m.discard_step(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}))
    tenure = eng.m.components.requests.current["a"]
    eng.m.new_step_starts(PrefixCacheStep((eng.ev("a", K.FINISHED),), (), eng.seq))
    assert eng.m.components.requests.current["a"] is tenure


def test_token_major_mm_is_clipped_and_metadata_kept_whole(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 3]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}, mm=True), ["a"])
    view = eng.m.delivery_view(out, ["a"], consumer="c")
    eng.m.ack_delivery(view)
    eng.m.discard_step(eng.step([], {"a": (4, 8)}, mm=True))
    out = eng.m.materialize(eng.step([eng.ev("a", K.RESUMED, hit=8)], {"a": (8, 10)}, mm=True), ["a"])
    assert out.cached_mm_keys == frozenset({"codes"}) and "codes" in out.token_mm_keys
    assert "meta" not in out.token_mm_keys
    view = eng.m.delivery_view(out, ["a"], consumer="c")
    assert view.token_ranges == {"a": (4, 10)}
    assert [int(v) for v in view.mm_outputs["codes"]["a"][:, 0].tolist()] == [40, 50, 60, 70, 80, 90]
    assert view.mm_outputs["meta"]["a"].tolist() == [7.0]


def test_save_without_a_view_needs_a_write_layout(eng: Engine) -> None:
    eng.m.new_step_starts(PrefixCacheStep((eng.ev("a", K.STARTED),), (("a", 2),), 1))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="needs a write_layout"):
        eng.m.save_outputs(torch.zeros((2, W)), {}, num_tokens_unpadded=2, num_tokens_padded=2)


def test_a_layout_that_does_not_pack_the_rows_is_refused(eng: Engine) -> None:
    eng.m.new_step_starts(PrefixCacheStep((eng.ev("a", K.STARTED),), (("a", 2),), 1))
    bad = PrefixCacheWriteLayout((PrefixCacheWrite("a", 1, 3, 0, 2),), 2, torch.tensor([0, 1]))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="does not continue the layout at row 0"):
        eng.m.save_outputs(torch.zeros((2, W)), {}, num_tokens_unpadded=2, num_tokens_padded=2, write_layout=bad)


def test_a_shrinking_resume_needs_no_aligned_hit(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2, 3]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 8)}), ["a"])
    assert deliver(eng.m, out, "a", "talker") == list(range(8))
    # 6 cached tokens is not block aligned, but nothing is recovered from the cache below 8.
    out = eng.m.materialize(eng.step([eng.ev("a", K.RESUMED, hit=6)], {"a": (6, 9)}), ["a"])
    assert deliver(eng.m, out, "a", "talker") == [8]
    # A growing resume with a misaligned hit is refused before anything moves.
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not block aligned"):
        eng.step([eng.ev("a", K.RESUMED, hit=10)], {"a": (10, 11)})


def test_a_view_of_a_retired_tenure_selects_nothing_instead_of_a_gap(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    first = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}), ["a"])
    second = eng.m.materialize(eng.step([], {"a": (4, 8)}), ["a"])
    eng.step([eng.ev("a", K.REPLACED, gen=1, lookup_complete=False)], {})
    # A lagging builder catches up after the replacement: the first view has
    # no gap (commit filters it), the second would skip 0-3 and selects nothing.
    for out, rows in ((first, 4), (second, 0)):
        view = eng.m.delivery_view(out, ["a"], consumer="builder")
        assert view.hidden_states is not None and view.hidden_states["a"].shape[0] == rows
        assert eng.m.commit_output(out, lambda live: None, delivery=view) == frozenset()
    assert output_progress(first)["a"].delivered_upto == {}


def test_a_lookup_after_a_control_in_the_same_step_is_validated_first(eng: Engine) -> None:
    eng.blocks["a"] = [1, 2]
    control = eng.ev("a", K.STARTED, lookup_complete=False)
    bad = PrefixCacheRequestEvent("a", K.EXTENDED, 0, 6, ((1, 2),), owner=PrefixCacheRequestOwner(1))
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not block aligned"):
        eng.step([control, bad], {"a": (6, 7)})
    assert "a" not in eng.m.components.requests.current


def hand_built(progress: dict[str, PrefixCacheRequestProgress], rows: int = 2) -> StageCacheOutputs:
    """An output built by hand, as upstream's tests build one: bare progress
    objects, not tenures a materialize recorded."""
    return StageCacheOutputs(
        hidden_states={rid: torch.arange(rows, dtype=torch.float32)[:, None] for rid in progress},
        mm_outputs={},
        token_ranges={rid: (0, rows) for rid in progress},
        scheduled_token_ranges={rid: (0, rows) for rid in progress},
        _progress=dict(progress),
    )


def test_a_hand_built_output_delivers_and_acknowledges_its_own_progress(eng: Engine) -> None:
    a, b = PrefixCacheRequestProgress(), PrefixCacheRequestProgress(delivered_upto={"builder": 1})
    raw = hand_built({"a": a, "b": b})
    view = eng.m.delivery_view(raw, ["b"], consumer="builder")
    assert view.hidden_states is not None and positions(view.hidden_states["b"]) == [1]
    eng.m.ack_delivery(view)
    # The caller's own objects move (only the one acknowledged); a gap still raises.
    assert (a.delivered_upto, b.delivered_upto) == ({}, {"builder": 2})
    assert positions(eng.m.delivery_view(raw, ["b"], consumer="builder").hidden_states["b"]) == []  # type: ignore[index]
    with pytest.raises(OmniPrefixCacheDeliveryGapError, match="request 'c'"):
        gap = StageCacheOutputs({"c": torch.zeros((1, 1))}, {}, token_ranges={"c": (3, 4)})
        gap._progress["c"] = PrefixCacheRequestProgress()
        eng.m.delivery_view(gap, ["c"], consumer="builder")


def test_commit_of_a_hand_built_output_filters_retired_and_reused_progress(eng: Engine) -> None:
    eng.blocks["c"] = [1]
    eng.m.discard_step(eng.step([eng.ev("c", K.STARTED)], {"c": (0, 4)}))
    live, retired, shadowed = (PrefixCacheRequestProgress() for _ in range(3))
    retired.retired = True
    raw = hand_built({"a": live, "b": retired, "c": shadowed})  # "c" is a live request's id
    view = eng.m.delivery_view(raw, ["a", "b", "c"], consumer="builder")
    handed: list[frozenset[str]] = []
    assert eng.m.commit_output(raw, handed.append, delivery=view) == frozenset({"a"})
    assert handed == [frozenset({"a"})]
    assert (live.delivered_upto, retired.delivered_upto, shadowed.delivered_upto) == ({"builder": 2}, {}, {})


def test_an_output_without_the_request_or_its_progress_is_refused_by_name(eng: Engine) -> None:
    no_progress = StageCacheOutputs({"a": torch.zeros((2, 1))}, {}, token_ranges={"a": (0, 2)})
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"request 'a' has no request progress"):
        eng.m.delivery_view(no_progress, ["a"], consumer="builder")
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"request 'z' is not in this output"):
        eng.m.delivery_view(hand_built({"a": PrefixCacheRequestProgress()}), ["z"], consumer="builder")
    wrong = StageCacheOutputs({"a": torch.zeros((2, 1))}, {}, token_ranges={"a": (0, 2)}, _progress={"a": 3})  # type: ignore[dict-item]
    with pytest.raises(
        OmniPrefixCacheInvalidTypeError, match=r"progress of request 'a' must be a PrefixCacheRequestProgress"
    ):
        eng.m.delivery_view(wrong, ["a"], consumer="builder")
