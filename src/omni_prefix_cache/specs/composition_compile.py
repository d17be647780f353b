"""Compile the composition's operations (``specs.composition_loader``) into
plain closures over a ``Binding`` (the runtime's, the model checker's or a
test's handlers), so no YAML is interpreted per call.

One compile pass per operation. Each step resolves its handlers once and
yields two closures from them: ``one(ctx)`` runs the step for one instance,
``many(batch)`` for a ``specs.batch.Batch`` of instances (the writes of one
step, the tasks one committer pass claimed). The batch closure is derived
from the same resolved step: a move fires for every item through the
binding's ``try_move_many`` / ``move_many`` where it has them (else item by
item through the per-instance attempt), an effect runs once through its
batch handler where one is given (else per item), and ``when`` /
``first_of`` partition the batch by the guard or by the first enabled
alternative. Per item the batch run is the per-instance run: instances of
one operation do not share a component, so running step 1 for all items,
then step 2, ends where running every item to the end in turn ends. A
required move not enabled for an item, or a handler raising for it, drops
that item with its error (see ``Batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_prefix_cache.specs.batch import Batch, BatchRun, MaskMany, attempt_each, guarded_each, partitioned
from omni_prefix_cache.specs.composition_grammar import Couple, Do, Fire, FirstOf, OperationSpec, Segment, Step, When
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
    its alternatives with ``enabled``. For batches, ``try_move_many(role,
    trigger)`` returns ``attempt_many(items)`` (per item True, False when not
    enabled, or the exception its move raised) and ``move_many(role,
    trigger)`` returns ``(enabled_many, fire_many)``; without them a batch
    moves item by item.
    """

    def move(self, role: str, trigger: TriggerName) -> tuple[Callable[[Any], bool], Callable[[Any], None]]: ...

    def coupling(self, role: str, name: str) -> Callable[[Any], None]: ...


Run = Callable[[Any], None]
Pred = Callable[[Any], bool]
AttemptMany = Callable[[list[Any]], list[bool | BaseException]]


class ProtocolViolation(SpecError):
    """An operation tried a move its spec lists but the state does not allow."""


@dataclass(frozen=True, eq=False, slots=True)
class CompiledOperation:
    """An operation bound to an executor, segment by segment: ``segments[i]``
    runs segment ``i`` for one context, ``batches[i]`` for a ``Batch`` (a
    wait segment compiles to a no-op: the executor performs waits itself,
    see ``spec.segments[i].wait``). ``admits`` / ``admits_many``: the entry
    move's check (always true without one). Executors run segments by name
    through ``specs.runner.SegmentRunner``; ``at(name)`` is the index."""

    spec: OperationSpec
    segments: tuple[Run, ...]
    batches: tuple[BatchRun, ...]
    admits: Pred
    admits_many: MaskMany
    index: Mapping[str, int] = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def at(self, segment: str) -> int:
        """The index of the segment named ``segment`` (KeyError naming the
        operation's segments when it has none)."""
        try:
            return self.index[segment]
        except KeyError:
            raise KeyError(f"operation {self.spec.name} has no segment {segment!r} ({list(self.index)})") from None


def _always(ctx: Any) -> bool:
    return True


def _all(items: list[Any]) -> list[bool]:
    return [True] * len(items)


def _nothing(ctx: Any) -> None:
    return None


def compile_operation(
    op: OperationSpec,
    binding: Binding,
    effects: Mapping[str, Run],
    guards: Mapping[str, Pred],
    *,
    batch_effects: Mapping[str, BatchRun] | None = None,
    batch_guards: Mapping[str, MaskMany] | None = None,
) -> CompiledOperation:
    """Bind ``op`` to ``binding`` and the effect/guard handlers.
    ``batch_effects[name](batch)`` runs an effect once for a whole batch (it
    drops the items it fails itself); ``batch_guards[name](items)`` answers a
    guard for every item at once (it must not raise). A handler missing from
    the mappings raises SpecError now, not at the first call."""
    c = _OperationCompiler(op, binding, effects, guards, batch_effects or {}, batch_guards or {})
    pairs = [c.segment(seg) for seg in op.segments]
    if op.entry is not None:
        admits = binding.move(op.entry.role, op.entry.trigger)[0]
        admits_many = c.mask_many(op.entry)
    else:
        admits, admits_many = _always, _all
    return CompiledOperation(
        op,
        tuple(one for one, _ in pairs),
        tuple(many for _, many in pairs),
        admits,
        admits_many,
        {seg.name: i for i, seg in enumerate(op.segments)},
    )


class _OperationCompiler:
    """Turns one operation's steps into ``(one, many)`` closure pairs. Each
    closure captures the handlers it calls (never this compiler), so a call
    pays only them."""

    def __init__(
        self,
        op: OperationSpec,
        binding: Binding,
        effects: Mapping[str, Run],
        guards: Mapping[str, Pred],
        batch_effects: Mapping[str, BatchRun],
        batch_guards: Mapping[str, MaskMany],
    ) -> None:
        self.op = op
        self.binding = binding
        self.effects = effects
        self.guards = guards
        self.batch_effects = batch_effects
        self.batch_guards = batch_guards
        self.try_move: Callable[[str, str], Pred] | None = getattr(binding, "try_move", None)
        self.where = op.name  # what a violation names: the operation and the segment being compiled

    def segment(self, seg: Segment) -> tuple[Run, BatchRun]:
        self.where = f"{self.op.name} ({seg.name})"
        return self.steps(seg.steps) if seg.steps else (_nothing, _nothing)

    def steps(self, seq: tuple[Step, ...]) -> tuple[Run, BatchRun]:
        pairs = tuple(self.step(s) for s in seq)
        if len(pairs) == 1:
            return pairs[0]
        ones = tuple(one for one, _ in pairs)
        manys = tuple(many for _, many in pairs)

        def run_all(ctx: Any) -> None:
            for r in ones:
                r(ctx)

        def run_all_many(batch: Batch) -> None:
            for r in manys:
                if not batch.items:
                    return
                r(batch)

        return run_all, run_all_many

    def step(self, s: Step) -> tuple[Run, BatchRun]:
        if isinstance(s, Fire):
            return self.fire(s)
        if isinstance(s, Do):
            return self.do(s)
        if isinstance(s, When):
            return self.when(s)
        if isinstance(s, FirstOf):
            return self.first_of(s)
        if isinstance(s, Couple):
            coupling = self.binding.coupling(s.role, s.coupling)

            def couple_many(batch: Batch) -> None:
                guarded_each(batch, coupling)

            return coupling, couple_many
        raise TypeError(s)  # pragma: no cover - the parser builds only the forms above

    # ------------------------------------------------------------ moves

    def attempt(self, s: Fire) -> Pred:
        """``attempt(ctx) -> bool``: fire where enabled, atomically where the
        binding has ``try_move``, else ``enabled`` then ``fire``."""
        if self.try_move is not None:
            return self.try_move(s.role, s.trigger)
        enabled, fire = self.binding.move(s.role, s.trigger)

        def attempt(ctx: Any) -> bool:
            if not enabled(ctx):
                return False
            fire(ctx)
            return True

        return attempt

    def fire(self, s: Fire) -> tuple[Run, BatchRun]:
        attempt = self.attempt(s)
        name, label, optional = self.where, s.label, s.optional
        one: Run
        if optional:
            one = attempt  # type: ignore[assignment]  # its bool is ignored
        else:

            def one(ctx: Any) -> None:
                if not attempt(ctx):
                    raise ProtocolViolation(f"operation {name}: {label} is not enabled for {ctx!r}")

        many_attempt = getattr(self.binding, "try_move_many", None)
        attempt_many: AttemptMany = (
            many_attempt(s.role, s.trigger) if many_attempt is not None else attempt_each(attempt)
        )

        def many(batch: Batch) -> None:
            results = attempt_many(batch.items)
            if results.count(True) == len(results):
                return
            bad = [i for i, r in enumerate(results) if r is not True and not (optional and r is False)]
            if batch.truncate:
                bad = bad[:1]  # the first error ends the batch; later items are cut
            for i in reversed(bad):  # backwards: popping keeps earlier indices valid
                r = results[i]
                error = (
                    r
                    if isinstance(r, BaseException)
                    else ProtocolViolation(f"operation {name}: {label} is not enabled for {batch.items[i]!r}")
                )
                batch.drop(i, error)

        return one, many

    def mask_many(self, s: Fire) -> MaskMany:
        """``enabled`` of ``s`` for every item (``move_many`` where the
        binding has it)."""
        many = getattr(self.binding, "move_many", None)
        if many is not None:
            return many(s.role, s.trigger)[0]  # type: ignore[no-any-return]
        enabled = self.binding.move(s.role, s.trigger)[0]
        return lambda items: [bool(enabled(x)) for x in items]

    # ------------------------------------------------------------ effects, guards

    def do(self, s: Do) -> tuple[Run, BatchRun]:
        effect = self.effects.get(s.effect)
        batched = self.batch_effects.get(s.effect)
        if effect is None:
            raise SpecError(f"operation {self.op.name}: effect {s.effect!r} has no handler")
        if batched is not None:
            return effect, batched

        def each(batch: Batch) -> None:
            guarded_each(batch, effect)

        return effect, each

    def when(self, s: When) -> tuple[Run, BatchRun]:
        if s.guard not in self.guards:
            raise SpecError(f"operation {self.op.name}: guard {s.guard!r} has no handler")
        g, neg = self.guards[s.guard], s.negate
        g_many = self.batch_guards.get(s.guard)
        then = self.steps(s.then) if s.then else None
        orelse = self.steps(s.orelse) if s.orelse else None
        then_one, orelse_one = then[0] if then else None, orelse[0] if orelse else None
        then_many, orelse_many = then[1] if then else None, orelse[1] if orelse else None

        def when(ctx: Any) -> None:
            if bool(g(ctx)) != neg:
                if then_one is not None:
                    then_one(ctx)
            elif orelse_one is not None:
                orelse_one(ctx)

        def when_many(batch: Batch) -> None:
            picks = g_many(batch.items) if g_many is not None else _guarded(batch, g)
            yes = [x for x, p in zip(batch.items, picks) if bool(p) != neg]
            no = [x for x, p in zip(batch.items, picks) if bool(p) == neg] if len(yes) < len(picks) else []
            partitioned(batch, [(yes, then_many), (no, orelse_many)])

        return when, when_many

    def first_of(self, s: FirstOf) -> tuple[Run, BatchRun]:
        alts: list[tuple[Pred, MaskMany | None, Run | None, BatchRun | None]] = []
        for alt in s.alternatives:
            head = alt[0] if alt else None
            runs = self.steps(alt) if alt else None
            if isinstance(head, Fire):
                test, mask = self.binding.move(head.role, head.trigger)[0], self.mask_many(head)
            else:
                test, mask = _always, None
            alts.append((test, mask, runs[0] if runs else None, runs[1] if runs else None))

        def first_of(ctx: Any) -> None:
            for test, _, run, _ in alts:
                if test(ctx):
                    if run is not None:
                        run(ctx)
                    return

        def first_of_many(batch: Batch) -> None:
            parts: list[tuple[list[Any], BatchRun | None]] = []
            rest = batch.items
            for _, mask, _, run in alts:
                if not rest:
                    break
                if mask is None:
                    parts.append((rest, run))
                    rest = []
                    break
                picks = mask(rest)
                parts.append(([x for x, m in zip(rest, picks) if m], run))
                rest = [x for x, m in zip(rest, picks) if not m]
            partitioned(batch, parts)

        return first_of, first_of_many


def _guarded(batch: Batch, run: Callable[[Any], Any]) -> list[Any]:
    """``run(item)`` for each item; an item that raises leaves the batch.
    Returns the results of the items still in it."""
    out: list[Any] = []
    guarded_each(batch, lambda item: out.append(run(item)))
    return out


def compile_protocol(
    spec: ProtocolSpec,
    binding: Binding,
    effects: Mapping[str, Run],
    guards: Mapping[str, Pred],
    *,
    only: Sequence[str] | None = None,
) -> dict[str, CompiledOperation]:
    """``compile_operation`` for every operation (or those in ``only``)."""
    names = spec.ops if only is None else only
    unknown = [n for n in names if n not in spec.ops]
    if unknown:
        raise SpecError(f"{spec.origin}: no operations {unknown}")
    return {n: compile_operation(spec.ops[n], binding, effects, guards) for n in names}
