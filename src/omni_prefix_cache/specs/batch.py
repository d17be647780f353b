"""A batch of instances one operation runs together (``specs.composition_compile``
derives each segment's batch closure from the same compiled steps as its
per-instance one): the writes of one step, the tasks one committer pass
claimed.

Refused and raising items land in ``Batch.errors``. With ``truncate`` only
the earliest of them (in batch order) counts and every item after it is
``Batch.cut``: what a loop that stops at the first failing instance would
have left (the eager dispatch's rule), except that a cut item may already
have run the steps before the one that stopped the batch. An executor
decides what happens to errors and cut items afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def partitioned(batch: Batch, parts: list[tuple[list[Any], BatchRun | None]]) -> None:
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
