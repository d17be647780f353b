"""Compile an operation of the composition for a batch of instances.

``compile_operation`` (specs/composition_compile.py) runs an operation for one
context: a step's immediate writes then cost one pass through every segment
per request. ``compile_batch_operation`` compiles the same operation so that
each step runs once for a whole ``Batch`` of contexts (the writes of one
step, the tasks one committer pass claimed): a move fires for every item in
one call of the binding's ``move_many`` / ``try_move_many``, an effect runs
once through its batch handler, and ``when`` / ``first_of`` partition the
batch by their guard (its batch handler, where it has one) or by the first
enabled alternative.

Per item, the result is the per-instance run's: instances of one
operation do not share a component (each item moves its own task, position
and holder), so running step 1 for all items, then step 2, is the same as
running every item to the end in turn. Two things per item are kept:

- a required move that is not enabled for an item refuses that item with a
  ``ProtocolViolation`` (the per-instance run raised it for that instance);
- an item whose handler raises leaves the batch with its exception.

A binding may offer ``try_move_many(role, trigger)`` (``attempt_many``:
fire the move for every enabled item under whatever lock it needs; per item
True, False when not enabled, or the exception the item's move raised) and
``move_many(role, trigger)`` (``(enabled_many, fire_many)``); one without
them is batched item by item through ``move`` / ``try_move``.

Refused and raising items land in ``Batch.errors``. With ``truncate`` only
the earliest of them (in batch order) counts and every item after it is
``Batch.cut``: what a loop that stops at the first failing instance would
have left (the eager dispatch's rule), except that a cut item may already
have run the steps before the one that stopped the batch. An executor
decides what happens to errors and cut items afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.specs.composition import (
    Binding,
    Couple,
    Do,
    Fire,
    FirstOf,
    OperationSpec,
    ProtocolViolation,
    Step,
    When,
)
from omni_prefix_cache.specs.loader import SpecError, TriggerName

# attempt_many(items) -> per item: True (fired), False (not enabled) or the
# exception its move raised (the item's own failure; the others go on).
AttemptMany = Callable[[list[Any]], list[bool | BaseException]]
MaskMany = Callable[[list[Any]], list[bool]]
RunMany = Callable[[list[Any]], None]


@dataclass(eq=False, slots=True)
class Batch:
    """The instances one batched run moves, in order, and what left it.

    ``items``: still running. ``errors``: ``(item, exception)`` for each
    item refused by a move or raised by a handler. With ``truncate`` only
    the earliest such item (in the batch's first order) counts, as in a
    loop that stops there: it is the one error, and every item after it is
    ``cut`` (it never ran in that loop; here it may have run earlier steps).
    """

    items: list[Any]
    truncate: bool = False
    errors: list[tuple[Any, BaseException]] = field(default_factory=list)
    cut: list[Any] = field(default_factory=list)
    # The first order (truncate only; shared with sub-batches), and each
    # item's position in it once a failure needs it.
    order: list[Any] | None = None
    _rank: dict[int, int] | None = None

    def __post_init__(self) -> None:
        if self.truncate and self.order is None:
            self.order = list(self.items)

    @property
    def rank(self) -> dict[int, int]:
        if self._rank is None:
            assert self.order is not None
            self._rank = {id(x): i for i, x in enumerate(self.order)}
        return self._rank

    def drop(self, index: int, error: BaseException) -> None:
        """``items[index]`` leaves with ``error`` (with ``truncate``, see
        ``settle``)."""
        item = self.items.pop(index)
        self.errors.append((item, error))
        if self.truncate:
            self.settle()

    def settle(self) -> None:
        """Truncate: keep the earliest error; later failed and later running
        items are cut."""
        rank = self.rank
        first = min(rank[id(x)] for x, _ in self.errors)
        if len(self.errors) > 1:
            self.cut.extend(x for x, _ in self.errors if rank[id(x)] > first)
            self.errors = [(x, e) for x, e in self.errors if rank[id(x)] <= first]
        if self.items and rank[id(self.items[-1])] > first:
            self.cut.extend(x for x in self.items if rank[id(x)] > first)
            self.items = [x for x in self.items if rank[id(x)] < first]


BatchRun = Callable[[Batch], None]


@dataclass(frozen=True, eq=False, slots=True)
class CompiledBatchOperation:
    """An operation bound for batches: one closure per segment, each taking
    a ``Batch``; ``admits_many`` is the entry move's mask."""

    spec: OperationSpec
    segments: tuple[BatchRun, ...]
    admits_many: MaskMany


def _per_item_attempt(binding: Binding, role: str, trigger: TriggerName) -> AttemptMany:
    try_move = getattr(binding, "try_move", None)
    if try_move is not None:
        attempt = try_move(role, trigger)
    else:
        enabled, fire = binding.move(role, trigger)

        def attempt(x: Any) -> bool:
            if not enabled(x):
                return False
            fire(x)
            return True

    return attempt_each(attempt)


def attempt_each(attempt: Callable[[Any], bool]) -> AttemptMany:
    """``attempt_many`` from a per-item ``attempt``: one call per item, and
    an item whose move raises gets its exception (the others go on)."""

    def attempt_many(items: list[Any]) -> list[bool | BaseException]:
        out: list[bool | BaseException] = []
        for x in items:
            try:
                out.append(bool(attempt(x)))
            except Exception as exc:
                out.append(exc)
        return out

    return attempt_many


def _attempt_many(binding: Binding, role: str, trigger: TriggerName) -> AttemptMany:
    many = getattr(binding, "try_move_many", None)
    if many is not None:
        return many(role, trigger)  # type: ignore[no-any-return]
    return _per_item_attempt(binding, role, trigger)


def _mask_many(binding: Binding, role: str, trigger: TriggerName) -> MaskMany:
    many = getattr(binding, "move_many", None)
    if many is not None:
        return many(role, trigger)[0]  # type: ignore[no-any-return]
    enabled = binding.move(role, trigger)[0]
    return lambda items: [bool(enabled(x)) for x in items]


def _guarded(batch: Batch, run: Callable[[Any], Any]) -> list[Any]:
    """``run(item)`` for each item; an item that raises leaves the batch.
    Returns the results of the items still in it."""
    out: list[Any] = []
    guarded_each(batch, lambda item: out.append(run(item)))
    return out


def guarded_each(batch: Batch, run: Callable[[Any], Any]) -> None:
    """``run(item)`` for each item, results dropped (an effect's handler
    per item); an item that raises leaves the batch."""
    done = 0
    while done < len(batch.items):
        try:
            for item in batch.items[done:] if done else batch.items:
                run(item)
                done += 1
        except Exception as exc:
            batch.drop(done, exc)


def compile_batch_operation(
    op: OperationSpec,
    binding: Binding,
    effects: Mapping[str, Callable[[Any], None]],
    guards: Mapping[str, Callable[[Any], bool]],
    *,
    batch_effects: Mapping[str, Callable[[Batch], None]] | None = None,
    batch_guards: Mapping[str, MaskMany] | None = None,
) -> CompiledBatchOperation:
    """Bind ``op`` for batches. ``batch_effects[name](batch)`` runs an
    effect once for the whole batch (it drops the items it fails itself);
    an effect without one runs per item. ``batch_guards[name](items)``
    evaluates a guard for every item at once (it must not raise; per item
    the guard's own answer); a guard without one runs per item. A handler
    missing from the mappings raises SpecError now, not at the first call."""
    batch_effects = dict(batch_effects or {})
    batch_guards = dict(batch_guards or {})

    def steps(seq: tuple[Step, ...]) -> BatchRun:
        runs = tuple(step(s) for s in seq)
        if len(runs) == 1:
            return runs[0]

        def run_all(batch: Batch) -> None:
            for r in runs:
                if not batch.items:
                    return
                r(batch)

        return run_all

    def step(s: Step) -> BatchRun:
        if isinstance(s, Fire):
            attempt = _attempt_many(binding, s.role, s.trigger)
            optional, label = s.optional, s.label

            def fire(batch: Batch) -> None:
                results = attempt(batch.items)
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
                        else ProtocolViolation(f"operation {op.name}: {label} is not enabled for {batch.items[i]!r}")
                    )
                    batch.drop(i, error)

            return fire
        if isinstance(s, Do):
            if s.effect in batch_effects:
                return batch_effects[s.effect]
            if s.effect not in effects:
                raise SpecError(f"operation {op.name}: effect {s.effect!r} has no handler")
            effect = effects[s.effect]

            def each(batch: Batch) -> None:
                guarded_each(batch, effect)

            return each
        if isinstance(s, When):
            if s.guard not in guards:
                raise SpecError(f"operation {op.name}: guard {s.guard!r} has no handler")
            g, neg = guards[s.guard], s.negate
            g_many = batch_guards.get(s.guard)
            then = steps(s.then) if s.then else None
            orelse = steps(s.orelse) if s.orelse else None

            def when(batch: Batch) -> None:
                picks = g_many(batch.items) if g_many is not None else _guarded(batch, g)
                yes = [x for x, p in zip(batch.items, picks) if bool(p) != neg]
                no = [x for x, p in zip(batch.items, picks) if bool(p) == neg] if len(yes) < len(picks) else []
                _partitioned(batch, [(yes, then), (no, orelse)])

            return when
        if isinstance(s, FirstOf):
            alts: list[tuple[MaskMany | None, BatchRun | None]] = []
            for alt in s.alternatives:
                head = alt[0] if alt else None
                test = _mask_many(binding, head.role, head.trigger) if isinstance(head, Fire) else None
                alts.append((test, steps(alt) if alt else None))

            def first_of(batch: Batch) -> None:
                parts: list[tuple[list[Any], BatchRun | None]] = []
                rest = batch.items
                for test, run in alts:
                    if not rest:
                        break
                    if test is None:
                        parts.append((rest, run))
                        rest = []
                        break
                    mask = test(rest)
                    parts.append(([x for x, m in zip(rest, mask) if m], run))
                    rest = [x for x, m in zip(rest, mask) if not m]
                _partitioned(batch, parts)

            return first_of
        if isinstance(s, Couple):
            coupling = binding.coupling(s.role, s.coupling)

            def couple(batch: Batch) -> None:
                _guarded(batch, coupling)

            return couple
        raise TypeError(s)  # pragma: no cover - the parser builds only the forms above

    def nothing(batch: Batch) -> None:
        return None

    segments = tuple(steps(seg.steps) if seg.steps else nothing for seg in op.segments)
    admits = _mask_many(binding, op.entry.role, op.entry.trigger) if op.entry is not None else _all
    return CompiledBatchOperation(op, segments, admits)


def run_segment(one: Callable[[Any], None], many: BatchRun, batch: Batch) -> None:
    """One segment of an operation for ``batch``: ``many`` (the batched
    closure), or for a batch of one ``one`` (the per-instance closure of
    the same segment: the same moves, guards and effects, without the
    partitioning and masks). A move ``one`` refuses or a handler that
    raises drops the item with its exception, as ``many`` would."""
    if len(batch.items) != 1:
        many(batch)
        return
    try:
        one(batch.items[0])
    except Exception as exc:
        batch.drop(0, exc)


def _all(items: list[Any]) -> list[bool]:
    return [True] * len(items)


def _partitioned(batch: Batch, parts: list[tuple[list[Any], BatchRun | None]]) -> None:
    """Run each part's steps on its sub-batch; the batch keeps, in its own
    order, the items no part dropped (items in no part stay untouched)."""
    if len(parts) == 1 and len(parts[0][0]) == len(batch.items):
        run = parts[0][1]
        if run is not None:
            run(batch)
        return
    gone: set[int] = set()
    for items, run in parts:
        if run is None or not items:
            continue
        sub = Batch(list(items), truncate=batch.truncate, order=batch.order)
        run(sub)
        if sub.errors or sub.cut:
            batch.errors.extend(sub.errors)
            batch.cut.extend(sub.cut)
            gone.update(id(x) for x, _ in sub.errors)
            gone.update(id(x) for x in sub.cut)
    if not gone:
        return
    batch.items = [x for x in batch.items if id(x) not in gone]
    if batch.truncate and batch.errors:
        batch.settle()
