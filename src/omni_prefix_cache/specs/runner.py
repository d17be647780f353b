"""The one way a compiled operation runs: segment by segment, by name, each
under the lock its spec declares.

An executor builds one ``SegmentRunner`` with its lock table (how it takes
each of the spec's locks, for one context and for a batch) and its waits
(how it blocks on a wait segment's ``of``), then runs::

    runner.run(op, "merge", call)              # one segment
    runner.run_all(op, task)                   # every segment, entry checked
    runner.run_batch(op, tasks, stop="publish")  # segments for a Batch

Other threads interleave only between segments, as the spec says. What a
segment needs (its closure, lock, check or waiter) is resolved once per
(operation, segment) and kept: a run pays a dict lookup, the lock and the
closure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition_compile import CompiledOperation
from omni_prefix_cache.specs.loader import SpecError

__all__ = ["CALLER_HOLDS", "LockRule", "SegmentRunner"]

Run = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class LockRule:
    """How an executor takes one lock of the spec: ``lock``, a fixed lock
    object, or ``take(ctx)``, the context's own (a task's lock); for a batch,
    the fixed locks ``many`` in order (default: ``lock``; none for a rule
    with ``take``: a batch's moves lock each item themselves). ``check(ctx)``
    runs once it is held, before the segment (e.g. the manager's closed flag:
    it raises and the segment never runs)."""

    lock: Any = None
    take: Callable[[Any], Any] | None = None
    many: tuple[Any, ...] | None = None
    check: Run | None = None

    @property
    def for_batch(self) -> tuple[Any, ...]:
        if self.many is not None:
            return self.many
        return () if self.lock is None else (self.lock,)


_UNLOCKED = LockRule()

# A segment as ``run`` runs it: its closure, its fixed lock (None: none, or
# ``take``'s), ``take`` (None: a fixed lock or none), the check once held
# (None: none) and, for a wait segment, the waiter (None: not one).
_Plan = tuple[Run, Any, Callable[[Any], Any] | None, Run | None, Run | None]
# A segment as ``run_batch`` runs it: its index, the locks it takes in order
# and the check once they are held.
_BatchPlan = tuple[int, tuple[Any, ...], Run | None]


class SegmentRunner:
    """Runs compiled operations' segments by name under the locks they
    declare. ``locks`` maps a spec lock name to its ``LockRule``; ``none``
    (and any lock an executor leaves out) takes nothing, so an executor
    lists only the locks it must take itself. ``waits`` maps a wait
    segment's ``of`` to the call that blocks until its event (and raises
    what the segment's ``raises`` guard makes it raise). ``unchecked``:
    operations (``"name"``) or segments (``"name.segment"``) that skip the
    lock rules' checks (the manager's ``abandon_save``, which must undo a
    failed save after shutdown too)."""

    __slots__ = ("_locks", "_waits", "_unchecked", "_plans", "_batch_plans", "_segment_plans")

    def __init__(
        self,
        locks: Mapping[str, LockRule] | None = None,
        waits: Mapping[str, Run] | None = None,
        *,
        unchecked: frozenset[str] = frozenset(),
    ) -> None:
        self._locks = dict(locks or {})
        self._waits = dict(waits or {})
        self._unchecked = unchecked
        self._plans: dict[tuple[CompiledOperation, str], _Plan] = {}
        self._batch_plans: dict[tuple[CompiledOperation, str | None, str | None], tuple[_BatchPlan, ...]] = {}
        self._segment_plans: dict[tuple[CompiledOperation, str], _BatchPlan] = {}

    def _check(self, op: CompiledOperation, segment: str) -> Run | None:
        """The check segment ``segment`` of ``op`` runs once its lock is held."""
        rule = self._locks.get(op.spec.segments[op.at(segment)].lock, _UNLOCKED)
        unchecked, name = self._unchecked, op.spec.name
        if rule.check is None or name in unchecked or f"{name}.{segment}" in unchecked:
            return None
        return rule.check

    def _plan(self, op: CompiledOperation, segment: str) -> _Plan:
        """What ``run`` does for ``segment`` of ``op``, resolved once."""
        i = op.at(segment)
        seg = op.spec.segments[i]
        if seg.wait:
            waiter = self._waits.get(seg.of or "")
            if waiter is None:
                raise SpecError(f"operation {op.spec.name}: this executor cannot wait for {seg.wait} of {seg.of!r}")
            plan: _Plan = (op.segments[i], None, None, None, waiter)
        else:
            rule = self._locks.get(seg.lock, _UNLOCKED)
            plan = (op.segments[i], rule.lock, rule.take, self._check(op, segment), None)
        self._plans[(op, segment)] = plan
        return plan

    def run(self, op: CompiledOperation, segment: str, ctx: Any) -> None:
        """Segment ``segment`` of ``op`` for ``ctx``, under its lock (a wait
        segment blocks through ``waits``). Raises what the segment raises."""
        run, lock, take, check, wait = self._plans.get((op, segment)) or self._plan(op, segment)
        if wait is not None:
            wait(ctx)
            return
        if lock is None:
            if take is None:
                if check is not None:
                    check(ctx)
                run(ctx)
                return
            lock = take(ctx)
        with lock:
            if check is not None:
                check(ctx)
            run(ctx)

    def held(self, op: CompiledOperation, segment: str, ctx: Any) -> _Hold:
        """Hold segment ``segment``'s lock (its check run) and give its
        compiled closure: for a segment whose steps two executors run in one
        hold (save's ``register``: the writes, per task, then the manager's
        share), the caller runs the other executor's part, then this one."""
        run, lock, take, check, _ = self._plans.get((op, segment)) or self._plan(op, segment)
        if lock is None and take is not None:
            lock = take(ctx)
        return _Hold(lock, check, ctx, run)

    def run_all(self, op: CompiledOperation, ctx: Any) -> bool:
        """Every segment of ``op`` for ``ctx``, in order; the entry move is
        checked under the first segment's lock. False (nothing run) when it
        does not admit ``ctx``."""
        run = self.run
        names = op.spec.segment_names
        if op.spec.entry is not None:
            first = names[0]
            if self._admitted(op, first, ctx) is False:
                return False
            names = names[1:]
        for name in names:
            run(op, name, ctx)
        return True

    def _admitted(self, op: CompiledOperation, segment: str, ctx: Any) -> bool:
        """The first segment, run only if the entry move admits ``ctx`` (checked under its lock)."""
        run, lock, take, check, wait = self._plans.get((op, segment)) or self._plan(op, segment)
        if wait is not None:
            wait(ctx)
            return True
        if lock is None:
            lock = _NoLock if take is None else take(ctx)
        with lock:
            if check is not None:
                check(ctx)
            if not op.admits(ctx):
                return False
            run(ctx)
        return True

    def _batch_plan(self, op: CompiledOperation, start: str | None, stop: str | None) -> tuple[_BatchPlan, ...]:
        first = 0 if start is None else op.at(start)
        last = len(op.segments) if stop is None else op.at(stop)
        out: list[_BatchPlan] = []
        for i in range(first, last):
            seg = op.spec.segments[i]
            if seg.wait:
                raise SpecError(f"operation {op.spec.name}: a batch does not run wait segment {seg.name!r}")
            out.append((i, self._locks.get(seg.lock, _UNLOCKED).for_batch, self._check(op, seg.name)))
        plan = self._batch_plans[(op, start, stop)] = tuple(out)
        return plan

    def run_batch(
        self,
        op: CompiledOperation,
        items: list[Any],
        *,
        start: str | None = None,
        stop: str | None = None,
        truncate: bool = False,
    ) -> Batch:
        """Segments ``[start, stop)`` of ``op`` (by name; default: all) for a
        batch of ``items``, each segment once for the whole batch under its
        lock rule's batch locks. From the first segment the entry move is
        checked under the first locks: an item it does not admit is skipped,
        as ``run_all`` skips it. A batch of one runs the per-instance
        closures (the same steps, without partitions and masks). Returns the
        batch: what went on, and what left it (``errors``, and with
        ``truncate`` the ``cut`` after the first)."""
        batch = Batch(list(items), truncate=truncate)
        plan = self._batch_plans.get((op, start, stop)) or self._batch_plan(op, start, stop)
        entry = op.spec.entry is not None
        for i, locks, check in plan:
            _locked_segment(op, i, batch, locks, check, entry and i == 0)
            if not batch.items:
                break
        return batch

    def run_segment_batch(self, op: CompiledOperation, segment: str, batch: Batch) -> None:
        """Segment ``segment`` for an existing ``batch`` (its items and errors
        carry over), under its lock rule's batch locks; no entry check."""
        i, locks, check = self._segment_plans.get((op, segment)) or self._segment_plan(op, segment)
        _locked_segment(op, i, batch, locks, check, False)

    def _segment_plan(self, op: CompiledOperation, segment: str) -> _BatchPlan:
        """One segment for a batch (kept apart from ``run_batch``'s ranges, which start at a segment too)."""
        i = op.at(segment)
        plan = self._segment_plans[(op, segment)] = (
            i,
            self._locks.get(op.spec.segments[i].lock, _UNLOCKED).for_batch,
            self._check(op, segment),
        )
        return plan


class _NoLockType:
    """A lock that is no lock (a segment under ``none``)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NoLock = _NoLockType()


class _Hold:
    """``SegmentRunner.held``: the lock held (and its check passed) from
    ``__enter__``, which gives the segment's closure, to ``__exit__``."""

    __slots__ = ("_lock", "_check", "_ctx", "_run")

    def __init__(self, lock: Any, check: Run | None, ctx: Any, run: Run) -> None:
        self._lock, self._check, self._ctx, self._run = lock or _NoLock, check, ctx, run

    def __enter__(self) -> Run:
        self._lock.__enter__()
        if self._check is not None:
            try:
                self._check(self._ctx)
            except BaseException:
                self._lock.__exit__(None, None, None)
                raise
        return self._run

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)


def _locked_segment(
    op: CompiledOperation, index: int, batch: Batch, locks: tuple[Any, ...], check: Run | None, entry: bool
) -> None:
    """Segment ``index`` for ``batch`` under ``locks`` (taken in order)."""
    if not locks:
        _segment(op, index, batch, check, entry)
    elif len(locks) == 1:
        with locks[0]:
            _segment(op, index, batch, check, entry)
    else:
        first, second = locks
        with first, second:
            _segment(op, index, batch, check, entry)


def _segment(op: CompiledOperation, index: int, batch: Batch, check: Run | None, entry: bool) -> None:
    """Segment ``index`` for ``batch`` (its locks held): the entry move's
    mask first where ``entry``, then the batch closure, or for a batch of
    one the per-instance closure of the same segment. A move it refuses or
    a handler that raises drops the item with its exception, as the batch
    closure would."""
    if check is not None:
        check(batch)
    if entry:
        admitted = op.admits_many(batch.items)
        if not all(admitted):
            batch.items = [x for x, ok in zip(batch.items, admitted) if ok]
            if not batch.items:
                return
    if len(batch.items) != 1:
        op.batches[index](batch)
        return
    try:
        op.segments[index](batch.items[0])
    except Exception as exc:
        batch.drop(0, exc)


class _CallerHolds(SegmentRunner):
    """A runner that takes no lock and runs no wait: its caller already holds
    what every segment declares."""

    __slots__ = ()

    def run_all(self, op: CompiledOperation, ctx: Any) -> bool:
        if not op.admits(ctx):
            return False
        for segment in op.segments:
            segment(ctx)
        return True


# The runner of an executor whose caller already holds what every segment
# declares (the request layer's operations, under the state lock the facade
# took; the write ledger's drain; a model): it takes no lock itself.
CALLER_HOLDS: SegmentRunner = _CallerHolds()
