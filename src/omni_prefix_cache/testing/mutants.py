"""Spec mutants: copies of a spec with a move added or removed, and a
runtime's compiled table rebuilt from such a copy (same state enum, same
handlers) to prove a generated machine notices the difference."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omni_prefix_cache.specs.compiled import CompiledMachine, compile_machine
from omni_prefix_cache.specs.loader import MachineSpec, MoveSpec, parse_spec


def spec_to_dict(spec: MachineSpec) -> dict[str, Any]:
    """The YAML-shaped mapping ``parse_spec`` reads back into ``spec``."""
    return {
        "name": spec.name,
        "enum": spec.enum_name,
        "description": spec.description,
        "states": [
            {"name": s.name, "meaning": s.meaning, "initial": s.initial, "final": s.final, "tags": list(s.tags)}
            for s in spec.states
        ],
        "transitions": [
            {
                "trigger": m.trigger,
                "source": list(m.source),
                "dest": m.dest,
                "conditions": list(m.guards),
                "after": list(m.effects),
                "meaning": m.meaning,
                "deferrable": list(m.deferrable),
            }
            for m in spec.moves
        ],
        "invariants": [{"name": i.name, "meaning": i.meaning} for i in spec.invariants],
        "couplings": [
            {"name": c.name, "fires": c.fires, "others": c.others, "meaning": c.meaning} for c in spec.couplings
        ],
    }


def with_move(spec: MachineSpec, move: dict[str, Any]) -> MachineSpec:
    """A validated copy of ``spec`` with one more transition (YAML shape)."""
    data = spec_to_dict(spec)
    data["transitions"].append(dict(move))
    return parse_spec(data, origin=f"{spec.origin} (+{move['trigger']})")


def without_move(spec: MachineSpec, trigger: str, source: str) -> MachineSpec:
    """A copy of ``spec`` without the (trigger, source) move. Not validated:
    removing a move may strand a state, which is the point of the mutant."""
    moves: list[MoveSpec] = []
    found = False
    for m in spec.moves:
        if m.trigger == trigger and source in m.source:
            found = True
            rest = tuple(s for s in m.source if s != source)
            if rest:
                moves.append(dataclasses.replace(m, source=rest))
            continue
        moves.append(m)
    if not found:
        raise KeyError(f"{spec.origin}: no move {trigger!r} from {source}")
    return dataclasses.replace(spec, moves=tuple(moves), origin=f"{spec.origin} (-{trigger} from {source})")


def single_moves(spec: MachineSpec) -> list[tuple[str, str]]:
    """Every (trigger, source) pair the spec declares, in declaration order."""
    return [(m.trigger, s) for m in spec.moves for s in m.source]


def handlers_of(compiled: CompiledMachine) -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    """The guard and effect callables a runtime bound, by spec name."""
    guards: dict[str, Callable[..., Any]] = {}
    effects: dict[str, Callable[..., Any]] = {}
    for m in compiled.moves:
        guards.update(zip(m.spec.guards, m.guards, strict=True))
        effects.update(zip(m.spec.effects, m.effects, strict=True))
    return guards, effects


def recompile(
    compiled: CompiledMachine,
    spec: MachineSpec,
    *,
    replace_effects: dict[str, Callable[..., Any]] | None = None,
) -> CompiledMachine:
    """``compiled``'s handlers and state enum bound to a mutant ``spec``
    (handlers the mutant no longer names are dropped; ``replace_effects``
    swaps some, e.g. for a no-op that ignores a declared effect)."""
    guards, effects = handlers_of(compiled)
    effects.update(replace_effects or {})
    return compile_machine(
        spec,
        guards={k: v for k, v in guards.items() if k in spec.guard_names},
        effects={k: v for k, v in effects.items() if k in spec.effect_names},
        state_enum=compiled.State,
    )
