"""Hostile inputs to delivery (issue 39): delivery_view, ack_delivery and
commit_output refuse what is no output, a view the manager did not issue as
it stands, and an output edited past what was saved, with the contract error
and nothing moved; a view already acknowledged or committed is acknowledged
again as a no-op (issue 46, as upstream's ack only advances); after shutdown
they raise the shutdown error; the consumer table stays bounded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omni_prefix_cache.adapter import PrefixCacheEventKind
from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    StageCacheOutputs,
)
from omni_prefix_cache.requests.lifecycle import MAX_CONSUMERS
from test_hostile_events import Engine, O, ev, positions

K = PrefixCacheEventKind


@pytest.fixture
def eng() -> Iterator[Engine]:
    e = Engine(deferred=False)
    yield e
    e.m.shutdown()


def saved_output(eng: Engine, rid: str = "a", end: int = 4) -> StageCacheOutputs:
    eng.m.new_step_starts(eng.step([ev(rid, K.STARTED, owner=O(1))], {rid: end}))
    return eng.m.materialize(eng.save({rid: (0, end)}), [rid])


def marks(eng: Engine, rid: str = "a") -> dict[str, int]:
    return dict(eng.m.components.requests.current[rid].delivered_upto)


CALLS: dict[str, Callable[[Engine, Any], Any]] = {
    "delivery_view": lambda eng, out: eng.m.delivery_view(out, ["a"], consumer="talker"),
    "ack_delivery": lambda eng, out: eng.m.ack_delivery(out),
    "commit_output": lambda eng, out: eng.m.commit_output(out, lambda live: None),
    "commit_output delivery": lambda eng, out: eng.m.commit_output(
        saved_output(eng, "z"), lambda live: None, delivery=out
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("bad", [None, "out", {"a": (0, 4)}], ids=["None", "str", "dict"])
def test_an_argument_that_is_no_output_is_refused_with_the_invalid_type_error(eng: Engine, call: str, bad: Any) -> None:
    if call == "commit_output delivery" and bad is None:
        assert CALLS[call](eng, bad) == frozenset({"z"})  # no delivery view: commit hands off and acknowledges nothing
        return
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="needs a StageCacheOutputs"):
        CALLS[call](eng, bad)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_delivery_call_after_shutdown_raises_the_shutdown_error(eng: Engine, call: str) -> None:
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    handed: list[Any] = []
    eng.m.shutdown()
    what = {"delivery_view": out, "ack_delivery": view, "commit_output": out}.get(call, view)
    name = call.split()[0]
    with pytest.raises(OmniPrefixCacheShutdownError, match=name):
        if call == "commit_output delivery":
            eng.m.commit_output(out, handed.append, delivery=view)
        else:
            CALLS[call](eng, what)
    assert not handed


def test_a_view_edited_to_cover_more_is_refused_and_the_watermark_stays(eng: Engine) -> None:
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    view.token_ranges["a"] = (0, 100)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"request 'a' for consumer 'talker'.*\[0, 100\)"):
        eng.m.ack_delivery(view)
    handed: list[Any] = []
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not a view this manager issued"):
        eng.m.commit_output(out, handed.append, delivery=view)
    assert marks(eng) == {} and not handed
    # Put back as issued, it is acknowledged to where it was saved.
    view.token_ranges["a"] = (0, 4)
    eng.m.ack_delivery(view)
    assert marks(eng) == {"talker": 4}


def test_a_copy_of_a_view_and_a_hand_built_view_are_refused(eng: Engine) -> None:
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    for forged in (
        dataclasses.replace(view),
        dataclasses.replace(view, token_ranges={"a": (0, 100)}),
        dataclasses.replace(out, _consumer="talker"),
    ):
        with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not a view this manager issued"):
            eng.m.ack_delivery(forged)
    assert marks(eng) == {}


def test_a_second_commit_of_one_view_hands_off_nothing(eng: Engine) -> None:
    """Committing one view twice used to hand the output off twice. The
    second commit is a no-op: nothing of the view is live, the handoff gets
    an empty set, no watermark moves (upstream's tests expect no error)."""
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="builder")
    handed: list[frozenset[str]] = []
    assert eng.m.commit_output(out, handed.append, delivery=view) == frozenset({"a"})
    assert eng.m.commit_output(out, handed.append, delivery=view) == frozenset()
    eng.m.ack_delivery(view)  # a committed view acknowledged again: a no-op
    assert handed == [frozenset({"a"}), frozenset()] and marks(eng) == {"builder": 4}


def test_a_second_acknowledgement_of_one_view_is_a_no_op(eng: Engine) -> None:
    """A runner retrying an ack used to get the invalid-argument error here;
    upstream's ack only advances, so a repeat of an issued view moves nothing."""
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    eng.m.ack_delivery(view)
    eng.m.ack_delivery(view)
    assert marks(eng) == {"talker": 4}
    # A fresh view of the same output selects nothing new and may be acknowledged.
    again = eng.m.delivery_view(out, ["a"], consumer="talker")
    assert again.token_ranges == {"a": (4, 4)}
    eng.m.ack_delivery(again)
    eng.m.ack_delivery(again)
    assert marks(eng) == {"talker": 4}


def test_a_retried_ack_of_an_older_view_never_moves_a_watermark_back(eng: Engine) -> None:
    first = saved_output(eng)
    view = eng.m.delivery_view(first, ["a"], consumer="talker")
    eng.m.ack_delivery(view)
    eng.m.new_step_starts(eng.step([ev("a", K.EXTENDED, owner=O(1))], {"a": 2}))
    later = eng.m.materialize(eng.save({"a": (4, 6)}), ["a"])
    eng.m.ack_delivery(eng.m.delivery_view(later, ["a"], consumer="talker"))
    eng.m.ack_delivery(view)  # the retry of the first view, after the second moved the watermark on
    assert marks(eng) == {"talker": 6}


def test_a_spent_view_edited_or_copied_is_still_refused(eng: Engine) -> None:
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    eng.m.ack_delivery(view)
    for forged in (dataclasses.replace(view), dataclasses.replace(view, token_ranges={"a": (0, 100)})):
        with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not a view this manager issued"):
            eng.m.ack_delivery(forged)
    view.token_ranges["a"] = (0, 100)
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="not a view this manager issued"):
        eng.m.ack_delivery(view)
    assert marks(eng) == {"talker": 4}


def test_a_commit_whose_handoff_raised_leaves_the_view_usable(eng: Engine) -> None:
    out = saved_output(eng)
    view = eng.m.delivery_view(out, ["a"], consumer="builder")

    def failing(live: frozenset[str]) -> None:
        raise RuntimeError("handoff failed")

    with pytest.raises(RuntimeError, match="handoff failed"):
        eng.m.commit_output(out, failing, delivery=view)
    assert marks(eng) == {}
    assert eng.m.commit_output(out, lambda live: None, delivery=view) == frozenset({"a"})
    assert marks(eng) == {"builder": 4}


def test_an_output_edited_past_what_was_saved_gets_no_view(eng: Engine) -> None:
    """A view of an output edited to (0, 100) used to be issued, and its
    acknowledgement moved the watermark to 100 with 4 positions saved."""
    out = saved_output(eng)
    edited = dataclasses.replace(out, token_ranges={"a": (0, 100)})
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"covers \[0, 100\).*saved positions up to 4"):
        eng.m.delivery_view(edited, ["a"], consumer="talker")
    assert marks(eng) == {}
    # The next step's rows still reach the consumer from its watermark.
    eng.m.new_step_starts(eng.step([ev("a", K.EXTENDED, owner=O(1))], {"a": 2}))
    later = eng.m.materialize(eng.save({"a": (4, 6)}), ["a"])
    view = eng.m.delivery_view(out, ["a"], consumer="talker")
    eng.m.ack_delivery(view)
    view = eng.m.delivery_view(later, ["a"], consumer="talker")
    assert view.hidden_states is not None and positions(view.hidden_states["a"]) == [4, 5]


def test_a_float_token_range_in_an_output_is_refused(eng: Engine) -> None:
    out = saved_output(eng)
    out.token_ranges["a"] = (0.0, 4.0)  # type: ignore[assignment]
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="pair of ints"):
        eng.m.delivery_view(out, ["a"], consumer="talker")


def test_one_consumer_name_per_request_keeps_the_consumer_table_bounded(eng: Engine) -> None:
    """One consumer per request used to grow components.requests.consumers
    by one name per request, forever (500 names, then 2,000)."""
    table = eng.m.components.requests
    for i in range(300):
        rid = f"r{i}"
        eng.blocks[rid] = [i % 30 + 1]
        out = saved_output(eng, rid, 2)
        eng.m.ack_delivery(eng.m.delivery_view(out, [rid], consumer=f"consumer-{i}"))
        eng.m.new_step_starts([ev(rid, K.FINISHED, owner=O(1))])
    assert len(table.consumers) == MAX_CONSUMERS
    stats = eng.m.stats()
    assert stats["delivery_consumers"] == MAX_CONSUMERS
    assert stats["delivery_consumers_forgotten_total"] == 300 - MAX_CONSUMERS
    # The most recent consumers are the ones remembered.
    assert list(table.consumers)[-1] == "consumer-299" and "consumer-0" not in table.consumers


def test_a_consumer_seen_again_is_remembered_over_newer_ones(eng: Engine) -> None:
    out = saved_output(eng)
    eng.m.delivery_view(out, ["a"], consumer="talker")
    for i in range(MAX_CONSUMERS - 1):
        eng.m.delivery_view(out, ["a"], consumer=f"c{i}")
    eng.m.delivery_view(out, ["a"], consumer="talker")  # seen again: now the most recent
    eng.m.delivery_view(out, ["a"], consumer="newest")
    consumers = eng.m.components.requests.consumers
    assert "talker" in consumers and "c0" not in consumers and len(consumers) == MAX_CONSUMERS
