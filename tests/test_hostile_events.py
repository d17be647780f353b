"""Hostile inputs to the event API (issue 39): every malformed step, event
and write layout is refused at the boundary with the contract error naming
the request, field and value, before anything changes; the corrected call
then works and loses nothing.

Each test drives a manager without a group view (the newest upstream form)
with rows valued by their token position (``Engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
)
from test_contract import background_drain_paused

K = PrefixCacheEventKind
O = PrefixCacheRequestOwner  # noqa: E741 - the owner, as the tests build it
BS, W = 4, 3


def snapshot(m: OmniPrefixCacheManager) -> dict[str, Any]:
    """Every table a refused call must leave as it was: the manager's
    request, step and write tables, staging holders, budget and stats."""
    c = m.components
    rt = c.ledger.requests
    stats = dict(m.stats())
    for volatile in ("committer_wait_s", "join_wait_s"):  # clocks, not state
        stats.pop(volatile, None)
    with c.state_lock:
        return {
            "current": {
                r: (id(t), int(t.state), t.owner, t.computed_upto, t.saved_upto, dict(t.delivered_upto))
                for r, t in c.requests.current.items()
            },
            "last_sequence": c.requests.last_sequence,
            "consumers": list(c.requests.consumers),
            "live": set(m._live),
            "pending_sched": m._pending_sched,
            "pending_hits": dict(c.hits.pending),
            "steps": dict(c.steps),
            "next_step": m._steps.next_id,
            "tasks": {r: dict(t) for r, t in rt.tasks.items()},
            "deferred": dict(rt.deferred),
            "controller_tasks": set(c.controller.parts.registry.tasks),
            "holders": list(c.controller.parts.staging_pool.holders()),
            "staged_bytes": c.controller.parts.budget.staged_bytes,
            "stats": stats,
        }


class Engine:
    """A manager (eager, no group view) and a block table per request."""

    def __init__(self, deferred: bool = True) -> None:
        self.m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=32, block_size=BS), eager=True)
        if deferred:
            self.m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"codes"})))
        self.blocks: dict[str, list[int]] = {"a": [3, 5, 6], "b": [1, 2, 4], "c": [7, 8, 9], "z": [11, 12]}
        self.seq = 0

    def step(self, events: list[PrefixCacheRequestEvent], sched: dict[str, int]) -> PrefixCacheStep:
        self.seq += 1
        return PrefixCacheStep(tuple(events), tuple(sched.items()), self.seq)

    def layout(self, writes: dict[str, tuple[int, int]]) -> PrefixCacheWriteLayout:
        out, slots, cursor = [], [], 0
        for rid, (s, e) in writes.items():
            out.append(PrefixCacheWrite(rid, cursor, cursor + e - s, s, e))
            cursor += e - s
            slots += [self.blocks[rid][p // BS] * BS + p % BS for p in range(s, e)]
        return PrefixCacheWriteLayout(tuple(out), cursor, torch.tensor(slots, dtype=torch.int64))

    def outputs(self, writes: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, dict[str, Any]]:
        rows = [torch.arange(s, e, dtype=torch.float32)[:, None].repeat(1, W) for s, e in writes.values()]
        hidden = torch.cat(rows) if rows else torch.empty((0, W))
        return hidden, {"codes": hidden[:, :1] * 10}

    def save(self, writes: dict[str, tuple[int, int]], layout: Any = None) -> int:
        hidden, mm = self.outputs(writes)
        n = int(hidden.shape[0])
        layout = self.layout(writes) if layout is None else layout
        return self.m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


@pytest.fixture
def eng() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.m.shutdown()


def refused(
    m: OmniPrefixCacheManager, call: Callable[[], Any], *names: str, kind: type = OmniPrefixCacheInvalidArgumentError
) -> None:
    """``call`` raises ``kind`` naming each of ``names``, and changes nothing."""
    with background_drain_paused(m):
        before = snapshot(m)
        with pytest.raises(kind) as info:
            call()
        assert snapshot(m) == before
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def ev(rid: str, kind: Any, **kw: Any) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(rid, kind, **kw)


def positions(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t[:, 0].tolist()]


# ------------------------------------------------------------ new_step_starts


def test_a_generator_of_events_is_read_as_the_events_it_yields(eng: Engine) -> None:
    eng.m.new_step_starts((e for e in [ev("a", K.STARTED, owner=O(1))]), num_scheduled_tokens={"a": 4})
    sid = eng.save({"a": (0, 4)})
    out = eng.m.materialize(sid, ["a"])
    assert out.hidden_states is not None and positions(out.hidden_states["a"]) == [0, 1, 2, 3]
    assert eng.m.components.requests.current["a"].owner == O(1)


@pytest.mark.parametrize(
    "bad, names",
    [
        ([ev("a", K.FINISHED, owner=O(1)), None], ["event 1", "NoneType"]),
        ([None], ["event 0", "NoneType"]),
        ([("a", "finished")], ["event 0", "tuple"]),
        (iter([ev("a", K.FINISHED, owner=O(1)), 7]), ["event 1", "int 7"]),
    ],
    ids=["finished-then-None", "None", "a-tuple", "generator-with-int"],
)
def test_an_event_list_holding_a_non_event_is_refused_and_loses_nothing(
    eng: Engine, bad: Any, names: list[str]
) -> None:
    eng.m.new_step_starts(eng.step([ev("a", K.STARTED, owner=O(1))], {"a": 4}))
    eng.m.discard_step(eng.save({"a": (0, 4)}))
    refused(
        eng.m, lambda: eng.m.new_step_starts(bad, num_scheduled_tokens={}), *names, kind=OmniPrefixCacheInvalidTypeError
    )
    # The corrected call finishes the request.
    eng.m.new_step_starts([ev("a", K.FINISHED, owner=O(1))], num_scheduled_tokens={})
    assert "a" not in eng.m.components.requests.current


@pytest.mark.parametrize("value", [None, 5, "step"], ids=["None", "int", "str"])
def test_a_value_that_is_no_step_is_refused(eng: Engine, value: Any) -> None:
    refused(
        eng.m,
        lambda: eng.m.new_step_starts(value),
        "new_step_starts",
        type(value).__name__,
        kind=OmniPrefixCacheInvalidTypeError,
    )


@pytest.mark.parametrize(
    "step, names",
    [
        (PrefixCacheStep(None, ()), ["PrefixCacheStep.events", "NoneType"]),  # type: ignore[arg-type]
        (PrefixCacheStep("ab", ()), ["PrefixCacheStep.events", "str"]),  # type: ignore[arg-type]
        (PrefixCacheStep((), None), ["scheduled_tokens", "NoneType"]),  # type: ignore[arg-type]
        (PrefixCacheStep((), (("a",),)), ["scheduled_tokens", "('a',)"]),
        (PrefixCacheStep((), (("a", 2.0),)), ["request 'a'", "float 2.0"]),
        (PrefixCacheStep((), ((3, 2),)), ["request id", "int 3"]),
        (PrefixCacheStep((), (("a", -1),)), ["request 'a'", "-1"]),
        (PrefixCacheStep((), (("a", 2), ("a", 2))), ["request 'a' twice"]),
        (PrefixCacheStep((), (), 2.5), ["sequence", "float 2.5"]),  # type: ignore[arg-type]
    ],
    ids=[
        "events-None",
        "events-str",
        "counts-None",
        "count-not-a-pair",
        "count-float",
        "count-id-int",
        "count-negative",
        "id-twice",
        "sequence-float",
    ],
)
def test_a_malformed_step_is_refused_naming_the_field(eng: Engine, step: PrefixCacheStep, names: list[str]) -> None:
    refused(eng.m, lambda: eng.m.new_step_starts(step), *names)


@pytest.mark.parametrize(
    "event, names",
    [
        (ev("a", "resumed", owner=O(1)), ["request 'a'", "kind", "str 'resumed'"]),
        (ev("a", "bogus", owner=O(1)), ["request 'a'", "kind", "'bogus'"]),
        (ev("a", K.STARTED, owner=2), ["request 'a'", "owner", "int 2"]),  # type: ignore[arg-type]
        (ev("a", K.STARTED, owner=(2, 0)), ["request 'a'", "owner", "tuple (2, 0)"]),  # type: ignore[arg-type]
        (ev("a", K.STARTED, owner=O(2.0)), ["request 'a'", "admission_id", "float 2.0"]),  # type: ignore[arg-type]
        (ev(7, K.STARTED, owner=O(1)), ["request id", "int 7"]),  # type: ignore[arg-type]
        (ev("a", K.STARTED, hit_end=4.0), ["request 'a'", "hit_end", "float 4.0"]),
        (ev("a", K.STARTED, hit_end=-4), ["request 'a'", "hit_end", "-4"]),
        (ev("a", K.STARTED, hit_start=4, hit_end=0), ["request 'a'", "hit_start 4 > hit_end 0"]),
        (ev("a", K.STARTED, scheduled_tokens=1.5), ["request 'a'", "scheduled_tokens", "float 1.5"]),
        (ev("a", K.STARTED, num_output_tokens=True), ["request 'a'", "num_output_tokens", "bool"]),
        (ev("a", K.STARTED, block_ids="12"), ["request 'a'", "block_ids", "str '12'"]),
        (ev("a", K.STARTED, lookup_complete=None), ["request 'a'", "lookup_complete", "NoneType"]),
    ],
    ids=[
        "kind-resumed-str",
        "kind-bogus",
        "owner-int",
        "owner-tuple",
        "owner-float-admission",
        "req-id-int",
        "hit-end-float",
        "hit-end-negative",
        "hit-start-past-end",
        "scheduled-float",
        "outputs-bool",
        "block-ids-str",
        "lookup-None",
    ],
)
def test_a_malformed_event_field_is_refused_naming_request_field_and_value(
    eng: Engine, event: PrefixCacheRequestEvent, names: list[str]
) -> None:
    eng.m.new_step_starts(eng.step([ev("b", K.STARTED, owner=O(1))], {"b": 4}))
    eng.m.discard_step(eng.save({"b": (0, 4)}))
    # The bad event comes after a good FINISHED: that one must not apply either.
    step = PrefixCacheStep((ev("b", K.FINISHED, owner=O(1)), event), (), 5)
    refused(eng.m, lambda: eng.m.new_step_starts(step), *names)
    assert "b" in eng.m.components.requests.current


def test_a_plain_string_kind_never_reads_as_a_resume(eng: Engine) -> None:
    """'resumed' compares equal to K.RESUMED but is not it: it used to be
    taken as EXTENDED, so the resume recovered nothing."""
    eng.m.new_step_starts(eng.step([ev("a", K.STARTED, owner=O(1))], {"a": 8}))
    eng.m.discard_step(eng.save({"a": (0, 8)}))
    blocks = (tuple(eng.blocks["a"]),)
    bad = eng.step([ev("a", "resumed", hit_end=8, block_ids=blocks, owner=O(1))], {"a": 2})
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="kind"):
        eng.m.new_step_starts(bad)
    eng.m.new_step_starts(eng.step([ev("a", K.RESUMED, hit_end=8, block_ids=blocks, owner=O(1))], {"a": 2}))
    out = eng.m.materialize(eng.save({"a": (8, 10)}), ["a"])
    assert out.hidden_states is not None and positions(out.hidden_states["a"]) == list(range(10))


# ------------------------------------------------------------ write layouts


def _started(eng: Engine, sched: dict[str, int], counts: bool = True) -> None:
    events = [ev(r, K.STARTED, owner=O(1)) for r in sched]
    if counts:
        eng.m.new_step_starts(eng.step(events, sched))
    else:
        eng.m.new_step_starts(events)  # no scheduled counts: the layout is the source of the rows


def _write(rid: str, rs: Any, re: Any, ts: Any, te: Any) -> PrefixCacheWrite:
    return PrefixCacheWrite(rid, rs, re, ts, te)


def _layout(writes: list[PrefixCacheWrite], total: Any, slots: Any) -> PrefixCacheWriteLayout:
    return PrefixCacheWriteLayout(tuple(writes), total, slots)


SLOTS8 = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7], dtype=torch.int64)  # a's block 3, b's block 1

BAD_LAYOUTS: dict[str, tuple[PrefixCacheWriteLayout, list[str]]] = {
    "unscheduled-request": (
        _layout([_write("a", 0, 4, 0, 4), _write("zz", 4, 8, 0, 4)], 8, SLOTS8),
        ["request 'zz'", "scheduled 0"],
    ),
    "rows-differ-from-counts": (
        _layout([_write("a", 0, 2, 0, 2), _write("b", 2, 8, 0, 6)], 8, SLOTS8),
        ["request 'a'", "2 rows", "scheduled 4"],
    ),
    "scheduled-request-missing": (_layout([_write("a", 0, 4, 0, 4)], 4, SLOTS8[:4]), ["['b']", "does not write"]),
    "request-twice": (_layout([_write("a", 0, 4, 0, 4), _write("a", 4, 8, 4, 8)], 8, SLOTS8), ["request 'a' twice"]),
    "row-bound-float": (
        _layout([_write("a", 0, 4.0, 0, 4), _write("b", 4, 8, 0, 4)], 8, SLOTS8),
        ["request 'a'", "row_end", "float 4.0"],
    ),
    "row-bound-bool": (
        _layout([_write("a", False, 4, 0, 4), _write("b", 4, 8, 0, 4)], 8, SLOTS8),
        ["request 'a'", "row_start", "bool"],
    ),
    "token-bound-float": (
        _layout([_write("a", 0, 4, 0.0, 4.0), _write("b", 4, 8, 0, 4)], 8, SLOTS8),
        ["request 'a'", "token_start", "float"],
    ),
    "req-id-int": (_layout([_write(7, 0, 4, 0, 4), _write("b", 4, 8, 0, 4)], 8, SLOTS8), ["request id", "int 7"]),
    "total-rows-float": (
        _layout([_write("a", 0, 4, 0, 4), _write("b", 4, 8, 0, 4)], 8.0, SLOTS8),
        ["total_rows", "float 8.0"],
    ),
    "slots-float": (
        _layout([_write("a", 0, 4, 0, 4), _write("b", 4, 8, 0, 4)], 8, SLOTS8.double() + 0.5),
        ["slots_cpu", "float64"],
    ),
    "slots-bool": (
        _layout([_write("a", 0, 4, 0, 4), _write("b", 4, 8, 0, 4)], 8, torch.ones(8, dtype=torch.bool)),
        ["slots_cpu", "bool"],
    ),
    "write-a-dict": (PrefixCacheWriteLayout(({"req_id": "a"},), 8, SLOTS8), ["dict", "not a PrefixCacheWrite"]),
    "writes-None": (PrefixCacheWriteLayout(None, 8, SLOTS8), ["writes", "NoneType"]),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
def test_a_layout_that_does_not_match_the_step_is_refused_and_the_corrected_save_works(eng: Engine, case: str) -> None:
    layout, names = BAD_LAYOUTS[case]
    _started(eng, {"a": 4, "b": 4})
    hidden, mm = eng.outputs({"a": (0, 4), "b": (0, 4)})

    def save() -> int:
        return eng.m.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8, write_layout=layout)

    refused(eng.m, save, "save_outputs", *names)
    out = eng.m.materialize(eng.save({"a": (0, 4), "b": (0, 4)}), ["a", "b"])
    assert out.hidden_states is not None
    assert positions(out.hidden_states["a"]) == positions(out.hidden_states["b"]) == [0, 1, 2, 3]


def test_a_float_row_bound_leaks_no_holder_task_or_step_and_the_retry_works(eng: Engine) -> None:
    """It used to raise a TypeError inside save's own error path, leaving two
    staging holders, the tasks and a step context, and the retry failed."""
    _started(eng, {"a": 4})
    bad = _layout([_write("a", 0, 4.0, 0, 4)], 4, SLOTS8[:4])
    hidden, mm = eng.outputs({"a": (0, 4)})
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="row_end"):
        eng.m.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=bad)
    c = eng.m.components
    assert not c.controller.parts.staging_pool.holders() and not c.controller.parts.registry.tasks and not c.steps
    eng.m.materialize(eng.save({"a": (0, 4)}), ["a"])


def test_float_token_bounds_never_become_watermarks(eng: Engine) -> None:
    _started(eng, {"a": 4})
    bad = _layout([_write("a", 0, 4, 0.0, 4.0)], 4, SLOTS8[:4])
    hidden, mm = eng.outputs({"a": (0, 4)})
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="token_start"):
        eng.m.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4, write_layout=bad)
    out = eng.m.materialize(eng.save({"a": (0, 4)}), ["a"])
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    eng.m.ack_delivery(view)
    mark = eng.m.components.requests.current["a"].delivered_upto["talker"]
    assert mark == 4 and type(mark) is int


def test_rows_of_one_request_never_land_in_anothers_write(eng: Engine) -> None:
    """A layout giving a 2 rows and b 6 (scheduled 4 and 4) used to be
    accepted: b's deferred write then held a's rows."""
    _started(eng, {"a": 4, "b": 4})
    lay = _layout([_write("a", 0, 2, 0, 2), _write("b", 2, 8, 0, 6)], 8, SLOTS8)
    hidden, mm = eng.outputs({"a": (0, 4), "b": (0, 4)})
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="scheduled 4"):
        eng.m.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8, write_layout=lay)


def test_without_scheduled_counts_the_layout_is_the_source_of_the_rows(eng: Engine) -> None:
    """Issue 38's gap: events without num_scheduled_tokens, then a layout
    with a deferred key, used to raise a bare KeyError in the split."""
    _started(eng, {"a": 4, "b": 4}, counts=False)
    out = eng.m.materialize(eng.save({"a": (0, 4), "b": (0, 4)}), ["a", "b"])
    assert out.mm_outputs["codes"]["b"][:, 0].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert out.token_ranges == {"a": (0, 4), "b": (0, 4)}
    # The deferred rows landed per request: a later hit on b's blocks reads b's.
    eng.m.new_step_starts([ev("a", K.FINISHED, owner=O(1)), ev("b", K.FINISHED, owner=O(1))])
    eng.blocks["c"] = [1, 9, 10]
    eng.m.new_step_starts(eng.step([ev("c", K.STARTED, hit_end=4, block_ids=((1,),), owner=O(2))], {"c": 1}))
    out = eng.m.materialize(eng.save({"c": (4, 5)}), ["c"])
    assert out.hidden_states is not None and positions(out.hidden_states["c"]) == [0, 1, 2, 3, 4]
    assert out.mm_outputs["codes"]["c"][:, 0].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]


def test_the_same_id_twice_in_the_scheduled_tokens_never_reaches_the_split(eng: Engine) -> None:
    step = PrefixCacheStep((ev("a", K.STARTED, owner=O(1)),), (("a", 2), ("a", 2)), 1)
    refused(eng.m, lambda: eng.m.new_step_starts(step), "request 'a' twice")


def test_a_group_view_slot_mapping_of_floats_is_refused_not_truncated() -> None:
    class View:
        block_size = BS

        def batch_req_ids(self) -> list[str]:
            return ["a"]

        def step_slots_cpu(self, order: Any, counts: Any) -> torch.Tensor:
            return torch.tensor([12.7, 13.2])

    m = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=32, block_size=BS), View(), eager=True)
    try:
        m.new_step_starts([ev("a", K.STARTED)], num_scheduled_tokens={"a": 2})
        with pytest.raises(OmniPrefixCacheInvalidTypeError, match="integer slot ids"):
            m.save_outputs(torch.zeros(2, W), {}, num_tokens_unpadded=2, num_tokens_padded=2)
    finally:
        m.shutdown()
