"""The bounded exhaustive check of the composed model (``omni-prefix-cache check``).

Small bounds here (seconds); the CI bound runs through ``make check``.
"""

from __future__ import annotations

import pytest

from omni_prefix_cache.cli import main
from omni_prefix_cache.specs import load_spec
from omni_prefix_cache.testing.modelcheck import BROKEN, Bounds, ComposedModel, check
from omni_prefix_cache.testing.mutants import without_move

SMALL = Bounds(requests=1, tasks=2, slots=2, pages=1, steps=2, reads=1, failures=1)
# Two requests so takeover across requests and finish of one are explored.
TWO_REQUESTS = Bounds(requests=2, tasks=2, slots=2, pages=1, steps=2, reads=0, failures=1)

# broken variant -> the invariant it must break
EXPECTED = {
    "escalate-requeues-copying": "composed.queued_not_claimed",
    "done-before-publish": "composed.done_after_record",
    "fail-never-wakes": "composed.can_settle",
    "no-copy-on-write": "composed.copy_on_write",
    "spec-no-drop": "slot_occupancy.declared_moves",
}


def test_every_broken_variant_has_an_expectation() -> None:
    assert set(EXPECTED) == set(BROKEN)


@pytest.mark.parametrize("bounds", [SMALL, TWO_REQUESTS], ids=["one-request", "two-requests"])
def test_real_specs_pass(bounds: Bounds) -> None:
    result = check(bounds)
    assert result.ok, result.report()
    assert result.states > 1000 and result.transitions > result.states
    assert result.depth >= 2 * bounds.steps


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_variant_fails_with_a_readable_trace(name: str) -> None:
    result = check(SMALL, name)
    assert not result.ok
    assert result.violation is not None and result.violation.name == EXPECTED[name]
    report = result.report()
    assert f"VIOLATION {EXPECTED[name]}" in report
    assert all(f"  {i}. " in report for i in range(1, len(result.trace) + 1))


def test_requeue_counterexample_is_shortest() -> None:
    # A task must be saved, claimed by the committer, then escalated: no
    # trace shorter than those three steps can re-queue a COPYING task.
    result = check(SMALL, "escalate-requeues-copying")
    assert len(result.trace) == 3
    assert "save" in result.trace[0] and "claim" in result.trace[1] and "QUEUED->COPYING" in result.trace[1]
    assert "hi=[0]" in result.trace[2]


def test_invariant_violation_is_found_at_its_shallowest_depth() -> None:
    result = check(SMALL, "done-before-publish")
    # BFS: nothing shallower breaks it, so the trace ends where the search did.
    assert len(result.trace) <= result.depth


def test_stuck_state_is_reported_with_what_cannot_settle() -> None:
    result = check(SMALL, "fail-never-wakes")
    assert result.violation is not None
    assert "owes its wakes" in result.violation.message
    assert any("fails" in step for step in result.trace)


def test_component_moves_come_from_the_specs() -> None:
    # The committer claims through the write_task spec: without the claim
    # move the model has nowhere to go and says which move is missing.
    spec = without_move(load_spec("write_task"), "claim_copy", "QUEUED")
    result = check(SMALL, specs={"write_task": spec})
    assert result.violation is not None and result.violation.name == "write_task.declared_moves"
    assert "claim_copy from QUEUED" in result.violation.message


def test_removing_a_holder_release_strands_a_page() -> None:
    spec = without_move(load_spec("staging_holder"), "consume", "HELD")
    result = check(SMALL, specs={"staging_holder": spec})
    assert result.violation is not None and "consume" in result.violation.message


def test_symmetric_slots_add_no_states() -> None:
    few = check(Bounds(requests=1, tasks=1, slots=1, pages=1, steps=1, reads=0))
    many = check(Bounds(requests=1, tasks=1, slots=4, pages=1, steps=1, reads=0))
    assert few.ok and many.ok and few.states == many.states


def test_unknown_broken_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown broken variant"):
        ComposedModel(SMALL, "no-such-bug")


def test_cli_check_passes_and_reports_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--requests", "1", "--tasks", "1", "--steps", "1", "--slots", "2", "--pages", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "states explored:" in out and "max depth:" in out and "OK" in out


def test_cli_check_broken_prints_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--requests", "1", "--tasks", "2", "--steps", "2", "--pages", "1"]
    rc = main([*argv, "--broken", "escalate-requeues-copying"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "shortest counterexample (3 steps):" in out and "  1. " in out


def test_cli_check_gives_up_past_max_states(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--requests", "1", "--tasks", "2", "--steps", "2", "--max-states", "50"])
    assert rc == 3  # the run stopped with an error (2 is a usage error)
    assert "more than 50 states" in capsys.readouterr().err
