"""A compiled operation's batch closures (specs/composition_compile.py, derived
from the same compiled steps as its per-instance closures) move every
instance as running the same operation instance by instance would: same
component states, same effects per instance, same instances refused or
failed (and with ``truncate``, the same ones never run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition import Do, OperationSpec, ProtocolViolation, compile_operation, load_protocol
from omni_prefix_cache.specs.runner import SegmentRunner

SPEC = load_protocol()
CONTROLLER = SPEC.executors["controller"]
MACHINES = {role: SPEC.components[role] for role in CONTROLLER.roles}
# What the controller runs batched: its share of each operation (spec executors).
OPS: dict[str, OperationSpec] = {
    "register": SPEC.share("controller", "save", "register"),
    "abandon_refund": SPEC.share("controller", "abandon_save"),
    **{
        name: SPEC.share("controller", name)
        for name in ("escalate", "committer_claim", "committer_copy", "committer_write", "eager_run", "fail")
    },
    "shutdown": SPEC.share("controller", "shutdown"),
}


@dataclass(eq=False)
class Item:
    """One instance: a state per role, guard values, an effect that raises."""

    ident: int
    states: dict[str, str]
    guards: dict[str, bool]
    raises_in: str | None
    log: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Item({self.ident})"


class ToyBinding:
    """Moves by the machines' own move tables (guards of the machines
    count as passing), on the item's per-role state."""

    def move(self, role: str, trigger: str) -> tuple[Any, Any]:
        table = {src: m.dest for m in MACHINES[role].moves if m.trigger == trigger for src in m.source}

        def target(item: Item) -> str | None:
            return table.get(item.states[role])

        def enabled(item: Item) -> bool:
            return target(item) is not None

        def fire(item: Item) -> None:
            if item.raises_in == f"{role}.{trigger}":
                raise RuntimeError(f"{role}.{trigger} failed for {item.ident}")
            dest = target(item)
            assert dest is not None
            item.log.append(f"{role}.{trigger}")
            item.states[role] = dest

        return enabled, fire

    def coupling(self, role: str, name: str) -> Any:
        raise AssertionError("no couplings in the controller's operations")


def _handlers(op: OperationSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    def effect(name: str) -> Any:
        def run(item: Item) -> None:
            if item.raises_in == name:
                raise RuntimeError(f"{name} failed for {item.ident}")
            item.log.append(name)

        return run

    def guard(name: str) -> Any:
        return lambda item: item.guards[name]

    return {e: effect(e) for e in SPEC.effect_names}, {g: guard(g) for g in SPEC.guard_names}


def run_one_by_one(op: OperationSpec, items: list[Item], truncate: bool) -> tuple[list[Item], list[Item]]:
    """The reference: each item through every segment, in order; an item
    that raises (or is refused) stops, and with ``truncate`` so does the loop."""
    effects, guards = _handlers(op)
    compiled = compile_operation(op, ToyBinding(), effects, guards)
    failed: list[Item] = []
    cut: list[Item] = []
    for index, item in enumerate(items):
        if not compiled.admits(item):
            continue
        try:
            for segment in compiled.segments:
                segment(item)
        except (RuntimeError, ProtocolViolation):
            failed.append(item)
            if truncate:
                # Never reached; an item the entry would not admit is not cut, only skipped.
                cut = [x for x in items[index + 1 :] if compiled.admits(x)]
                break
    return failed, cut


def run_batched(op: OperationSpec, items: list[Item], truncate: bool) -> Batch:
    effects, guards = _handlers(op)
    compiled = compile_operation(op, ToyBinding(), effects, guards)
    admitted = compiled.admits_many(items)
    batch = Batch([x for x, ok in zip(items, admitted) if ok], truncate=truncate)
    for segment in compiled.batches:
        if not batch.items:
            break
        segment(batch)
    return batch


def items_strategy(op: OperationSpec) -> st.SearchStrategy[list[Item]]:
    role_states = {role: st.sampled_from(list(m.state_names)) for role, m in MACHINES.items()}
    # What may raise: one of the operation's own effects or moves.
    steps = sorted({s.effect for s in op.walk() if isinstance(s, Do)} | {f"{r}.{t}" for r, t in op.moves})
    failing = st.none() | st.sampled_from(steps)
    item = st.tuples(
        st.fixed_dictionaries(role_states),
        st.fixed_dictionaries({g: st.booleans() for g in sorted(SPEC.guard_names)}),
        failing,
    )
    return st.lists(item, max_size=6).map(lambda raw: [Item(i, dict(s), dict(g), f) for i, (s, g, f) in enumerate(raw)])


def _copy(items: list[Item]) -> list[Item]:
    return [Item(x.ident, dict(x.states), dict(x.guards), x.raises_in) for x in items]


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("name", sorted(OPS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_batch_moves_each_item_as_running_it_alone_would(name: str, truncate: bool, data: st.DataObject) -> None:
    op = OPS[name]
    items = data.draw(items_strategy(op), label="items")
    alone = _copy(items)
    failed, cut = run_one_by_one(op, alone, truncate)
    batch = run_batched(op, items, truncate)
    assert [x.ident for x, _ in batch.errors] == [x.ident for x in failed] or (
        # Without truncate the batch reports failures step by step, not item by item.
        not truncate and sorted(x.ident for x, _ in batch.errors) == sorted(x.ident for x in failed)
    )
    if truncate:
        assert {x.ident for x in batch.cut} == {x.ident for x in cut if x not in failed}
    never_ran = {x.ident for x in batch.cut}
    for mine, reference in zip(items, alone):
        if mine.ident in never_ran:
            # Cut before the step that stopped the batch: what ran of it
            # ran (both loops stop it there or earlier); nothing after.
            assert reference.log[: len(mine.log)] == mine.log or mine.log[: len(reference.log)] == reference.log
            continue
        assert mine.log == reference.log, (mine, name)
        assert mine.states == reference.states, (mine, name)


def test_truncate_keeps_the_earliest_failure_across_a_when() -> None:
    # Item 1 takes `then` and fails there first; item 0 takes `else` and fails after it. A loop
    # stops at item 0, so item 0 is the error and item 1 is cut, whatever order the parts ran in.
    guards = dict.fromkeys(SPEC.guard_names, False)
    states = {"task": "PENDING", "position": "UNQUEUED", "task_holder": "UNHELD"}
    items = [
        Item(0, dict(states), {**guards, "open_write_accepts": False}, "register_task"),
        Item(1, dict(states), {**guards, "open_write_accepts": True}, "append_chunk"),
    ]
    alone = _copy(items)
    failed, cut = run_one_by_one(OPS["register"], alone, truncate=True)
    batch = run_batched(OPS["register"], items, truncate=True)
    assert [x.ident for x in failed] == [0] and [x.ident for x in cut] == [1]
    assert [x.ident for x, _ in batch.errors] == [0]
    assert [x.ident for x in batch.cut] == [1]


@pytest.mark.parametrize("name", sorted(OPS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_batch_of_one_through_the_runner_ends_as_the_batch_segments_leave_it(name: str, data: st.DataObject) -> None:
    # The runner's fast path (SegmentRunner.run_batch): one item runs the per-instance closures.
    op = OPS[name]
    [item] = data.draw(items_strategy(op).filter(lambda xs: len(xs) == 1), label="item")
    (twin,) = _copy([item])
    reference = run_batched(op, [twin], truncate=True)
    effects, guards = _handlers(op)
    compiled = compile_operation(op, ToyBinding(), effects, guards)
    batch = SegmentRunner().run_batch(compiled, [item], truncate=True)
    assert [(x.ident, type(e), str(e)) for x, e in batch.errors] == [
        (x.ident, type(e), str(e)) for x, e in reference.errors
    ]
    assert [x.ident for x in batch.items] == [x.ident for x in reference.items]
    assert (item.log, item.states) == (twin.log, twin.states)
