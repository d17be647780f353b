"""The composition spec (spec/protocol.yaml): loading, validation, compiling."""

from __future__ import annotations

from typing import Any

import pytest

from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition import (
    ProtocolViolation,
    compile_operation,
    compile_protocol,
    load_protocol,
    parse_protocol,
)
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.specs.runner import CALLER_HOLDS, SegmentRunner


class _Recorder:
    """A binding that records each step and enables moves from a set."""

    def __init__(self, enabled: set[str] | None = None) -> None:
        self.enabled = enabled
        self.log: list[str] = []

    def move(self, role: str, trigger: str) -> tuple[Any, Any]:
        name = f"{role}.{trigger}"
        return (lambda ctx: self.enabled is None or name in self.enabled), (lambda ctx: self.log.append(name))

    def coupling(self, role: str, name: str) -> Any:
        return lambda ctx: self.log.append(f"{role}.{name}")


def _handlers(rec: _Recorder, true: frozenset[str] = frozenset()) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = load_protocol()
    effects = {e: (lambda ctx, e=e: rec.log.append(e)) for e in spec.effect_names}
    guards = {g: (lambda ctx, g=g: g in true) for g in spec.guard_names}
    return effects, guards


def _mutate(patch: Any) -> Any:
    return load_protocol().mutated(patch)


def test_the_shipped_protocol_loads_and_keeps_its_ordering_rules() -> None:
    spec = load_protocol()
    assert spec.ordering_violations() == []
    assert {"save", "materialize", "discard", "escalate", "committer_claim", "join", "fail", "shutdown"} <= set(
        spec.ops
    )


def test_every_operation_compiles_and_runs_its_steps_in_spec_order() -> None:
    rec = _Recorder()
    ops = compile_protocol(load_protocol(), rec, *_handlers(rec))
    for seg in ops["committer_write"].segments:
        seg(None)
    assert rec.log == ["pool_write", "task_holder.written", "publish_completed", "position.written", "task.written"]


def test_first_of_runs_the_first_alternative_whose_move_is_enabled() -> None:
    rec = _Recorder(enabled={"position.promote"})
    op = compile_operation(load_protocol().ops["escalate"], rec, *_handlers(rec))
    CALLER_HOLDS.run_all(op, None)
    assert rec.log == ["position.promote"]
    rec2 = _Recorder(enabled=set())
    CALLER_HOLDS.run_all(compile_operation(load_protocol().ops["escalate"], rec2, *_handlers(rec2)), None)
    assert rec2.log == []


def test_a_required_move_that_is_not_enabled_is_a_protocol_violation() -> None:
    rec = _Recorder(enabled=set())
    op = compile_operation(load_protocol().ops["committer_copy"], rec, *_handlers(rec))
    with pytest.raises(ProtocolViolation, match=r"committer_copy \(copy\): task.host_ready is not enabled"):
        op.segments[0](None)


def test_the_entry_move_admits_an_instance() -> None:
    rec = _Recorder(enabled=set())
    assert CALLER_HOLDS.run_all(compile_operation(load_protocol().ops["fail"], rec, *_handlers(rec)), None) is False
    assert rec.log == []


def test_optional_moves_fire_only_where_enabled() -> None:
    rec = _Recorder(enabled={"task.written", "position.written"})
    op = compile_operation(load_protocol().ops["committer_write"], rec, *_handlers(rec))
    for seg in op.segments:
        seg(None)
    assert "task_holder.written" not in rec.log


def test_a_mutation_that_breaks_an_ordering_rule_is_reported_not_hidden() -> None:
    def swap(data: dict[str, Any]) -> None:
        op = next(o for o in data["operations"] if o["name"] == "committer_write")
        op["segments"][1]["steps"].remove({"do": "publish_completed"})
        op["segments"][2]["steps"].append({"do": "publish_completed"})

    mutant = _mutate(swap)
    assert any(v.startswith("release_publish_done") for v in mutant.ordering_violations())
    with pytest.raises(SpecError, match="release_publish_done"):
        load_protocol().mutated(swap, check_orderings=True)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (lambda d: d["operations"][0]["segments"][0]["steps"].append("task.teleport"), "no trigger 'teleport'"),
        (lambda d: d["operations"][0]["segments"][0]["steps"].append({"do": "nope"}), "undeclared effect 'nope'"),
        (lambda d: d["operations"][0]["segments"][0]["steps"].append("ghost.save"), "unknown role 'ghost'"),
        (lambda d: d["operations"][0]["segments"][0].update(lock="global"), "needs 'name', 'lock'"),
        (lambda d: d["operations"][0]["segments"][0].pop("name"), r"segment #0: needs a 'name'"),
        (
            lambda d: d["operations"][0]["segments"][1].update(name=d["operations"][0]["segments"][0]["name"]),
            r"segment names \['events'\] are used twice",
        ),
        (
            lambda d: d["executors"][0]["effects"].remove("wake_committer"),
            r"effects no executor runs: \['wake_committer'\]",
        ),
        (lambda d: d["executors"][1]["effects"].append("wake_committer"), "'wake_committer' is already executor"),
        (lambda d: d["executors"][0]["roles"].append("ghost"), r"unknown roles \['ghost'\]"),
        (
            lambda d: [ex["roles"].remove("request") for ex in d["executors"] if "request" in ex["roles"]],
            "roles no executor moves",
        ),
        (lambda d: d["pairs"].pop("STALE"), "must list every copy_queue state"),
        (
            lambda d: d["operations"].remove(next(o for o in d["operations"] if o["name"] == "abandon_save")),
            "abandon'] are fired by no operation",
        ),
    ],
)
def test_malformed_compositions_are_refused_with_the_item_named(patch: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        _mutate(patch)


def test_a_handler_missing_for_a_declared_effect_fails_at_compile_time() -> None:
    rec = _Recorder()
    effects, guards = _handlers(rec)
    del effects["publish_completed"]
    with pytest.raises(SpecError, match="publish_completed"):
        compile_operation(load_protocol().ops["committer_write"], rec, effects, guards)


def test_parse_refuses_unknown_top_level_fields() -> None:
    data = dict(load_protocol().raw)
    data["extra"] = 1
    with pytest.raises(SpecError, match="unknown fields"):
        parse_protocol(data)


def test_the_swimlane_lists_an_operations_steps_in_order_under_their_locks() -> None:
    from omni_prefix_cache.specs.composition_diagrams import swimlane_label

    spec = load_protocol()
    label = swimlane_label(spec.ops["committer_write"], spec)
    marks = ["lock none", "pool_write", "lock controller", "written?", "publish_completed", "lock task"]
    where = [label.index(m) for m in marks]
    assert where == sorted(where)
    assert "<b>written</b>" in label[where[-1] :]  # task.written, in the last segment
    assert "order release_publish_done" in label
    mutated = spec.mutated(lambda d: d["operations"][0]["segments"][0].update(lock="controller"))
    assert "under lock controller" in swimlane_label(mutated.ops[spec.operations[0].name], mutated)


def test_a_segment_run_alone_and_a_range_from_it_keep_their_own_plans() -> None:
    rec = _Recorder()
    op = compile_operation(load_protocol().ops["committer_write"], rec, *_handlers(rec))
    runner = SegmentRunner()
    runner.run_segment_batch(op, "publish", Batch([None]))
    assert rec.log == ["task_holder.written", "publish_completed", "position.written"]
    rec.log.clear()
    runner.run_batch(op, [None], start="publish")  # publish, then done
    assert rec.log == ["task_holder.written", "publish_completed", "position.written", "task.written"]
    rec.log.clear()
    runner.run_segment_batch(op, "publish", Batch([None]))
    assert rec.log == ["task_holder.written", "publish_completed", "position.written"]
