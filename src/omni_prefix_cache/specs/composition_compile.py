"""Compile the composition's operations (``specs.composition_loader``) into
plain closures over a ``Binding`` (the runtime's, the model checker's or a
test's handlers), so no YAML is interpreted per call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from omni_prefix_cache.specs.composition_grammar import Couple, Do, Fire, FirstOf, OperationSpec, Step, When
from omni_prefix_cache.specs.composition_loader import ProtocolSpec
from omni_prefix_cache.specs.loader import SpecError, TriggerName


class Binding(Protocol):
    """What an executor of the protocol supplies (runtime, model, test).

    Resolved once per step at compile time, so a call pays a closure call,
    not a name lookup: ``move(role, trigger)`` returns ``(enabled, fire)``,
    where ``enabled(ctx)`` says whether the move may fire now (its source
    state and guards) and ``fire(ctx)`` performs it with its effects;
    ``coupling(role, name)`` returns the coupling's runner. ``ctx`` is the
    executor's per-call context (a task, a world, a step...).

    Optional: ``try_move(role, trigger)`` returns ``attempt(ctx) -> bool``,
    which fires the move if it is enabled, atomically, and says whether it
    did. Where a binding has it, a step calls it instead of ``enabled`` then
    ``fire`` (one check, no window between them); ``first_of`` still tests
    its alternatives with ``enabled``.
    """

    def move(self, role: str, trigger: TriggerName) -> tuple[Callable[[Any], bool], Callable[[Any], None]]: ...

    def coupling(self, role: str, name: str) -> Callable[[Any], None]: ...


Run = Callable[[Any], None]


class ProtocolViolation(SpecError):
    """An operation tried a move its spec lists but the state does not allow."""


@dataclass(frozen=True, eq=False, slots=True)
class CompiledOperation:
    """An operation bound to an executor: one closure per segment (a wait
    segment compiles to a no-op: the executor performs waits itself, see
    ``spec.segments[i].wait``), and ``admits(ctx)`` from its entry move."""

    spec: OperationSpec
    segments: tuple[Run, ...]
    admits: Callable[[Any], bool]

    def run(self, ctx: Any) -> bool:
        """All segments in order, if the entry move admits ``ctx`` (no locks
        taken: for executors that hold what the segments need, or none)."""
        if not self.admits(ctx):
            return False
        for seg in self.segments:
            seg(ctx)
        return True


def _always(ctx: Any) -> bool:
    return True


def _nothing(ctx: Any) -> None:
    return None


def compile_operation(
    op: OperationSpec,
    binding: Binding,
    effects: Mapping[str, Callable[[Any], None]],
    guards: Mapping[str, Callable[[Any], bool]],
) -> CompiledOperation:
    """Bind ``op`` to ``binding`` and the effect/guard handlers. A handler
    missing from the mappings raises SpecError now, not at the first call."""
    compiler = _OperationCompiler(op, binding, effects, guards)
    segments = tuple(compiler.steps(seg.steps) if seg.steps else _nothing for seg in op.segments)
    admits = binding.move(op.entry.role, op.entry.trigger)[0] if op.entry is not None else _always
    return CompiledOperation(op, segments, admits)


class _OperationCompiler:
    """Turns one operation's steps into closures. Each closure captures the
    handlers it calls (never this compiler), so a call pays only them."""

    def __init__(
        self,
        op: OperationSpec,
        binding: Binding,
        effects: Mapping[str, Callable[[Any], None]],
        guards: Mapping[str, Callable[[Any], bool]],
    ) -> None:
        self.op = op
        self.binding = binding
        self.effects = effects
        self.guards = guards
        self.try_move: Callable[[str, str], Callable[[Any], bool]] | None = getattr(binding, "try_move", None)

    def steps(self, seq: tuple[Step, ...]) -> Run:
        runs = tuple(self.step(s) for s in seq)
        if len(runs) == 1:
            return runs[0]

        def run_all(ctx: Any) -> None:
            for r in runs:
                r(ctx)

        return run_all

    def step(self, s: Step) -> Run:
        if isinstance(s, Fire):
            return self.fire(s) if self.try_move is None else self.attempt(s, self.try_move)
        if isinstance(s, Do):
            if s.effect not in self.effects:
                raise SpecError(f"operation {self.op.name}: effect {s.effect!r} has no handler")
            return self.effects[s.effect]
        if isinstance(s, When):
            return self.when(s)
        if isinstance(s, FirstOf):
            return self.first_of(s)
        if isinstance(s, Couple):
            return self.binding.coupling(s.role, s.coupling)
        raise TypeError(s)  # pragma: no cover - the parser builds only the forms above

    def attempt(self, s: Fire, try_move: Callable[[str, str], Callable[[Any], bool]]) -> Run:
        """A move through the binding's ``try_move``: one atomic check-and-fire."""
        attempt = try_move(s.role, s.trigger)
        if s.optional:
            return attempt  # type: ignore[return-value]  # its bool is ignored
        name, what = self.op.name, s.label

        def must_now(ctx: Any) -> None:
            if not attempt(ctx):
                raise ProtocolViolation(f"operation {name}: {what} is not enabled for {ctx!r}")

        return must_now

    def fire(self, s: Fire) -> Run:
        """A move through the binding's ``move``: ``enabled``, then ``fire``."""
        enabled, fire = self.binding.move(s.role, s.trigger)
        if s.optional:

            def maybe(ctx: Any) -> None:
                if enabled(ctx):
                    fire(ctx)

            return maybe
        name, label = self.op.name, s.label

        def must(ctx: Any) -> None:
            if not enabled(ctx):
                raise ProtocolViolation(f"operation {name}: {label} is not enabled for {ctx!r}")
            fire(ctx)

        return must

    def when(self, s: When) -> Run:
        if s.guard not in self.guards:
            raise SpecError(f"operation {self.op.name}: guard {s.guard!r} has no handler")
        g, neg = self.guards[s.guard], s.negate
        then = self.steps(s.then) if s.then else None
        orelse = self.steps(s.orelse) if s.orelse else None

        def when(ctx: Any) -> None:
            if bool(g(ctx)) != neg:
                if then is not None:
                    then(ctx)
            elif orelse is not None:
                orelse(ctx)

        return when

    def first_of(self, s: FirstOf) -> Run:
        alts: list[tuple[Callable[[Any], bool], Run | None]] = []
        for alt in s.alternatives:
            head = alt[0] if alt else None
            test = self.binding.move(head.role, head.trigger)[0] if isinstance(head, Fire) else _always
            alts.append((test, self.steps(alt) if alt else None))

        def first_of(ctx: Any) -> None:
            for test, run in alts:
                if test(ctx):
                    if run is not None:
                        run(ctx)
                    return

        return first_of


def compile_protocol(
    spec: ProtocolSpec,
    binding: Binding,
    effects: Mapping[str, Callable[[Any], None]],
    guards: Mapping[str, Callable[[Any], bool]],
    *,
    only: Sequence[str] | None = None,
) -> dict[str, CompiledOperation]:
    """``compile_operation`` for every operation (or those in ``only``)."""
    names = spec.ops if only is None else only
    unknown = [n for n in names if n not in spec.ops]
    if unknown:
        raise SpecError(f"{spec.origin}: no operations {unknown}")
    return {n: compile_operation(spec.ops[n], binding, effects, guards) for n in names}
