"""A tiny runtime that runs any spec's compiled table, and its adapter.

``SpecInterpreter`` holds integer-handled objects, each in a spec state.
Guards read world flags; effects count how often they ran per object. It is
the runtime the generator is tested against: the same spec drives it and
the generated machine, so a move removed from (or an effect ignored by) the
interpreter's copy of the spec must make the generated machine fail.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs.compiled import SpecState, compile_machine
from omni_prefix_cache.specs.loader import MachineSpec
from omni_prefix_cache.testing.stateful import (
    EnvRule,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    Refused,
    SpecAdapter,
)


class SpecInterpreter:
    """Objects moving through ``spec``'s compiled table.

    ``ignore_effects``: effect names whose handler does nothing (a runtime
    that forgets a declared effect). A trigger with no move from the
    object's state raises OmniPrefixCacheUnmatchError; a guard that says no
    makes ``fire`` return False.
    """

    def __init__(self, spec: MachineSpec, *, ignore_effects: Iterable[str] = ()):
        self.spec = spec
        ignored = frozenset(ignore_effects)
        self.flags: dict[str, bool] = {g: True for g in spec.guard_names}
        self.states: dict[int, SpecState] = {}
        self.fired: Counter[tuple[int, str]] = Counter()
        self.owed: dict[int, tuple[Callable[[int], None], ...]] = {}
        self.machine = compile_machine(
            spec,
            guards={g: self._guard(g) for g in spec.guard_names},
            effects={e: self._effect(e, e in ignored) for e in spec.effect_names},
        )

    def _guard(self, name: str) -> Callable[[int], bool]:
        return lambda handle: self.flags[name]

    def _effect(self, name: str, ignored: bool) -> Callable[[int], None]:
        def run(handle: int) -> None:
            if not ignored:
                self.fired[(handle, name)] += 1

        return run

    def create(self, handle: int) -> None:
        self.states[handle] = self.machine.initial

    def fire(self, handle: int, trigger: str, *, defer: bool = False) -> bool:
        """Fire ``trigger``; True if it moved, False if a guard refused."""
        state = self.states[handle]
        move = self.machine.move(state, trigger)
        if move is None:
            raise OmniPrefixCacheUnmatchError(f"{self.spec.name} #{handle}: no move {trigger!r} from {state.name}")
        if not all(guard(handle) for guard in move.guards):
            return False
        self.states[handle] = move.dest
        for effect in move.undeferrable if defer else move.effects:
            effect(handle)
        if defer and move.deferrable:
            self.owed[handle] = move.deferrable
        return True

    def wake(self, handle: int) -> None:
        for effect in self.owed.pop(handle, ()):
            effect(handle)


def _env_guard(guard: str, ctx: MoveCtx) -> bool:
    """The model's guard: whatever the test environment says it is."""
    return bool(ctx.model.env[guard])


class InterpreterAdapter(SpecAdapter):
    """Plays ``spec`` against a SpecInterpreter built from ``runtime_spec``
    (default: the same spec). A guard-flag environment rule flips the world's
    guards; the observable effect trace is the per-object effect count.

    The spec's named invariants are prose with no meaning on this generic
    runtime; they are listed as unchecked (the runtime adapters and the
    composed model check implement them).
    """

    handle_name = "obj"

    def __init__(
        self,
        spec: MachineSpec,
        *,
        runtime_spec: MachineSpec | None = None,
        ignore_effects: Iterable[str] = (),
        max_handles: int = 6,
    ):
        self.spec = spec
        self.runtime_spec = runtime_spec or spec
        self.ignore_effects = tuple(ignore_effects)
        self.max_handles = max_handles

    def new_system(self) -> SpecInterpreter:
        return SpecInterpreter(self.runtime_spec, ignore_effects=self.ignore_effects)

    def create(self, system: SpecInterpreter, handle: int, args: Mapping[str, Any]) -> None:
        system.create(handle)

    def fire(self, system: SpecInterpreter, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        if not system.fire(handle, trigger, defer=defer):
            raise Refused(f"{trigger}: a guard refused")

    def read_state(self, system: SpecInterpreter, handle: int) -> str:
        return system.states[handle].name

    def observe(self, system: SpecInterpreter, handles: Sequence[int]) -> dict[Hashable, Any]:
        return {(h, e): system.fired[(h, e)] for h in handles for e in sorted(self.spec.effect_names)}

    def wake(self, system: SpecInterpreter, handle: int) -> None:
        system.wake(handle)

    def new_model(self, model: ModelWorld) -> None:
        model.env.update({g: True for g in self.spec.guard_names})

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        for e in self.spec.effect_names:
            model.obs[(handle, e)] = 0

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {g: functools.partial(_env_guard, g) for g in self.spec.guard_names}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def count(name: str) -> Callable[[MoveCtx], None]:
            def run(ctx: MoveCtx) -> None:
                ctx.model.obs[(ctx.handle, name)] += 1

            return run

        return {e: count(e) for e in self.spec.effect_names}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if outcome == "blocked":
            return Refusal(Refused)
        return Refusal(OmniPrefixCacheUnmatchError, rf"no move '{trigger}'")

    def env_rules(self) -> Sequence[EnvRule]:
        if not self.spec.guard_names:
            return ()
        guards = sorted(self.spec.guard_names)

        def set_guard(machine: GeneratedMachine, data: Any) -> None:
            name = data.draw(st.sampled_from(guards), label="guard")
            value = data.draw(st.booleans(), label="value")
            machine.system.flags[name] = value
            machine.model.env[name] = value

        return (EnvRule("set_guard", set_guard),)

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {
            inv.name: "prose invariant; the generic interpreter gives it no meaning" for inv in self.spec.invariants
        }
