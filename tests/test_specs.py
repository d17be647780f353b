"""The state-machine specs: validation, compiled tables vs the oracle,
diagrams, and the spec files shipped inside the wheel."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_prefix_cache.specs import (
    CompiledMachine,
    MachineSpec,
    SpecError,
    compile_machine,
    load_spec,
    parse_spec,
    spec_names,
)
from omni_prefix_cache.specs.composition import load_protocol
from omni_prefix_cache.specs.composition_diagrams import render_protocol
from omni_prefix_cache.specs.diagrams import render_dot, stale_diagrams
from omni_prefix_cache.specs.oracle import build_oracle, oracle_step
from omni_prefix_cache.tools.package_map import render_package_map

REPO = Path(__file__).resolve().parents[1]
SPEC_DIR = REPO / "spec"
SHIPPED = sorted(p.stem for p in SPEC_DIR.glob("*.yaml") if p.stem != "protocol")  # protocol.yaml: the composition
ORIGIN = "x.yaml"


# ---------------------------------------------------------------- helpers


def raw_spec(name: str) -> dict[str, Any]:
    """A fresh, mutable copy of ``spec/<name>.yaml`` as parsed YAML."""
    return yaml.safe_load((SPEC_DIR / f"{name}.yaml").read_text())


def base(name: str) -> dict[str, Any]:
    """``raw_spec`` after checking the unmutated copy is valid, so a
    SpecError from a mutated copy is due to the mutation alone."""
    data = raw_spec(name)
    parse_spec(copy.deepcopy(data), origin=ORIGIN)
    return data


def expect_spec_error(data: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(data, origin=ORIGIN)
    message = str(info.value)
    for fragment in (ORIGIN, *fragments):
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def initial_of(data: dict[str, Any]) -> str:
    return next(s["name"] for s in data["states"] if s.get("initial"))


def finals_of(data: dict[str, Any]) -> list[str]:
    return [s["name"] for s in data["states"] if s.get("final")]


def sources_of(move: dict[str, Any]) -> list[str]:
    src = move["source"]
    return [src] if isinstance(src, str) else list(src)


def noop_handlers(spec: MachineSpec) -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    guards = {g: (lambda *a, **k: True) for g in spec.guard_names}
    effects = {e: (lambda *a, **k: None) for e in spec.effect_names}
    return guards, effects


def compile_plain(spec: MachineSpec) -> CompiledMachine:
    guards, effects = noop_handlers(spec)
    return compile_machine(spec, guards=guards, effects=effects)


def move_table(compiled: CompiledMachine) -> dict[tuple[str, str], str]:
    """(source, trigger) -> dest for every declared move."""
    table = {}
    for state in compiled.State:
        for trigger in compiled.triggers:
            move = compiled.move(state, trigger)
            if move is not None:
                table[(state.name, trigger)] = move.dest.name
    return table


def test_shipped_specs_are_the_repo_spec_folder() -> None:
    assert SHIPPED, "no spec/*.yaml found"
    assert list(spec_names()) == SHIPPED
    for name in SHIPPED:
        spec = parse_spec(raw_spec(name), origin=f"{name}.yaml")
        assert load_spec(name).state_names == spec.state_names
        assert [m.label for m in load_spec(name).moves] == [m.label for m in spec.moves]


# ------------------------------------------------- one test per validation rule


def test_rejects_zero_initial_states() -> None:
    data = base("write_task")
    for state in data["states"]:
        state.pop("initial", None)
    expect_spec_error(data, "states", "exactly one initial state", "none")


def test_rejects_two_initial_states() -> None:
    data = base("write_task")
    first = initial_of(data)
    second = next(s for s in data["states"] if s["name"] != first)
    second["initial"] = True
    expect_spec_error(data, "exactly one initial state", first, second["name"])


def test_rejects_move_out_of_final_state() -> None:
    data = base("write_task")
    final = finals_of(data)[0]
    data["transitions"].append({"trigger": "revive", "source": final, "dest": initial_of(data), "meaning": "m"})
    expect_spec_error(data, "(revive)", f"out of final state {final}")


def test_rejects_unreachable_state() -> None:
    data = base("write_task")
    data["states"].append({"name": "ORPHAN", "meaning": "nothing leads here"})
    data["transitions"].append({"trigger": "leave", "source": "ORPHAN", "dest": finals_of(data)[0], "meaning": "m"})
    expect_spec_error(data, "state ORPHAN", "unreachable")


@pytest.mark.parametrize("name", ["write_task", "slot_occupancy"])  # settles in a final / a rest state
def test_rejects_state_that_cannot_settle(name: str) -> None:
    data = base(name)
    data["states"].append({"name": "STUCK", "meaning": "no way out"})
    data["transitions"].append({"trigger": "get_stuck", "source": initial_of(data), "dest": "STUCK", "meaning": "m"})
    expect_spec_error(data, "state STUCK", "cannot reach a final/rest state")


def test_rejects_machine_with_nowhere_to_settle() -> None:
    data = base("slot_occupancy")
    assert not finals_of(data)
    for state in data["states"]:
        state.pop("tags", None)
    expect_spec_error(data, "no final state and no state tagged 'rest'")


def test_rejects_two_moves_for_same_trigger_and_source() -> None:
    data = base("write_task")
    move = data["transitions"][0]
    source = sources_of(move)[0]
    other = next(s["name"] for s in data["states"] if s["name"] not in (source, move["dest"]))
    data["transitions"].append({"trigger": move["trigger"], "source": source, "dest": other, "meaning": "m"})
    expect_spec_error(data, f"second move for trigger {move['trigger']!r} from {source}")


@pytest.mark.parametrize("field", ["source", "dest"])
def test_rejects_unknown_state_in_move(field: str) -> None:
    data = base("write_task")
    move = data["transitions"][0]
    move[field] = "NOWHERE"
    expect_spec_error(data, f"transition #0 ({move['trigger']})", "unknown state 'NOWHERE'")


@pytest.mark.parametrize("level", ["top", "state", "move"])
def test_rejects_unknown_field(level: str) -> None:
    data = base("write_task")
    target, where = {
        "top": (data, "top level"),
        "state": (data["states"][0], "state #0"),
        "move": (data["transitions"][0], "transition #0"),
    }[level]
    target["colour"] = "red"
    expect_spec_error(data, where, "unknown fields ['colour']")


@pytest.mark.parametrize("blank", [None, "   "])
@pytest.mark.parametrize("level", ["state", "move"])
def test_rejects_missing_meaning(level: str, blank: str | None) -> None:
    data = base("write_task")
    if level == "state":
        item = data["states"][1]
        where = f"state {item['name']}"
    else:
        item = data["transitions"][1]
        where = f"transition #1 ({item['trigger']})"
    if blank is None:
        del item["meaning"]
    else:
        item["meaning"] = blank
    expect_spec_error(data, where, "needs a one-line 'meaning'")


@pytest.mark.parametrize("reserved", [False, True], ids=["another-trigger", "state-attribute"])
@pytest.mark.parametrize("field", ["conditions", "after"])
def test_rejects_handler_name_clashing_with_trigger(field: str, reserved: bool) -> None:
    """A handler named like a trigger (or the model's ``state`` attribute)
    would shadow it on the transitions model."""
    data = base("write_task")
    move = data["transitions"][0]
    clash = "state" if reserved else next(m["trigger"] for m in data["transitions"] if m["trigger"] != move["trigger"])
    move[field] = [*move.get(field, []), clash]
    expect_spec_error(data, f"({move['trigger']})", f"handler name {clash!r} clashes with a trigger")


def test_rejects_duplicate_state() -> None:
    data = base("write_task")
    data["states"].append(dict(data["states"][1]))
    expect_spec_error(data, f"state {data['states'][1]['name']}", "declared twice")


@pytest.mark.parametrize("kind", ["guard", "effect"])
def test_compile_rejects_handler_the_runtime_does_not_register(kind: str) -> None:
    spec = parse_spec(base("write_task" if kind == "effect" else "staging_holder"), origin=ORIGIN)
    guards, effects = noop_handlers(spec)
    handlers = guards if kind == "guard" else effects
    dropped = sorted(handlers)[0]
    del handlers[dropped]
    with pytest.raises(SpecError, match=rf"{ORIGIN}: {kind}s \['{dropped}'\] are not registered"):
        compile_machine(spec, guards=guards, effects=effects)


@pytest.mark.parametrize("kind", ["guard", "effect"])
def test_compile_rejects_registered_handler_the_spec_does_not_declare(kind: str) -> None:
    spec = parse_spec(base("staging_holder"), origin=ORIGIN)
    guards, effects = noop_handlers(spec)
    (guards if kind == "guard" else effects)["ghost_handler"] = lambda *a, **k: True
    with pytest.raises(SpecError, match=rf"{ORIGIN}: the runtime registers {kind}s \['ghost_handler'\]"):
        compile_machine(spec, guards=guards, effects=effects)


def test_compile_accepts_exactly_the_declared_handlers() -> None:
    for name in SHIPPED:
        compiled = compile_plain(load_spec(name))
        assert len(compiled.moves) == sum(len(m.source) for m in load_spec(name).moves)


# ------------------------------------------------ compiled table vs the oracle


def guard_valuations(spec: MachineSpec) -> Iterator[tuple[str, dict[str, bool]]]:
    """All guards true, all false, then each single guard false."""
    names = sorted(spec.guard_names)
    yield "all-true", dict.fromkeys(names, True)
    if names:
        yield "all-false", dict.fromkeys(names, False)
    for name in names:
        yield f"{name}-false", {g: g != name for g in names}


def compiled_step(
    compiled: CompiledMachine, state: str, trigger: str, fired: list[str]
) -> tuple[str, str | None, tuple[str, ...]]:
    """What the runtime does with the compiled table, in the oracle's terms."""
    move = compiled.move(compiled.State[state], trigger)
    if move is None:
        return "illegal", None, ()
    if not all(guard() for guard in move.guards):
        return "blocked", None, ()
    fired.clear()
    for effect in move.effects:
        effect()
    return "moved", move.dest.name, tuple(fired)


@pytest.mark.parametrize("name", SHIPPED)
def test_compiled_table_agrees_with_transitions_oracle(name: str) -> None:
    spec = load_spec(name)
    outcomes: Counter[str] = Counter()
    for label, values in guard_valuations(spec):
        fired: list[str] = []
        guards = {g: (lambda *a, _v=values[g], **k: _v) for g in spec.guard_names}
        effects = {e: (lambda *a, _e=e, _f=fired, **k: _f.append(_e)) for e in spec.effect_names}
        compiled = compile_machine(spec, guards=guards, effects=effects)
        machine, model = build_oracle(spec, values)
        for state in spec.state_names:
            for trigger in spec.triggers:
                want = oracle_step(machine, model, state, trigger)
                got = compiled_step(compiled, state, trigger, fired)
                assert got == want, f"{name} [{label}] {state} --{trigger}-->: compiled {got}, oracle {want}"
                outcomes[want[0]] += 1
                if label == "all-true":
                    dest = compiled.transition_matrix(trigger)[compiled.State[state]]
                    assert dest == (compiled.State[want[1]] if want[0] == "moved" else -1)
    # Not vacuous: every kind of outcome the spec allows was compared.
    assert outcomes["moved"] > 0 and outcomes["illegal"] > 0
    if spec.guard_names:
        assert outcomes["blocked"] > 0


def test_oracle_comparison_can_fail() -> None:
    """A compiled table that drifted from its spec is caught by the comparison."""
    spec = load_spec("step_context")
    drifted = parse_spec(
        {**raw_spec("step_context"), "transitions": raw_spec("step_context")["transitions"][:-1]}, origin=ORIGIN
    )
    compiled = compile_plain(drifted)
    machine, model = build_oracle(spec)
    dropped = spec.moves[-1]
    source = dropped.source[0]
    assert oracle_step(machine, model, source, dropped.trigger)[0] == "moved"
    assert compiled_step(compiled, source, dropped.trigger, [])[0] == "illegal"


# ---------------------------------------------------------------- diagrams


def test_committed_diagrams_match_the_specs(repo_root: Path) -> None:
    """`make diagrams` was rerun after the last spec edit (and the last new module)."""
    assert stale_diagrams(repo_root / "diagrams", {"packages": render_package_map()}) == []


def test_package_map_is_stale_after_an_import_changes(tmp_path: Path) -> None:
    pkg = tmp_path / "omni_prefix_cache"
    (pkg / "steps").mkdir(parents=True)
    for path in (pkg / "__init__.py", pkg / "steps" / "__init__.py", pkg / "manager.py"):
        path.write_text("")
    (pkg / "steps" / "ledger.py").write_text("")
    before = render_package_map(pkg)
    assert '"manager" -> "steps"' not in before
    (pkg / "manager.py").write_text("from omni_prefix_cache.steps import ledger\n")
    after = render_package_map(pkg)
    assert '"manager" -> "steps"' in after
    out = tmp_path / "diagrams"
    out.mkdir()
    (out / "packages.dot").write_text(before)
    assert "packages" in stale_diagrams(out, {"packages": after})


def test_stale_diagrams_names_edited_and_missing_files(repo_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "diagrams"
    out.mkdir()
    for name in SHIPPED:
        (out / f"{name}.dot").write_text(render_dot(load_spec(name)))
    for name, source in render_protocol(load_protocol()).items():
        (out / f"{name}.dot").write_text(source)
    assert stale_diagrams(out) == []
    first, last = SHIPPED[0], SHIPPED[-1]
    (out / f"{first}.dot").write_text((out / f"{first}.dot").read_text() + "// edited\n")
    (out / f"{last}.dot").unlink()
    (out / "protocol_save.dot").write_text("digraph {}\n")
    (out / "protocol_retired_op.dot").write_text("digraph {}\n")
    assert sorted(stale_diagrams(out)) == sorted({first, last, "protocol_save", "protocol_retired_op"})


def test_render_dot_is_deterministic() -> None:
    here = {name: render_dot(load_spec(name)) for name in SHIPPED}
    for name in SHIPPED:
        assert render_dot(parse_spec(raw_spec(name), origin=f"{name}.yaml")) == here[name]
    # Another process with another hash seed renders the same bytes.
    script = (
        "import json; from omni_prefix_cache.specs import load_all_specs; "
        "from omni_prefix_cache.specs.diagrams import render_dot; "
        "print(json.dumps({n: render_dot(s) for n, s in load_all_specs().items()}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert json.loads(proc.stdout) == here


# ------------------------------------ a spec edit alone changes table and diagram


def dot_lines(spec: MachineSpec) -> Counter[str]:
    return Counter(render_dot(spec).splitlines())


@pytest.mark.parametrize("name", SHIPPED)
def test_added_move_changes_table_and_diagram(name: str) -> None:
    data = raw_spec(name)
    before = parse_spec(copy.deepcopy(data), origin=f"{name}.yaml")
    start = initial_of(data)
    data["transitions"].append({"trigger": "probe_added", "source": start, "dest": start, "meaning": "added"})
    after = parse_spec(data, origin=f"{name}.yaml")

    old, new = move_table(compile_plain(before)), move_table(compile_plain(after))
    assert (start, "probe_added") not in old
    assert new == {**old, (start, "probe_added"): start}

    added = dot_lines(after) - dot_lines(before)
    removed = dot_lines(before) - dot_lines(after)
    assert not removed
    assert len(added) == 1
    (line,) = added
    assert f"{start} -> {start}" in line and "probe_added" in line


@pytest.mark.parametrize("name", SHIPPED)
def test_removed_move_changes_table_and_diagram(name: str) -> None:
    """Drop each (trigger, source) pair in turn; the validator may refuse the
    result (a state left unreachable), otherwise exactly that entry and that
    edge disappear."""
    data = raw_spec(name)
    before = parse_spec(copy.deepcopy(data), origin=f"{name}.yaml")
    old = move_table(compile_plain(before))
    old_dot = dot_lines(before)
    accepted = 0
    for i, move in enumerate(data["transitions"]):
        for source in sources_of(move):
            edited = copy.deepcopy(data)
            rest = [s for s in sources_of(move) if s != source]
            if rest:
                edited["transitions"][i]["source"] = rest
            else:
                del edited["transitions"][i]
            try:
                after = parse_spec(edited, origin=f"{name}.yaml")
            except SpecError as exc:
                assert "unreachable" in str(exc) or "cannot reach" in str(exc), exc
                continue
            accepted += 1
            key = (source, move["trigger"])
            assert move_table(compile_plain(after)) == {k: v for k, v in old.items() if k != key}
            removed = old_dot - dot_lines(after)
            assert not dot_lines(after) - old_dot
            assert len(removed) == 1
            (line,) = removed
            assert f"{source} -> {move['dest']}" in line and move["trigger"] in line
    assert accepted > 0, f"{name}: no single move could be removed without breaking the graph"
