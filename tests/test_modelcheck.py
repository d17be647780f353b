"""The bounded exhaustive check of the composition spec (``omni-prefix-cache check``).

Two worlds: the write path and the request lifecycle. Small bounds here (seconds), and the CI
bound once; ``make test`` runs the CI bound too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_prefix_cache.specs import SpecError, load_spec
from omni_prefix_cache.specs.composition import load_protocol
from omni_prefix_cache.testing.modelcheck import BROKEN, CI_BOUNDS, Bounds, ComposedModel, check
from omni_prefix_cache.testing.modelcheck.life_model import ENV_ACTIONS
from omni_prefix_cache.testing.modelcheck.life_world import LifeBounds
from omni_prefix_cache.testing.modelcheck.scope import SCOPES, uncovered
from omni_prefix_cache.testing.mutants import without_move
from omni_prefix_cache.tools.cli import main

SMALL = Bounds(requests=1, tasks=2, slots=2, pages=1, steps=2, reads=1, failures=1)
# Two requests so takeover across requests is explored.
TWO_REQUESTS = Bounds(requests=2, tasks=2, slots=2, pages=1, steps=2, reads=0, failures=1)
SMALL_ARGV = ["check", "--requests", "1", "--tasks", "2", "--slots", "2", "--pages", "1", "--steps", "2", "--quiet"]


def _op(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(o for o in data["operations"] if o["name"] == name)


def _steps_are_operations(trace: list[str]) -> None:
    """Each step names a protocol operation (and segments), as a reader of the spec knows them."""
    ops = set(load_protocol().ops)
    for step in trace:
        if step.startswith("("):  # the lifecycle's environment: the scheduler, a consumer
            assert any(action.split("_")[0] in step for action in ENV_ACTIONS), step
            continue
        head = re.match(r"(\w+)(\[[\d-]+\])?\(", step)
        assert head is not None and head.group(1) in ops, step


def test_every_mutation_expects_an_invariant_the_model_checks() -> None:
    model_invariants = set(load_protocol().invariants_for("model"))
    machine_invariants = {f"{m.name}.{i.name}" for m in load_protocol().components.values() for i in m.invariants}
    for name, mutation in BROKEN.items():
        assert mutation.invariant in model_invariants | machine_invariants, name


def test_the_shipped_spec_passes_at_the_ci_bound() -> None:
    result = check(CI_BOUNDS)
    assert result.ok, result.report()
    assert result.states > 70_000 and result.transitions > result.states
    assert [p.model for p in result.parts] == ["write path", "lifecycle"]
    assert all(p.states > 20_000 for p in result.parts)


@pytest.mark.parametrize("bounds", [SMALL, TWO_REQUESTS], ids=["one-request", "two-requests"])
def test_the_shipped_spec_passes_at_small_bounds(bounds: Bounds) -> None:
    result = check(bounds, models=["write"])
    assert result.ok, result.report()
    assert result.states > 1000 and result.transitions > result.states
    assert result.depth >= 2 * bounds.steps


def test_a_new_tenant_resets_the_keys_it_does_not_write() -> None:
    # Two keys: a step that leaves the mm key out resets it (slot tenancy); the shipped spec keeps no stale rows.
    result = check(
        Bounds(requests=1, tasks=2, slots=1, pages=1, steps=2, reads=1, failures=1, keys=2), models=["write"]
    )
    assert result.ok, result.report()
    assert result.states > 1000


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_every_spec_mutation_is_found_with_a_shortest_trace(name: str) -> None:
    result = check(SMALL, name)
    expected = BROKEN[name].invariant
    assert result.violation is not None and result.violation.name == expected, result.report()
    assert result.trace
    _steps_are_operations(result.trace)
    report = result.report()
    assert f"VIOLATION {expected}" in report
    assert all(f"  {i}. " in report for i in range(1, len(result.trace) + 1))
    # BFS: the violation is found at its shallowest depth.
    assert len(result.trace) <= result.depth + 1


def test_split_claim_counterexample_is_save_then_the_first_half_of_the_claim() -> None:
    result = check(SMALL, "split-claim")
    assert [step.split("  =>")[0] for step in result.trace][-1] == "committer_claim[0](task 0)"
    # The save queues the write without a wake; the committer's linger wakes it (no new_step follows).
    assert all(step.startswith(("save[", "linger(")) for step in result.trace[:-1])
    assert "QUEUED at queue position CLAIMED" in result.violation.message  # type: ignore[union-attr]


def test_stuck_state_is_reported_with_what_cannot_settle() -> None:
    result = check(SMALL, "fail-never-wakes")
    assert result.violation is not None
    assert "owes its wakes" in result.violation.message
    assert any(step.startswith("fail[") for step in result.trace)


def test_a_claim_of_a_task_failed_on_another_thread_is_a_protocol_violation_when_required() -> None:
    # The shipped committer_claim pops such a task unclaimed (task.claim_copy?); requiring the
    # claim makes the race of fail's first segment with the pop a protocol violation.
    def require(data: dict[str, Any]) -> None:
        _op(data, "committer_claim")["segments"][0]["steps"][0]["first_of"][0][1] = "task.claim_copy"

    result = check(SMALL, protocol=load_protocol().mutated(require))
    assert result.violation is not None and result.violation.name == "protocol.required_move"
    assert "committer_claim (claim): task.claim_copy is not enabled" in result.violation.message
    assert result.trace[-2].startswith("fail[0](task 0)")


def test_component_moves_come_from_the_specs() -> None:
    # Without the claim_copy move the committer pops a task it cannot claim.
    spec = without_move(load_spec("write_task"), "claim_copy", "QUEUED")
    result = check(SMALL, specs={"write_task": spec})
    assert result.violation is not None and result.violation.name == "position_matches_task"


def test_removing_a_holder_release_is_a_protocol_violation() -> None:
    spec = without_move(load_spec("staging_holder"), "consume", "HELD")
    result = check(SMALL, specs={"staging_holder": spec})
    assert result.violation is not None and result.violation.name == "protocol.required_move"
    assert "step_holder.consume is not enabled" in result.violation.message


def test_symmetric_slots_add_no_states() -> None:
    few = check(Bounds(requests=1, tasks=1, slots=1, pages=1, steps=1, reads=0), models=["write"])
    many = check(Bounds(requests=1, tasks=1, slots=4, pages=1, steps=1, reads=0), models=["write"])
    assert few.ok and many.ok and few.states == many.states


def test_the_model_refuses_a_protocol_invariant_it_cannot_check() -> None:
    def add(data: dict[str, Any]) -> None:
        data["invariants"].append({"name": "mystery", "meaning": "no checker for this", "checked_by": ["model"]})

    with pytest.raises(SpecError, match=r"without a checker: \['mystery'\]"):
        ComposedModel(SMALL, protocol=load_protocol().mutated(add))

    def drop(data: dict[str, Any]) -> None:
        data["invariants"] = [i for i in data["invariants"] if i["name"] != "staged_bytes"]

    with pytest.raises(SpecError, match=r"checkers with no declared name: \['staged_bytes'\]"):
        ComposedModel(SMALL, protocol=load_protocol().mutated(drop))


def test_unknown_broken_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown broken variant"):
        ComposedModel(SMALL, "no-such-bug")


def test_cli_check_passes_and_reports_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "check",
            "--requests",
            "1",
            "--tasks",
            "1",
            "--steps",
            "1",
            "--slots",
            "2",
            "--pages",
            "1",
            "--life-steps",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "states explored:" in out and "max depth:" in out and "OK" in out


def test_cli_check_broken_prints_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*SMALL_ARGV, "--broken", "escalate-requeues-copying"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "VIOLATION position_matches_task" in out and "shortest counterexample (" in out
    assert re.search(r"  \d+\. escalate\(task 0\)  =>  ", out)


def test_cli_check_runs_a_mutation_kept_as_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(yaml.safe_dump(dict(load_protocol().raw)))  # a deep copy
    write = _op(data, "committer_write")["segments"]
    write[1]["steps"].remove({"do": "publish_completed"})
    write.append({"name": "publish_late", "lock": "controller", "steps": [{"do": "publish_completed"}]})
    path = tmp_path / "done_first.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = main([*SMALL_ARGV, "--broken", str(path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "VIOLATION done_after_record" in out and "committer_write[" in out
    path.write_text("name: protocol\ncomponents: {}\n")
    assert main([*SMALL_ARGV, "--broken", str(path)]) == 2
    assert "does not load" in capsys.readouterr().err


def test_cli_check_gives_up_past_max_states(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--requests", "1", "--tasks", "2", "--steps", "2", "--max-states", "50"])
    assert rc == 3  # the run stopped with an error (2 is a usage error)
    assert "more than 50 states" in capsys.readouterr().err


# ------------------------------------------------------------------ the request lifecycle


def test_the_lifecycle_passes_with_one_consumer_and_a_longer_run() -> None:
    # One consumer (no symmetry to lean on), a fourth step: resume, replacement and id reuse meet.
    result = check(Bounds(life=LifeBounds(steps=4, consumers=1)), models=["lifecycle"])
    assert result.ok, result.report()
    assert result.states > 20_000 and result.depth >= 20


@pytest.mark.parametrize("name", sorted(n for n, m in BROKEN.items() if m.model == "lifecycle"))
def test_every_lifecycle_mutation_is_found_in_the_lifecycle_world(name: str) -> None:
    result = check(SMALL, name)
    assert result.violation is not None and result.violation.name == BROKEN[name].invariant, result.report()
    assert result.model == "lifecycle" and [p.model for p in result.parts] == ["lifecycle"]
    assert "VIOLATION " + BROKEN[name].invariant + " (lifecycle model)" in result.report()


def test_the_lifecycle_mutations_kill_every_lifecycle_invariant_but_one() -> None:
    # can_settle holds in every mutant here: it is still checked in every state.
    killed = {BROKEN[n].invariant for n in BROKEN if BROKEN[n].model == "lifecycle"}
    assert killed == {
        "gap_raises",
        "resumed_hit_recovers",
        "old_owner_never_moves_current",
        "discard_is_not_delivery",
        "at_most_once_in_order",
        "delivered_within_saved",
        "accepted_rows_only",
    }


def test_a_view_of_an_output_edited_past_what_was_saved_is_a_counterexample_when_not_refused() -> None:
    result = check(SMALL, "view-past-saved")
    assert any("edited to reach one position further" in step for step in result.trace)
    assert "delivered up to" in result.violation.message  # type: ignore[union-attr]


def test_a_view_acknowledged_twice_is_a_counterexample_when_acknowledging_does_not_spend_it() -> None:
    result = check(SMALL, "ack-keeps-view")
    assert any("keeping the view" in step for step in result.trace)
    assert "having received" in result.violation.message  # type: ignore[union-attr]


def test_the_hostile_consumer_is_refused_in_every_state_of_the_shipped_protocol() -> None:
    # Without hostile calls the world is the pre-issue-39 one; with them every refusal holds.
    calm = check(Bounds(life=LifeBounds(hostile=0, steps=2)), models=["lifecycle"])
    hostile = check(Bounds(life=LifeBounds(hostile=1, steps=2)), models=["lifecycle"])
    assert calm.ok and hostile.ok and hostile.states > calm.states


def test_a_resume_without_its_lookup_loses_the_slow_consumers_positions() -> None:
    result = check(SMALL, "resume-without-lookup")
    steps = [step.split("  =>")[0] for step in result.trace]
    assert "(scheduler) preempt the request" in steps
    assert any("RESUMED" in step for step in result.trace)
    assert "slowest consumer was at 0" in result.violation.message  # type: ignore[union-attr]


def test_a_late_event_of_an_older_owner_is_a_counterexample_when_not_ignored() -> None:
    result = check(SMALL, "older-owner-events-apply")
    assert any("REPLACED" in step for step in result.trace)
    assert "event of older owner (1, 1)" in result.violation.message  # type: ignore[union-attr]


def test_the_lifecycle_moves_come_from_the_specs() -> None:
    # Without ack from OPEN, ack_delivery's required move is refused: the model runs the machine's table.
    spec = without_move(load_spec("delivery"), "ack", "OPEN")
    result = check(SMALL, specs={"delivery": spec}, models=["lifecycle"])
    assert result.violation is not None and result.violation.name == "protocol.required_move"
    assert "delivery.ack is not enabled" in result.violation.message


def _when(steps: list[Any], guard: str) -> Any:
    return next(s for s in steps if isinstance(s, dict) and s.get("when") == guard)


def test_no_step_of_an_operation_the_models_run_is_left_unread() -> None:
    assert uncovered(load_protocol(), SCOPES) == []

    def ack_in(op: str, where: Any) -> Any:
        def patch(data: dict[str, Any]) -> None:
            where(_op(data, op)["segments"]).append("delivery.ack?")

        return load_protocol().mutated(patch)

    # An operation only the write path runs: a delivery move there would be read by no model.
    in_write = ack_in("committer_write", lambda segs: segs[1]["steps"])
    expected = "committer_write: delivery.ack? (read by no model that runs committer_write)"
    assert uncovered(in_write, SCOPES) == [expected]
    with pytest.raises(SpecError, match="silently ignore"):
        ComposedModel(SMALL, protocol=in_write)
    # A branch the lifecycle model assumes never taken (a refused plan), where the write path reads no delivery.
    in_refused_plan = ack_in("new_step", lambda segs: _when(segs[2]["steps"], "rows_planned")["else"])
    assert uncovered(in_refused_plan, SCOPES) == ["new_step: delivery.ack? (read by no model that runs new_step)"]
    # Where the lifecycle reads it, the same move is a counterexample instead.
    assert uncovered(ack_in("discard", lambda segs: segs[0]["steps"]), SCOPES) == []


def test_cli_check_lifecycle_broken_prints_its_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--model", "lifecycle", "--quiet", "--broken", "commit-without-filter"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "VIOLATION old_owner_never_moves_current (lifecycle model)" in out
    assert re.search(r"  \d+\. commit_output\(consumer 0, output 0\)  =>  breaks", out)
