"""Compile a spec into the runtime's hot-path form.

One generated ``IntEnum`` per machine and tuple-indexed move tables, so a
legal-move lookup is a tuple index plus a dict get (about 0.05 us) instead of
a ``transitions`` trigger (about 6 us) or a per-object machine (50-900 us to
build). Guards and effects are bound to the runtime's handler callables here;
the runtime never holds a transition table of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, cast

from omni_prefix_cache.specs.loader import MachineSpec, MoveSpec, SpecError, TriggerName
from omni_prefix_cache.telemetry.moves import Recorder
from omni_prefix_cache.telemetry.registry import TELEMETRY

# The state tag that says an instance waits there: its stays are timed.
WAITS_TAG = "waits"


class SpecState(IntEnum):
    """Base of every state enum generated from a spec."""

    # Set on each generated class after it is built (an annotation is not a member).
    final_states: ClassVar[frozenset[SpecState]]

    @property
    def is_terminal(self) -> bool:
        """True for the spec's final states."""
        return self in type(self).final_states


@dataclass(frozen=True, eq=False, slots=True)
class CompiledMove:
    """One (source, trigger) move with its handlers bound."""

    trigger: TriggerName
    source: SpecState
    dest: SpecState
    guards: tuple[Callable[..., Any], ...]
    effects: tuple[Callable[..., Any], ...]
    # ``effects`` split by the spec's ``deferrable`` list: a caller deferring
    # runs ``undeferrable`` now and ``deferrable`` once its record is public.
    undeferrable: tuple[Callable[..., Any], ...]
    deferrable: tuple[Callable[..., Any], ...]
    spec: MoveSpec
    # Position in the machine's ``moves`` (the recorder's counter index).
    index: int = 0


# Marks a (source, dest) pair reached by more than one trigger.
_AMBIGUOUS: Any = object()


class CompiledMachine:
    """Immutable move tables for one spec.

    ``move(state, trigger)`` and ``move_to(state, dest)`` return the move or
    None when the spec declares none; they never evaluate guards or run
    effects (the runtime does both, under whatever lock it holds).

    ``recorder`` is the machine's metrics (``telemetry.moves``), set by the
    process registry while metrics are on or a trace is open (docs/trace.md)
    and None while both are off: the runtime code that applies a move
    reports it there when it is set.
    """

    recorder: Recorder | None

    def __init__(self, spec: MachineSpec, state_enum: type[SpecState], moves: list[CompiledMove]):
        self.spec = spec
        self.State = state_enum
        n = len(spec.states)
        by_trigger: list[dict[TriggerName, CompiledMove]] = [{} for _ in range(n)]
        by_dest: list[list[Any]] = [[None] * n for _ in range(n)]
        for m in moves:
            by_trigger[m.source][m.trigger] = m
            cell = by_dest[m.source][m.dest]
            by_dest[m.source][m.dest] = m if cell is None else _AMBIGUOUS
        self._by_trigger = tuple(by_trigger)
        self._by_dest = tuple(tuple(row) for row in by_dest)
        self._by_state: dict[TriggerName, tuple[CompiledMove | None, ...]] = {}  # by_state's rows, built on first use
        self.moves = tuple(moves)
        self.triggers = spec.triggers
        self.initial = state_enum[spec.initial]
        self.final: frozenset[SpecState] = frozenset(state_enum[s] for s in spec.final_states)
        self.recorder = None
        TELEMETRY.register(self)

    def recorder_spec(self) -> tuple[str, list[tuple[str, str, str]], dict[int, str]]:
        """For the metrics registry: the spec's name, (trigger, source, dest)
        per move index, and the states tagged ``waits`` (number -> name)."""
        labels = [(str(m.trigger), m.source.name, m.dest.name) for m in self.moves]
        timed = {int(self.State[s]): s for s in self.spec.tagged(WAITS_TAG)}
        return self.spec.name, labels, timed

    def move(self, state: int, trigger: TriggerName) -> CompiledMove | None:
        return self._by_trigger[state].get(trigger)

    def by_state(self, trigger: TriggerName) -> tuple[CompiledMove | None, ...]:
        """``trigger``'s move from each state (None where the spec has none),
        indexed by state: a batched step looks a move up per item by index."""
        row = self._by_state.get(trigger)
        if row is None:
            row = self._by_state[trigger] = tuple(moves.get(trigger) for moves in self._by_trigger)
        return row

    def move_to(self, state: int, dest: int) -> CompiledMove | None:
        """The unique move from ``state`` to ``dest``; None if there is none.

        Raises SpecError if several triggers join the pair (name the trigger).
        """
        m = self._by_dest[state][dest]
        if m is _AMBIGUOUS:
            raise SpecError(
                f"{self.spec.origin}: {self.State(state).name} -> {self.State(dest).name} is reached by "
                "several triggers; call move() with the trigger"
            )
        return cast("CompiledMove | None", m)

    def transition_matrix(self, trigger: TriggerName) -> tuple[int, ...]:
        """Destination per source state for ``trigger``; -1 where illegal."""
        return tuple(
            int(m.dest) if (m := self._by_trigger[s].get(trigger)) is not None else -1 for s in range(len(self.State))
        )

    def tagged(self, tag: str) -> frozenset[SpecState]:
        return frozenset(self.State[s] for s in self.spec.tagged(tag))


def make_state_enum(spec: MachineSpec, module: str | None = None) -> type[SpecState]:
    """Generate the spec's ``IntEnum`` (values in declaration order)."""
    members = [(name, i) for i, name in enumerate(spec.state_names)]
    factory: Any = SpecState  # the functional Enum API, which the stubs do not model for subclasses
    enum_cls: type[SpecState] = factory(spec.enum_name, members, module=module, qualname=spec.enum_name)
    enum_cls.final_states = frozenset(enum_cls[s] for s in spec.final_states)
    return enum_cls


def compile_machine(
    spec: MachineSpec,
    *,
    guards: Mapping[str, Callable[..., Any]] | None = None,
    effects: Mapping[str, Callable[..., Any]] | None = None,
    module: str | None = None,
    state_enum: type[SpecState] | None = None,
) -> CompiledMachine:
    """Bind ``spec`` to the runtime's handlers.

    Raises SpecError (naming the spec file and the name) when the spec uses a
    guard or effect the runtime does not register, or the runtime registers
    one the spec never declares: both sides must list the same names.
    """
    guards = dict(guards or {})
    effects = dict(effects or {})
    for kind, declared, registered in (
        ("guard", spec.guard_names, set(guards)),
        ("effect", spec.effect_names, set(effects)),
    ):
        missing = sorted(declared - registered)
        if missing:
            raise SpecError(f"{spec.origin}: {kind}s {missing} are not registered by the runtime")
        extra = sorted(registered - declared)
        if extra:
            raise SpecError(f"{spec.origin}: the runtime registers {kind}s {extra} that the spec does not declare")
    enum_cls = state_enum or make_state_enum(spec, module)
    if tuple(m.name for m in enum_cls) != spec.state_names or {s.name for s in enum_cls.final_states} != set(
        spec.final_states
    ):
        raise SpecError(
            f"{spec.origin}: state enum {enum_cls.__name__} does not match the spec's states "
            "(regenerate the typed modules: make typed-specs)"
        )
    moves = [
        CompiledMove(
            trigger=m.trigger,
            source=enum_cls[src],
            dest=enum_cls[m.dest],
            guards=tuple(guards[g] for g in m.guards),
            effects=tuple(effects[e] for e in m.effects),
            undeferrable=tuple(effects[e] for e in m.effects if e not in m.deferrable),
            deferrable=tuple(effects[e] for e in m.effects if e in m.deferrable),
            spec=m,
            index=i,
        )
        for i, (m, src) in enumerate((m, src) for m in spec.moves for src in m.source)
    ]
    return CompiledMachine(spec, enum_cls, moves)
