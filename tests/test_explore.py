"""The interleaving explorer (testing/explore) and the history checker."""

from __future__ import annotations

import pytest

from omni_prefix_cache.testing.explore.history import Op, check_history, linearizable, stress
from omni_prefix_cache.testing.explore.runner import SCENARIOS, explore, replay
from omni_prefix_cache.testing.explore.strategies import make_token, parse_token
from omni_prefix_cache.tools.cli import EXPLORE_SCENARIOS

# Found by `omni-prefix-cache explore --mutant cow_copy_missed_before_reads_lock` (reuse-read, within
# the first 1,747 schedules since the committer runs its passes as batches): the prefetch thread is
# switched in at its start, then out at its reads-lock acquire.
COW_TOKEN = "x1/reuse-read/cow_copy_missed_before_reads_lock/44:3,46:1"
# Real races of shutdown against the engine and materialize threads, found by `explore --scenario
# shutdown` (on the code before the fix each token replays to the failure its comment names) and
# fixed in the manager: every state-lock segment of a facade call checks the closed flag, and
# new_step_starts starts its prefetches (storing their futures) in the segment that planned them.
SHUTDOWN_RACES = {
    # new_step_starts started a hit's prefetch outside the state lock after shutdown had dropped
    # the read; the refused submit dropped it again.
    "x1/shutdown/-/33:3": "drop is illegal from DROPPED",
    # ... or the prefetch was already fetching when shutdown, not seeing its future yet, dropped
    # it: shutdown itself raised. (The fixed code starts the prefetch under the lock, so this
    # schedule diverges from the token there: it cannot happen any more.)
    "x1/shutdown/-/33:4,35:3": "drop is illegal from FETCHING",
    # shutdown between new_step_starts and save_outputs: the wrong error, not the shutdown error.
    "x1/shutdown/-/35:3": "without a new_step_starts before it",
    # materialize racing shutdown: the step was released under it; not the shutdown error.
    "x1/shutdown/-/61:3": "illegal from CONSUMED",
    # a save that claimed its page before shutdown published its step after it: the page leaked.
    "x1/shutdown/-/71:3": "invariant nothing_leaked: staging pages still held",
}


def test_cli_lists_every_scenario() -> None:
    assert set(EXPLORE_SCENARIOS) == set(SCENARIOS)


def test_token_round_trips() -> None:
    from omni_prefix_cache.testing.explore.scheduler import Decision

    decisions = [Decision(0, (0, 1), 0, 0, False), Decision(1, (0, 2), 0, 2, True), Decision(7, (1, 3), 1, 3, True)]
    token = make_token("reuse-read", "some_mutant", decisions)
    assert token == "x1/reuse-read/some_mutant/1:2,7:3"
    assert parse_token(token) == ("reuse-read", "some_mutant", {1: 2, 7: 3})
    assert parse_token(make_token("shutdown", None, [])) == ("shutdown", None, {})
    with pytest.raises(ValueError, match="not an explore replay token"):
        parse_token("reuse-read/-/1:2")


def test_cow_race_replays_under_the_mutant_only() -> None:
    sched, diverged = replay(COW_TOKEN)
    assert not diverged
    assert sched.failure is not None and sched.failure.reason == "row oracle", sched.failure
    assert "no preserved copy" in sched.failure.message
    clean, diverged = replay(COW_TOKEN.replace("cow_copy_missed_before_reads_lock", "-"))
    assert not diverged and clean.failure is None, clean.failure


def test_explore_finds_a_mutant_by_a_named_invariant_and_its_token_replays() -> None:
    # (done_before_completion_record, used here before the controller rewrite, is not found by this
    # run any more: its moved `task.written` now lands in the controller-lock segment that publishes.)
    report = explore("reuse-read", bound=1, budget=50, mutant="save_skips_previous_write_barrier")
    assert report.found, report.line()
    found = report.found[0]
    assert found.failure.reason == "invariant no_join_under_state_lock_and_save_waits_previous_writes", found.failure
    sched, _ = replay(found.token)
    assert sched.failure is not None and sched.failure.reason == found.failure.reason


def test_a_clean_runtime_passes_a_bounded_exploration() -> None:
    report = explore("copy-failure", bound=1, budget=40)
    assert report.schedules == 40 and not report.found, [f.describe() for f in report.found]
    assert report.states > report.schedules  # several distinct states per schedule


@pytest.mark.parametrize("token", sorted(SHUTDOWN_RACES))
def test_shutdown_race_schedule_replays_clean(token: str) -> None:
    sched, diverged = replay(token)
    assert sched.failure is None, f"{token}: {sched.failure.message} (was: {SHUTDOWN_RACES[token]})"
    # Only the in-flight prefetch's schedule may diverge: its prefetch now starts under the lock.
    assert not diverged or "FETCHING" in SHUTDOWN_RACES[token]


# ---------------------------------------------------------------- history checker


def _op(name: str, key: int, value: object, inv: int, res: int, thread: str = "t") -> Op:
    return Op(thread, name, key, value, inv, res)


def test_history_checker_accepts_overlapping_calls_it_can_order() -> None:
    # materialize overlaps the save that opened its step: it may take effect after it.
    ops = [_op("save", 1, "rows", 0, 3, "engine"), _op("materialize", 1, "rows", 1, 4)]
    assert linearizable(ops)
    assert check_history(ops) == []


def test_history_checker_rejects_a_non_linearizable_history() -> None:
    # Rows served before the save that produced them was even invoked.
    early = [_op("materialize", 1, "rows", 0, 1), _op("save", 1, "rows", 2, 3, "engine")]
    assert not linearizable(early)
    # One step consumed twice with rows, by two materializes.
    twice = [
        _op("save", 2, "rows", 0, 1, "engine"),
        _op("materialize", 2, "rows", 2, 5, "m0"),
        _op("materialize", 2, "rows", 3, 4, "m1"),
    ]
    assert not linearizable(twice)
    # Wrong rows served.
    wrong = [_op("save", 3, "rows", 0, 1, "engine"), _op("materialize", 3, "other rows", 2, 3)]
    assert check_history(early + twice + wrong) == [1, 2, 3]


def test_short_free_running_stress_is_linearizable() -> None:
    result = stress(2.0, materializers=2)
    assert result.ops > 20, result
    assert result.ok, (result.bad_keys, result.errors[:3])


def test_pct_finds_the_escalate_race_and_its_token_replays() -> None:
    report = explore("escalate-copying", strategy="pct", bound=3, budget=200, mutant="escalate_requeues_claimed")
    assert report.found, report.line()
    assert report.found[0].failure.reason == "invariant write_task.single_copy_claim"
    sched, diverged = replay(report.found[0].token)
    assert not diverged and sched.failure is not None and sched.failure.reason == report.found[0].failure.reason
