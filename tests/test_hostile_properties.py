"""Property test of the event API's boundary (issue 39).

Hypothesis runs a few requests through steps (STARTED, EXTENDED, FINISHED,
with a deferred key) and, before a step's ``new_step_starts`` or its
``save_outputs``, may first try a malformed version built from the public
types: one event field, the step's events container, its scheduled tokens or
sequence, or one field of the write layout replaced by a hostile value.
Every malformed call must raise the contract error (invalid argument or
invalid type), and leave every table, staging holder, task, budget and stat
as it was (``test_hostile_events.snapshot``); the valid call that follows
must give exact rows, and at the end nothing is held.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from omni_prefix_cache.adapter import PrefixCacheRequestEvent, PrefixCacheStep, PrefixCacheWriteLayout
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError
from test_contract import background_drain_paused
from test_hostile_events import Engine, K, O, ev, positions, snapshot

# Hostile values per field: each one must be refused wherever it appears.
BAD_INT = st.sampled_from([1.0, -1, True, None, "2", 2.5, (1,)])
BAD_EVENT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "req_id": st.sampled_from([7, None, b"a", 1.5, ("a",)]),
    "kind": st.sampled_from(["started", "extended", "resumed", "bogus", 0, None]),
    "hit_start": BAD_INT,
    "hit_end": BAD_INT,
    "scheduled_tokens": BAD_INT,
    "num_output_tokens": BAD_INT,
    "owner": st.sampled_from([1, (1, 0), "1", O(1.0), O(1, None)]),  # type: ignore[arg-type]
    "block_ids": st.sampled_from(["12", None, 5, {"g": (1,)}]),
    "lookup_complete": st.sampled_from([None, 1, "yes"]),
}
BAD_STEP_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "events": st.sampled_from([None, "ab", 5, {"a": 1}]),
    "scheduled_tokens": st.sampled_from([None, "a", (("a",),), (("a", 1.0),), ((1, 2),), (("a", -2),)]),
    "sequence": st.sampled_from([1.5, "3", (1,)]),
}
BAD_WRITE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "req_id": st.sampled_from([7, None, "nobody"]),
    "row_start": BAD_INT,
    "row_end": BAD_INT,
    "token_start": BAD_INT,
    "token_end": BAD_INT,
}


def refused(eng: Engine, call: Any, where: str) -> None:
    with background_drain_paused(eng.m):
        before = snapshot(eng.m)
        try:
            call()
        except OmniPrefixCacheInvalidArgumentError:
            pass
        else:
            raise AssertionError(f"{where}: a malformed call was accepted")
        assert snapshot(eng.m) == before, where
    event(where)


def malformed_step(draw: Any, step: PrefixCacheStep) -> tuple[str, PrefixCacheStep]:
    if step.events and draw(st.booleans(), label="malform an event"):
        i = draw(st.integers(0, len(step.events) - 1), label="event")
        name = draw(st.sampled_from(sorted(BAD_EVENT_FIELDS)), label="event field")
        bad = dataclasses.replace(step.events[i], **{name: draw(BAD_EVENT_FIELDS[name])})
        events = (*step.events[:i], bad, *step.events[i + 1 :])
        return f"event {name}", dataclasses.replace(step, events=events)
    if draw(st.booleans(), label="a non-event among the events"):
        junk = draw(st.sampled_from([None, "a", 3, ("a", K.STARTED)]))
        return "a non-event", dataclasses.replace(step, events=(*step.events, junk))
    name = draw(st.sampled_from(sorted(BAD_STEP_FIELDS)), label="step field")
    value = draw(BAD_STEP_FIELDS[name])
    if name == "scheduled_tokens" and step.scheduled_tokens and draw(st.booleans(), label="repeat an id"):
        value = (*step.scheduled_tokens, step.scheduled_tokens[0])
    return f"step {name}", dataclasses.replace(step, **{name: value})


def malformed_layout(draw: Any, layout: PrefixCacheWriteLayout) -> tuple[str, PrefixCacheWriteLayout]:
    choice = draw(st.sampled_from(["write", "total_rows", "slots", "rows", "twice"]), label="layout")
    writes = list(layout.writes)
    if choice == "write":
        i = draw(st.integers(0, len(writes) - 1), label="write")
        name = draw(st.sampled_from(sorted(BAD_WRITE_FIELDS)), label="write field")
        writes[i] = dataclasses.replace(writes[i], **{name: draw(BAD_WRITE_FIELDS[name])})
        return f"write {name}", dataclasses.replace(layout, writes=tuple(writes))
    if choice == "total_rows":
        return choice, dataclasses.replace(layout, total_rows=draw(BAD_INT))
    if choice == "slots":
        slots = layout.slots_cpu
        bad = draw(st.sampled_from([slots.double() + 0.25, slots.bool(), slots[:-1], slots.tolist(), None]))
        return choice, dataclasses.replace(layout, slots_cpu=bad)
    if choice == "rows":  # rows that differ from the step's counts: one write one row shorter, the next longer
        w = writes[0]
        writes[0] = dataclasses.replace(w, row_end=w.row_end - 1, token_end=w.token_end - 1)
        if len(writes) > 1:
            n = writes[1]
            writes[1] = dataclasses.replace(n, row_start=n.row_start - 1, token_start=n.token_start - 1)
        return choice, dataclasses.replace(layout, writes=tuple(writes))
    return choice, dataclasses.replace(layout, writes=(*writes, dataclasses.replace(writes[0])))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_malformed_step_event_or_layout_changes_nothing_and_the_valid_call_follows(data: st.DataObject) -> None:
    draw = data.draw
    eng = Engine()
    try:
        running: dict[str, int] = {}  # request -> positions saved
        owners = {"a": O(1), "b": O(2), "c": O(3)}
        for _ in range(draw(st.integers(1, 4), label="steps")):
            events: list[PrefixCacheRequestEvent] = []
            writes: dict[str, tuple[int, int]] = {}
            for rid in ("a", "b", "c"):
                if rid not in running and draw(st.booleans(), label=f"start {rid}"):
                    events.append(ev(rid, K.STARTED, owner=owners[rid]))
                    running[rid] = 0
                elif rid in running and running[rid] < 12:
                    events.append(ev(rid, K.EXTENDED, owner=owners[rid]))
                if rid in running and running[rid] < 12:
                    n = draw(st.integers(1, 12 - running[rid]), label=f"tokens {rid}")
                    writes[rid] = (running[rid], running[rid] + n)
            if not writes:
                continue
            step = eng.step(events, {r: e - s for r, (s, e) in writes.items()})
            if draw(st.booleans(), label="malform the step"):
                where, bad = malformed_step(draw, step)
                refused(eng, lambda bad=bad: eng.m.new_step_starts(bad), where)
            eng.m.new_step_starts(step)
            layout = eng.layout(writes)
            if draw(st.booleans(), label="malform the layout"):
                where, bad_layout = malformed_layout(draw, layout)
                refused(eng, lambda bad=bad_layout, w=writes: eng.save(w, bad), where)
            out = eng.m.materialize(eng.save(writes, layout), list(writes))
            assert out.hidden_states is not None
            for rid, (s, e) in writes.items():
                assert positions(out.hidden_states[rid]) == list(range(s, e)), rid
                running[rid] = e
        eng.m.new_step_starts([ev(r, K.FINISHED, owner=owners[r]) for r in running])
        c = eng.m.components
        assert not c.steps and not c.controller.parts.staging_pool.holders() and not c.controller.parts.registry.tasks
        assert c.controller.parts.budget.staged_bytes == 0
    finally:
        eng.m.shutdown()
