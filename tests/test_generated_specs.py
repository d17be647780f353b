"""Hypothesis state machines generated from spec/*.yaml.

Every spec is played against a generic interpreter of its compiled table
and against its real runtime object (WriteTask, StagingBufferPool,
SlotOccupancy, the manager's step contexts, PlannedReads, CopyQueues, the request table's tenures and
their delivery watermarks). Each generated machine is also
shown to fail on a runtime with one declared move removed or one declared
effect ignored, and a spec edit changes the generated rules with no test
edit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import omni_prefix_cache.reads.planned_read as planned_read_mod
import omni_prefix_cache.requests.lifecycle as lifecycle_mod
import omni_prefix_cache.steps.slot_occupancy as occupancy_mod
import omni_prefix_cache.steps.step_context as step_context_mod
import omni_prefix_cache.tier.store as tier_store_mod
import omni_prefix_cache.writes.copy_queues as copy_queues_mod
import omni_prefix_cache.writes.staging as staging_mod
import omni_prefix_cache.writes.write_task as write_task_mod
from omni_prefix_cache.specs import SpecError, load_spec, parse_spec, spec_names
from omni_prefix_cache.specs.compiled import CompiledMachine
from omni_prefix_cache.testing.adapters import (
    CopyQueueAdapter,
    DeliveryAdapter,
    HostTierAdapter,
    PlannedReadAdapter,
    RequestLifecycleAdapter,
    SlotOccupancyAdapter,
    StagingHolderAdapter,
    StepContextAdapter,
    WriteTaskAdapter,
)
from omni_prefix_cache.testing.interpreter import InterpreterAdapter
from omni_prefix_cache.testing.mutants import recompile, single_moves, spec_to_dict, with_move, without_move
from omni_prefix_cache.testing.specfacts import states_after
from omni_prefix_cache.testing.stateful import SpecAdapter, build_machine

# Passing runs follow the active profile (ci: derandomized), capped so the
# whole module stays well under a minute on two cores.
PASS = settings(
    settings.default,
    max_examples=min(settings.default.max_examples, 40),
    stateful_step_count=min(settings.default.stateful_step_count, 40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Mutant runs must fail: deterministic, no shrinking, stop at the first failure.
MUST_FAIL = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)

# spec name -> (adapter class, runtime module, name of its compiled table)
RUNTIMES: dict[str, tuple[type[SpecAdapter], ModuleType, str]] = {
    "write_task": (WriteTaskAdapter, write_task_mod, "WRITE_TASK_MACHINE"),
    "staging_holder": (StagingHolderAdapter, staging_mod, "HOLDER_MACHINE"),
    "slot_occupancy": (SlotOccupancyAdapter, occupancy_mod, "SLOT_MACHINE"),
    "step_context": (StepContextAdapter, step_context_mod, "STEP_MACHINE"),
    "planned_read": (PlannedReadAdapter, planned_read_mod, "PLANNED_READ_MACHINE"),
    "copy_queue": (CopyQueueAdapter, copy_queues_mod, "COPY_QUEUE_MACHINE"),
    # RequestBinding (the request table's and the delivery desk's) reads these tables.
    "request_lifecycle": (RequestLifecycleAdapter, lifecycle_mod, "REQUEST_MACHINE"),
    "delivery": (DeliveryAdapter, lifecycle_mod, "DELIVERY_MACHINE"),
    "host_tier": (HostTierAdapter, tier_store_mod, "TIER_MACHINE"),
}


def _run(adapter: SpecAdapter, run_settings: settings = PASS) -> Counter[tuple[str, str]]:
    """Run the generated machine; return how often each (trigger, source) moved."""
    moved: Counter[tuple[str, str]] = Counter()
    machine = build_machine(adapter, on_move=lambda trigger, source, dest: moved.update([(trigger, source)]))
    run_state_machine_as_test(machine, settings=run_settings)
    return moved


def _fails(adapter: SpecAdapter) -> str:
    """Run the generated machine where it must find a discrepancy; the message."""
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(build_machine(adapter), settings=MUST_FAIL)
    return str(info.value)


@contextmanager
def _runtime_table(module: ModuleType, attr: str, table: CompiledMachine) -> Iterator[None]:
    with mock.patch.object(module, attr, table):
        yield


def test_every_shipped_spec_has_a_runtime_adapter() -> None:
    assert set(spec_names()) == set(RUNTIMES)


# ------------------------------------------------------------ passing runs


@pytest.mark.parametrize("name", spec_names())
def test_interpreter_matches_spec_and_covers_every_move(name: str) -> None:
    spec = load_spec(name)
    moved = _run(InterpreterAdapter(spec))
    assert set(moved) == set(single_moves(spec))


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_runtime_matches_spec_and_covers_every_move(name: str) -> None:
    adapter_cls, _, _ = RUNTIMES[name]
    moved = _run(adapter_cls())
    assert set(moved) == set(single_moves(load_spec(name)))


# -------------------------------------------------- mutants must be caught


@pytest.mark.parametrize(
    ("name", "trigger", "source"), [(n, t, s) for n in spec_names() for t, s in single_moves(load_spec(n))]
)
def test_interpreter_missing_one_move_is_caught(name: str, trigger: str, source: str) -> None:
    spec = load_spec(name)
    message = _fails(InterpreterAdapter(spec, runtime_spec=without_move(spec, trigger, source)))
    assert trigger in message


@pytest.mark.parametrize(
    ("name", "trigger", "source"), [(n, t, s) for n in sorted(RUNTIMES) for t, s in single_moves(load_spec(n))]
)
def test_runtime_missing_one_move_is_caught(name: str, trigger: str, source: str) -> None:
    adapter_cls, module, attr = RUNTIMES[name]
    real = getattr(module, attr)
    with _runtime_table(module, attr, recompile(real, without_move(real.spec, trigger, source))):
        _fails(adapter_cls())


@pytest.mark.parametrize(
    ("name", "effect"), [(n, e) for n in sorted(RUNTIMES) for e in sorted(load_spec(n).effect_names)]
)
def test_runtime_ignoring_one_effect_is_caught(name: str, effect: str) -> None:
    adapter_cls, module, attr = RUNTIMES[name]
    real = getattr(module, attr)
    ignored = recompile(real, real.spec, replace_effects={effect: lambda *args: None})
    with _runtime_table(module, attr, ignored):
        _fails(adapter_cls())


@pytest.mark.parametrize("name", [n for n in spec_names() if load_spec(n).effect_names])
def test_interpreter_ignoring_an_effect_is_caught(name: str) -> None:
    spec = load_spec(name)
    effect = sorted(spec.effect_names)[0]
    message = _fails(InterpreterAdapter(spec, ignore_effects=[effect]))
    assert effect in message


# ---------------------------------------------- the spec drives the tests


REQUEUE = {
    "trigger": "requeue",
    "source": "COPYING",
    "dest": "QUEUED",
    "after": ["set_host_ready"],
    "meaning": "test-only: the copy claim is given back",
}


def test_added_move_gets_a_rule_and_is_exercised() -> None:
    spec = with_move(load_spec("write_task"), REQUEUE)
    machine = build_machine(InterpreterAdapter(spec))
    assert hasattr(machine, "fire_requeue") and not hasattr(
        build_machine(InterpreterAdapter(load_spec("write_task"))), "fire_requeue"
    )
    moved = _run(InterpreterAdapter(spec))
    assert moved[("requeue", "COPYING")] > 0


def test_added_move_missing_from_runtime_is_caught() -> None:
    spec = with_move(load_spec("write_task"), REQUEUE)
    message = _fails(InterpreterAdapter(spec, runtime_spec=load_spec("write_task")))
    assert "requeue" in message


def test_new_effect_without_an_observation_is_refused() -> None:
    data = spec_to_dict(load_spec("write_task"))
    data["transitions"][0]["after"].append("rewind_clone")
    spec = parse_spec(data, origin="write_task.yaml (+effect)")
    with pytest.raises(SpecError, match="rewind_clone"):
        build_machine(WriteTaskAdapter(spec))


def test_added_trigger_without_a_runtime_call_is_refused() -> None:
    with pytest.raises(SpecError, match="requeue"):
        WriteTaskAdapter(with_move(load_spec("write_task"), REQUEUE))


def test_new_invariant_without_a_check_is_refused() -> None:
    data = spec_to_dict(load_spec("write_task"))
    data["invariants"].append({"name": "never_twice_written", "meaning": "test-only"})
    spec = parse_spec(data, origin="write_task.yaml (+invariant)")
    with pytest.raises(SpecError, match="never_twice_written"):
        build_machine(WriteTaskAdapter(spec))


def test_every_named_invariant_is_checked_or_says_why_not() -> None:
    for name, (adapter_cls, _, _) in RUNTIMES.items():
        machine = build_machine(adapter_cls())
        declared = {inv.name for inv in load_spec(name).invariants}
        checked = {a[len("invariant_") :] for a in dir(machine) if a.startswith("invariant_")}
        assert checked | set(machine.unchecked) == declared
        assert all(machine.unchecked.values())


def test_event_states_derived_from_the_spec() -> None:
    spec = load_spec("write_task")
    always, sometimes = states_after(spec, lambda m: "set_done" in m.effects)
    assert always == sometimes == frozenset(spec.final_states)
    always, _ = states_after(spec, lambda m: "set_host_ready" in m.effects)
    assert "HOST_READY" in always and "COPYING" not in always


# ------------------------------------------------------ RELEASED is final


def test_released_holder_cannot_claim_again() -> None:
    """With released handles kept in play, the generated machine keeps firing
    claim/bind on RELEASED holders: the pool must refuse them as the spec says."""
    adapter = StagingHolderAdapter()
    assert adapter.retire_final is False
    run_state_machine_as_test(build_machine(adapter), settings=PASS)
