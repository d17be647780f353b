"""The generated typed spec modules: fresh, faithful to the specs, and enforced at compile time."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from omni_prefix_cache.specs import SpecError, compile_machine, load_all_specs
from omni_prefix_cache.specs.loader import parse_spec
from omni_prefix_cache.specs.typegen import OUT_DIR, render_module, stale_typed, trigger_enum_name, write_typed


def test_committed_modules_match_the_specs() -> None:
    stale = stale_typed()
    assert stale == [], f"stale typed spec modules {stale}: run `make typed-specs` and commit the result"


@pytest.mark.parametrize("name", sorted(load_all_specs()))
def test_generated_names_are_the_specs(name: str) -> None:
    spec = load_all_specs()[name]
    module = importlib.import_module(f"omni_prefix_cache.specs.types.{name}")
    states = getattr(module, spec.enum_name)
    assert [(m.name, int(m)) for m in states] == [(s, i) for i, s in enumerate(spec.state_names)]
    assert {m.name for m in states.final_states} == set(spec.final_states)
    assert module.INITIAL.name == spec.initial
    triggers = getattr(module, trigger_enum_name(spec))
    assert [t.value for t in triggers] == list(spec.triggers)
    assert all(t == t.value for t in triggers)  # usable wherever the runtime takes a trigger string


def test_staleness_is_detected(tmp_path: Path) -> None:
    write_typed(tmp_path)
    assert stale_typed(tmp_path) == []
    target = tmp_path / "write_task.py"
    target.write_text(target.read_text().replace("QUEUED = 1", "QUEUED = 7"))
    (tmp_path / "gone_spec.py").write_text("# Generated from spec/gone_spec.yaml by `make typed-specs`; do not edit.\n")
    assert stale_typed(tmp_path) == ["write_task.py", "gone_spec.py"]
    write_typed(tmp_path)  # regenerating restores the module and removes the orphan
    assert stale_typed(tmp_path) == [] and not (tmp_path / "gone_spec.py").exists()


def test_a_spec_change_makes_the_generated_enum_refused() -> None:
    from omni_prefix_cache.specs.types.step_context import StepState

    spec = load_all_specs()["step_context"]
    data = {
        "name": spec.name,
        "enum": spec.enum_name,
        "description": spec.description,
        "states": [{"name": s.name, "meaning": s.meaning, "initial": s.initial, "final": s.final} for s in spec.states]
        + [{"name": "EXTRA", "meaning": "a state the generated module lacks", "final": True}],
        "transitions": [
            {"trigger": m.trigger, "source": list(m.source), "dest": m.dest, "meaning": m.meaning} for m in spec.moves
        ]
        + [{"trigger": "extra", "source": spec.initial, "dest": "EXTRA", "meaning": "reach it"}],
    }
    changed = parse_spec(data, origin="changed.yaml")
    assert "EXTRA" in render_module(changed)
    with pytest.raises(SpecError, match="make typed-specs"):
        compile_machine(changed, state_enum=StepState)


def test_output_folder_is_the_package() -> None:
    assert OUT_DIR == Path(importlib.import_module("omni_prefix_cache.specs.types").__file__).parent
