"""Tests generated from the composition spec (spec/protocol.yaml), run against
the real manager and controller (see omni_prefix_cache.testing.protocol_tests).

One rule per driver of the spec's operations, one invariant per protocol
invariant the tests check, plus the row oracle. Two modes: eager (writes run
inline) and manual (the committer moves only when a rule or a join steps it).

Replaying a failure: the ci profile is derandomized, so rerunning the same
command replays it; Hypothesis also prints the shrunk rule trace and a
``@reproduce_failure`` blob (print_blob) to paste above the test class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from omni_prefix_cache.specs.composition import load_protocol
from omni_prefix_cache.specs.loader import SpecError
from omni_prefix_cache.testing import protocol_tests
from omni_prefix_cache.testing.protocol_tests import (
    build_machine,
    checks,
    consumers,
    invariant_table,
    life_drivers,
    rule_table,
)
from omni_prefix_cache.testing.protocol_tests import machine as protocol_machine


class _Script:
    """Stands in for Hypothesis' ``data`` in a replayed trace: a draw returns
    the recorded value for its label, else the trace's default for it."""

    DEFAULTS = {"arrivals": 0, "keys as leftovers": (), "forward, then save at once": 1}

    def __init__(self, *sequence: tuple[str, object], **draws: object) -> None:
        self.sequence = list(sequence)  # (label, value) draws taken in order, for repeated labels
        self.draws = draws

    def draw(self, strategy: object, label: str) -> object:
        for i, (name, value) in enumerate(self.sequence):
            if name == label:
                del self.sequence[i]
                return value
        if label in self.draws:
            return self.draws.pop(label)
        if label.startswith(("admit", "run")):
            return 6 if label.startswith("admit") else 3
        if label.startswith(("drafts", "accepted")):
            return 0  # plain decoding unless the trace drafts
        return self.DEFAULTS[label]


def _quiet_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis's ``event`` outside a Hypothesis run: a no-op."""
    for module in (protocol_machine, checks, life_drivers, consumers):
        monkeypatch.setattr(module, "event", lambda *a, **k: None)


@contextlib.contextmanager
def _replayed(monkeypatch: pytest.MonkeyPatch, *, eager: bool) -> Iterator[Any]:
    """A generated machine for replaying a trace by hand, outside Hypothesis;
    torn down however the trace ends."""
    _quiet_events(monkeypatch)
    machine = build_machine(eager=eager)()
    try:
        yield machine
    finally:
        machine.teardown()


def _check_invariants(machine: Any) -> None:
    """Every invariant of the composition the tests check, on ``machine`` now."""
    for name in invariant_table(load_protocol()):
        getattr(machine.checks, name)()


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_resumed_request_rewrites_rows_its_open_write_lost(eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules: q0 opens a deferred write on
    # two blocks; it is preempted, an interim tenant takes the last freed
    # block for one step and aborts, q0 resumes onto it. The rewrite must go
    # to a new write, not be appended to the one that lost those slots
    # (mutant tombstone_drops_fresh_rows: the pool keeps stale rows).
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[2], recent_first=True)
        first = machine.drive_new_step(_Script(**{"admit q0": 4}))
        machine.drive_materialize(first)
        machine.checks.rows_match_reference()
        script = _Script(**{"preempt": "q0", "tenant prefix": 0, "admit q1": 2})
        for sid in machine.drive_interim_tenant(script):
            machine.drive_materialize(sid)
        machine.checks.rows_match_reference()
        machine.model.end("q0")
        machine.drive_drain()  # announces the finish: q0's writes are escalated
        while not eager and machine._committer_unit():
            pass
        machine.drive_drain()  # publishes them
        assert machine.model.cached_blocks(), "the trace no longer leaves cached blocks to check"
        _check_invariants(machine)


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_same_step_hit_on_a_reused_block_gets_this_steps_rows(eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules (the racing test's fuzz trace,
    # seed 1520363339): q1 is preempted, so its blocks go back to the
    # recent-first allocator; the next step admits identical prompts whose
    # prefix hit lands on a block that very step reallocates. The hit must be
    # re-planned against this step's rows (mutant reused_block_hit_not_replanned).
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[2, 0], recent_first=True)
        s0 = machine.drive_new_step(_Script(**{"admit q0": 1, "admit q1": 3}))
        machine.drive_materialize(s0)
        s1 = machine.drive_new_step(_Script(**{"run q0": 1, "run q1": 1}))
        machine.drive_materialize(s1)
        machine.checks.rows_match_reference()
        for _ in range(3):
            machine.model.arrive(0, [])
        machine.drive_preempt(_Script(preempt="q1"))
        for _ in range(2):
            machine.model.arrive(0, [])
        admits = {"admit q1": 2, **{f"admit q{i}": 1 for i in range(2, 7)}}
        s2 = machine.drive_new_step(_Script(**{"run q0": 1, **admits}))
        assert s2 is not None, "the trace no longer reaches its third step"
        machine.drive_materialize(s2)
        machine.checks.rows_match_reference()


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_paused_prefetch_reads_preserved_rows_of_reused_slots(eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules: q1 hits q0's cached blocks;
    # its prefetch pauses at its version check; q1 aborts and a new tenant
    # reuses those blocks; the prefetch resumes and must serve the preserved
    # copies (mutant cow_copy_missed_before_reads_lock).
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[0], recent_first=True)
        machine.drive_materialize(machine.drive_new_step(_Script(**{"admit q0": 4})))
        machine.model.end("q0")
        machine.drive_drain()
        while not eager and machine._committer_unit():
            pass
        machine.drive_drain()
        machine.model.arrive(0, [23])
        s1 = machine.drive_new_step(_Script(**{"admit q1": 1}))
        assert machine.prefetch.pending, "the trace no longer plans a prefetch"
        machine.drive_prefetch_pause()
        assert machine.paused is not None, "the prefetch did not reach its version check"
        machine.drive_paused_reader_slots_reused(2, _Script())
        machine.drive_prefetch_resume()
        machine.checks.rows_match_reference()
        machine.drive_discard(s1)


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_replaced_request_hands_its_unconsumed_output_off(eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules: four requests save one step
    # (not yet materialized); q0 is REPLACED and q1 preempted and RESUMED in
    # the next step; then the first step is materialized and the talker
    # commits it. q0's old tenure is retired, so its output is handed off and
    # no watermark of it moves (mutant commit_keeps_retired). The generated
    # machine finds this at random; its draws depend on how many write tasks a
    # step registers, so the trace is kept here, independent of that.
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[0, 0], recent_first=False)
        arrivals = [("prefix", 0), ("tail", []), ("pair", False)] * 2
        admits = {f"admit q{i}": 1 for i in range(4)}
        first = machine.drive_new_step(_Script(*arrivals, arrivals=2, **admits))
        assert first is not None, "the trace no longer saves its first step"
        machine.drive_replace(_Script(replace="q0", prefix=0))
        machine.drive_resume(_Script(**{"preempt": "q1", "run q2": 1, "run q3": 1, "admit q1": 1}))
        machine.drive_materialize(first, _Script(talker="commit", **{"client lag": 1}))
        _check_invariants(machine)


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_lagging_ack_moves_the_tenure_its_output_was_saved_under(
    eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trace of the generated machine's rules (kept for the reason above): q1's
    # first step is materialized, the talker acknowledges it and the client lags;
    # q1 is REPLACED and the next step starts its new tenure; the client then
    # acknowledges the old output. The ack moves the old tenure's watermark, not
    # the new one's (mutant ack_resolves_tenure_by_id).
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[0, 0], recent_first=False)
        machine.drive_drain()
        machine.drive_finish_or_abort("abort", _Script(abort="q0"))
        arrival = [("prefix", 0), ("tail", []), ("pair", False)]
        first = machine.drive_new_step(_Script(*arrival, arrivals=1, **{"admit q1": 1, "admit q2": 1}))
        assert first is not None, "the trace no longer saves its first step"
        machine.drive_materialize(first, _Script(talker="ack", **{"client lag": 1}))
        machine.drive_replace(_Script(replace="q1", prefix=0))
        script = _Script(**{"run q2": 1, "admit q1": 1, "forward, then save at once": 0})
        machine.drive_new_step(script)
        assert machine.desk.inbox, "the trace no longer leaves the client an output"
        machine.drive_client(_Script(**{"client order": 0, "client": "ack"}))
        _check_invariants(machine)


@pytest.mark.parametrize("eager", [False, True], ids=["manual", "eager"])
def test_a_discarded_step_moves_no_watermark(eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules (kept for the reason above): a
    # step is saved, materialized and acknowledged by both consumers; q0 is
    # preempted for an interim tenant and resumed; the last step is discarded.
    # A discard delivers nothing (mutant discard_counts_as_delivery).
    with _replayed(monkeypatch, eager=eager) as machine:
        machine.first_arrivals(prefixes=[0, 0], recent_first=True)
        machine.drive_submit_queued(0)
        arrival = [("prefix", 0), ("tail", []), ("pair", False)]
        admits = {"admit q0": 1, "admit q1": 1, "admit q2": 1, "forward, then save at once": 0}
        machine.drive_new_step(_Script(*arrival, arrivals=1, **admits))
        first = machine.drive_save()
        assert first is not None, "the trace no longer saves its first step"
        machine.drive_materialize(first, _Script(talker="ack", client="ack", **{"client lag": 0}))
        runs = [("keys as leftovers", ()), ("run q1", 1), ("run q2", 1)]
        script = _Script(*runs, *runs, **{"preempt": "q0", "tenant prefix": 0, "admit q3": 1, "admit q0": 1})
        steps = machine.drive_interim_tenant(script)
        assert len(steps) == 2, "the trace no longer saves two interim steps"
        machine.drive_discard(steps[1])
        _check_invariants(machine)


def test_a_failed_pool_write_is_charged_to_its_own_task(monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace of the generated machine's rules (kept for the reason above): q0's
    # step registers its immediate write and a pending deferred write; the
    # immediate write's pool write fails. The failure is that write's, never the
    # other open task's (mutant pool_write_failure_wrong_task).
    with _replayed(monkeypatch, eager=False) as machine:
        machine.first_arrivals(prefixes=[0], recent_first=False)
        first = machine.drive_new_step(_Script(**{"admit q0": 2}))
        assert first is not None, "the trace no longer saves its first step"
        immediate = machine.mgr.components.ledger.previous_step_writes
        others = [
            t for t, task in machine.ctrl.parts.registry.tasks.items() if t not in immediate and not task.is_terminal
        ]
        assert len(immediate) == 1 and others, "the trace no longer leaves a second open task"
        machine.drive_inject_failure("write", _Script(**{"fail write": immediate[0]}))
        while machine._committer_unit():
            pass
        machine.drive_materialize(first)
        _check_invariants(machine)


def test_a_resumed_request_remapping_a_hit_slot_keeps_the_hit_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # A trace the fuzzer found (ManualProtocolMachine, seed 1958410380): q0's
    # deferred rows [0, 4) are still in its open JOIN_ON_FINISH write when q0 is
    # preempted; tenant q3 hits them (blocks 7, 6) and aborts; q0 resumes with no
    # hit onto block 6 and its same write maps slot 12 again with position 0's
    # row. q3's read, planned before that, must still get position 2's row
    # (row oracle), not the write's newer chunk row for the slot.
    with _replayed(monkeypatch, eager=False) as machine:
        machine.first_arrivals(prefixes=[2, 0, 0], recent_first=True)
        first = machine.drive_new_step(_Script(**{"admit q0": 4, "admit q1": 1, "admit q2": 1}))
        machine.drive_discard(first)
        machine.drive_preempt(_Script(preempt="q1"))
        steps = machine.drive_interim_tenant(
            _Script(
                ("run q2", 1),
                ("run q2", 1),
                **{"preempt": "q0", "tenant prefix": 2, "admit q3": 1, "admit q0": 1},
            )
        )
        assert len(steps) == 2, "the trace no longer saves the tenant's step and the resume"
        assert machine.model.requests["q0"].blocks == [6], "q0 no longer resumes onto the hit's block"
        machine.drive_materialize(steps[0], _Script(talker="ack", **{"client lag": 1}))
        _check_invariants(machine)


# About 20 s per mode alone on 2 cores.
_budget = settings(settings.default, max_examples=max(120, settings.default.max_examples), stateful_step_count=40)

ManualProtocolMachine = build_machine(eager=False)
EagerProtocolMachine = build_machine(eager=True)
TestProtocolManualCommitter = ManualProtocolMachine.TestCase
TestProtocolManualCommitter.settings = _budget
TestProtocolEager = EagerProtocolMachine.TestCase
TestProtocolEager.settings = _budget


def test_every_operation_has_a_driver_and_every_tests_invariant_a_checker() -> None:
    spec = load_protocol()
    ops = rule_table(spec)
    assert set(ops) == set(spec.ops)
    for name in {r for r in ops.values() if r != "teardown"}:
        assert hasattr(getattr(ManualProtocolMachine, name), "hypothesis_stateful_rule"), name
    assert set(invariant_table(spec)) == set(spec.invariants_for("tests"))


def test_an_operation_without_a_driver_is_a_build_time_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(protocol_tests.DRIVERS, "committer_copy")
    with pytest.raises(SpecError, match="committer_copy"):
        build_machine(eager=False)


def test_an_invariant_without_a_checker_is_a_build_time_error() -> None:
    def add(data: dict) -> None:
        data["invariants"].append({"name": "brand_new_rule", "meaning": "x", "checked_by": ["tests"]})

    with pytest.raises(SpecError, match="brand_new_rule"):
        build_machine(load_protocol().mutated(add), eager=True)
