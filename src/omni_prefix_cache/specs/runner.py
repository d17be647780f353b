"""The one way a compiled operation runs: segment by segment, by name, each
under the lock its spec declares.

An executor builds one ``SegmentRunner`` with its lock table (how it takes
each of the spec's locks, for one context and for a batch) and its waits
(how it blocks on a wait segment's ``of``), then runs::

    runner.run(op, "merge", call)              # one segment
    runner.run_all(op, task)                   # every segment, entry checked
    runner.run_batch(op, tasks, stop="publish")  # segments for a Batch

Other threads interleave only between segments, as the spec says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.composition_compile import CompiledOperation
from omni_prefix_cache.specs.loader import SpecError

__all__ = ["CALLER_HOLDS", "Held", "LockRule", "SegmentRunner", "both"]

_NO_LOCK = contextlib.nullcontext()


def _unlocked(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    return _NO_LOCK


@dataclass(frozen=True, slots=True)
class LockRule:
    """How an executor takes one lock of the spec. ``take(ctx)`` returns the
    context manager for one context (a lock object is one); ``take_many(batch)``
    for a batch (default: nothing: the batch's moves lock themselves).
    ``check(ctx)`` runs once it is held, before the segment (e.g. the
    manager's closed flag: it raises and the segment never runs)."""

    take: Callable[[Any], contextlib.AbstractContextManager[Any]]
    take_many: Callable[[Any], contextlib.AbstractContextManager[Any]] = _unlocked
    check: Callable[[Any], None] | None = None

    @classmethod
    def of(cls, lock: Any, *, many: Any = None, check: Callable[[Any], None] | None = None) -> LockRule:
        """A rule that takes the fixed ``lock`` (and ``many`` for a batch;
        default the same lock)."""
        for_many = lock if many is None else many
        return cls(lambda ctx: lock, lambda batch: for_many, check)


class Held:
    """Two locks taken in order and released in reverse, as one context
    manager (reusable: it keeps no state of its own)."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: Any, second: Any) -> None:
        self._first = first
        self._second = second

    def __enter__(self) -> None:
        self._first.acquire()
        try:
            self._second.acquire()
        except BaseException:
            self._first.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._second.release()
        self._first.release()


def both(first: Any, second: Any) -> Held:
    """``first`` then ``second`` (see ``Held``)."""
    return Held(first, second)


_UNLOCKED = LockRule(_unlocked)

Run = Callable[[Any], None]
# A segment as ``run`` runs it: its closure, how its lock is taken, the check
# once held (None: none) and, for a wait segment, the waiter (None: not one).
_Plan = tuple[Run, Callable[[Any], contextlib.AbstractContextManager[Any]], Run | None, Run | None]


class _Hold:
    """``SegmentRunner.held``: the lock held (and its check passed) from
    ``__enter__``, which gives the segment's closure, to ``__exit__``."""

    __slots__ = ("_lock", "_check", "_ctx", "_run")

    def __init__(self, lock: contextlib.AbstractContextManager[Any], check: Run | None, ctx: Any, run: Run) -> None:
        self._lock, self._check, self._ctx, self._run = lock, check, ctx, run

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

    __slots__ = ("_locks", "_waits", "_unchecked", "_plans")

    def __init__(
        self,
        locks: Mapping[str, LockRule] | None = None,
        waits: Mapping[str, Callable[[Any], None]] | None = None,
        *,
        unchecked: frozenset[str] = frozenset(),
    ) -> None:
        self._locks = dict(locks or {})
        self._waits = dict(waits or {})
        self._unchecked = unchecked
        # (op, segment name) -> (closure, take, check or None, waiter or None), built on first use.
        self._plans: dict[tuple[CompiledOperation, str], _Plan] = {}

    def _rule(self, lock: str) -> LockRule:
        return self._locks.get(lock, _UNLOCKED)

    def _checks(self, op: CompiledOperation, segment: str) -> bool:
        unchecked, name = self._unchecked, op.spec.name
        return name not in unchecked and f"{name}.{segment}" not in unchecked

    def _wait(self, op: CompiledOperation, index: int, ctx: Any) -> None:
        seg = op.spec.segments[index]
        waiter = self._waits.get(seg.of or "")
        if waiter is None:
            raise SpecError(f"operation {op.spec.name}: this executor cannot wait for {seg.wait} of {seg.of!r}")
        waiter(ctx)

    def _plan(self, op: CompiledOperation, segment: str) -> _Plan:
        """What ``run`` does for ``segment`` of ``op``, resolved once."""
        i = op.at(segment)
        seg = op.spec.segments[i]
        if seg.wait:
            waiter = self._waits.get(seg.of or "")
            if waiter is None:
                raise SpecError(f"operation {op.spec.name}: this executor cannot wait for {seg.wait} of {seg.of!r}")
            plan: _Plan = (op.segments[i], _unlocked, None, waiter)
        else:
            rule = self._rule(seg.lock)
            plan = (op.segments[i], rule.take, rule.check if self._checks(op, segment) else None, None)
        self._plans[(op, segment)] = plan
        return plan

    def run(self, op: CompiledOperation, segment: str, ctx: Any) -> None:
        """Segment ``segment`` of ``op`` for ``ctx``, under its lock (a wait
        segment blocks through ``waits``). Raises what the segment raises."""
        run, take, check, wait = self._plans.get((op, segment)) or self._plan(op, segment)
        if wait is not None:
            wait(ctx)
            return
        with take(ctx):
            if check is not None:
                check(ctx)
            run(ctx)

    def held(self, op: CompiledOperation, segment: str, ctx: Any) -> contextlib.AbstractContextManager[Run]:
        """Hold segment ``segment``'s lock (its check run) and give its
        compiled closure: for a segment whose steps two executors run in one
        hold (save's ``register``: the writes, per task, then the manager's
        share), the caller runs the other executor's part, then this one."""
        run, take, check, _ = self._plans.get((op, segment)) or self._plan(op, segment)
        return _Hold(take(ctx), check, ctx, run)

    def run_all(self, op: CompiledOperation, ctx: Any) -> bool:
        """Every segment of ``op`` for ``ctx``, in order; the entry move is
        checked under the first segment's lock. False (nothing run) when it
        does not admit ``ctx``."""
        first = True
        for i, seg in enumerate(op.spec.segments):
            if seg.wait:
                self._wait(op, i, ctx)
                first = False
                continue
            rule = self._rule(seg.lock)
            with rule.take(ctx):
                if rule.check is not None and self._checks(op, seg.name):
                    rule.check(ctx)
                if first and not op.admits(ctx):
                    return False
                first = False
                op.segments[i](ctx)
        return True

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
        lock's ``take_many``. From the first segment the entry move is
        checked under the first lock: an item it does not admit is skipped,
        as ``run_all`` skips it. A batch of one runs the per-instance
        closures (the same steps, without partitions and masks). Returns the
        batch: what went on, and what left it (``errors``, and with
        ``truncate`` the ``cut`` after the first)."""
        batch = Batch(list(items), truncate=truncate)
        first = 0 if start is None else op.at(start)
        last = len(op.segments) if stop is None else op.at(stop)
        for i in range(first, last):
            seg = op.spec.segments[i]
            if seg.wait:
                raise SpecError(f"operation {op.spec.name}: a batch does not run wait segment {seg.name!r}")
            rule = self._rule(seg.lock)
            with rule.take_many(batch):
                if rule.check is not None and self._checks(op, seg.name):
                    rule.check(batch)
                if i == 0 and op.spec.entry is not None:
                    admitted = op.admits_many(batch.items)
                    if not all(admitted):
                        batch.items = [x for x, ok in zip(batch.items, admitted) if ok]
                _run_segment(op, i, batch)
            if not batch.items:
                break
        return batch

    def run_segment_batch(self, op: CompiledOperation, segment: str, batch: Batch) -> None:
        """Segment ``segment`` for an existing ``batch`` (its items and errors
        carry over), under its lock's ``take_many``; no entry check."""
        i = op.at(segment)
        rule = self._rule(op.spec.segments[i].lock)
        with rule.take_many(batch):
            _run_segment(op, i, batch)


def _run_segment(op: CompiledOperation, index: int, batch: Batch) -> None:
    """Segment ``index`` for ``batch``: the batch closure, or for a batch of
    one the per-instance closure of the same segment. A move it refuses or
    a handler that raises drops the item with its exception, as the batch
    closure would."""
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
