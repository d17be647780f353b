"""A ``transitions.Machine`` built from a spec: the diagram source and the
reference the compiled tables and the runtime are checked against."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from transitions import Machine, MachineError

from omni_prefix_cache.specs.loader import MachineSpec, TriggerName


@dataclass(eq=False)
class OracleModel:
    """Model object for the oracle machine.

    ``eq=False`` keeps identity equality: ``transitions.Machine.add_model``
    compares models with ``==`` and silently skips equal ones.
    """

    guard_values: dict[str, bool] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)
    state: str = ""


def build_oracle(spec: MachineSpec, guard_values: Mapping[str, bool] | None = None) -> tuple[Machine, OracleModel]:
    """A machine over a fresh model whose guards return ``guard_values``
    (default True) and whose effects append their names to ``model.fired``."""
    model = OracleModel(guard_values={g: True for g in spec.guard_names} | dict(guard_values or {}))
    for g in spec.guard_names:
        setattr(model, g, lambda *a, _g=g, **k: model.guard_values[_g])
    for e in spec.effect_names:
        setattr(model, e, lambda *a, _e=e, **k: model.fired.append(_e))
    machine = Machine(
        model=model,
        states=[{"name": s.name, "final": s.final} for s in spec.states],
        transitions=[
            {
                "trigger": m.trigger,
                "source": list(m.source),
                "dest": m.dest,
                "conditions": list(m.guards),
                "after": list(m.effects),
            }
            for m in spec.moves
        ],
        initial=spec.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )
    return machine, model


def oracle_step(
    machine: Machine, model: OracleModel, state: str, trigger: TriggerName
) -> tuple[str, str | None, tuple[str, ...]]:
    """Fire ``trigger`` from ``state``. Returns ``(outcome, dest, effects)``
    with outcome ``illegal`` (no move declared), ``blocked`` (a guard said
    no) or ``moved``."""
    machine.set_state(state, model=model)
    model.fired.clear()
    try:
        moved = getattr(model, trigger)()
    except MachineError:
        return "illegal", None, ()
    if not moved:
        return "blocked", None, ()
    return "moved", model.state, tuple(model.fired)
