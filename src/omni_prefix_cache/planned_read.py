"""Planned hit reads with copy on write, driven by the compiled ``planned_read`` spec.

A hit's read of (slots, key) is planned under the manager's state lock and
fetched later on the prefetch thread (spec/planned_read.yaml): PLANNING ->
PENDING (registered) -> FETCHING -> SERVED / FAILED, or DROPPED before its
fetch. While PENDING or FETCHING, a write reusing one of its committed slots
first copies the old rows into it (``preserve``), so the delayed read still
returns the old tenant's rows.

Threading: ``PlannedReads`` has no lock of its own. Every move runs under the
manager's reads lock, the same lock that covers the slot versions, so a
version bump and the copy it requires are seen together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, TensorName, Tid
from omni_prefix_cache.spec_types.planned_read import ReadState as ReadState  # re-exported
from omni_prefix_cache.specs import compile_machine, load_spec

logger = logging.getLogger(__name__)

_MAX_LISTED = 16


@dataclass(eq=False)
class StagedRows:
    """Rows of a planned read served by a not-yet-written JOIN_ON_FINISH task."""

    task: Any  # WriteTask
    positions: torch.Tensor  # int64 positions in the read
    slots: torch.Tensor  # the slots at those positions


@dataclass(eq=False)
class PlannedRead:
    """A hit read planned under the state lock and fetched later, off it.

    ``planned_version`` snapshots the slot versions at planning. Rows read
    from the pool are valid only if the version is unchanged, or if a reuse
    copied the old rows into ``preserved`` first (copy on write). ``preserved``
    also holds the baseline of mm slots that were ABSENT at planning, so a
    later tenant's write can never leak into this read.
    """

    req_id: ReqId
    key: TensorName
    slots: torch.Tensor
    planned_version: torch.Tensor
    join_tids: list[Tid] = field(default_factory=list)  # JOIN_NEXT_STEP owners: wait, then read the pool
    staged_list: list[StagedRows] = field(default_factory=list)  # JOIN_ON_FINISH owners: read the task
    preserved: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> row
    state: Any = None  # ReadState; PLANNING when created
    _slot_set: set[int] | None = None

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = PLANNED_READ_MACHINE.initial

    @property
    def already_staged(self) -> bool:
        """True when every row is in the pool now (nothing to wait for)."""
        return not self.join_tids and not self.staged_list

    @property
    def slot_set(self) -> set[int]:
        if self._slot_set is None:
            self._slot_set = set(self.slots.tolist())
        return self._slot_set


# ------------------------------------------------------------ spec effects
# Signature (reads, read, reused slots or None); under the reads lock.


def _add_pending(reads: PlannedReads, ref: PlannedRead, reused: set[int] | None) -> None:
    reads.pending.add(ref)
    reads.by_key.setdefault(ref.key, set()).add(ref)


def _forget_pending(reads: PlannedReads, ref: PlannedRead, reused: set[int] | None) -> None:
    reads.pending.discard(ref)
    refs = reads.by_key.get(ref.key)
    if refs is not None:
        refs.discard(ref)
        if not refs:
            del reads.by_key[ref.key]


def _copy_old_rows(reads: PlannedReads, ref: PlannedRead, reused: set[int] | None) -> None:
    # A small gather, done now because the new tenant's write may land as
    # soon as the locks are released.
    need = [s for s in ref.slot_set & (reused or set()) if s not in ref.preserved]
    if not need:
        return
    try:
        rows = reads.pool.rows(ref.key, torch.tensor(need, dtype=torch.int64))
    except Exception:
        # The new tenant's write must go on. Left without its copy, this read
        # raises "reassigned" when it is fetched: an error, not a wrong row.
        logger.exception("omni prefix cache: preserving %r rows for request %r failed", ref.key, ref.req_id)
        return
    for i, slot in enumerate(need):
        ref.preserved[slot] = rows[i]


PLANNED_READ_MACHINE = compile_machine(
    load_spec("planned_read"),
    effects={"add_pending": _add_pending, "forget_pending": _forget_pending, "copy_old_rows": _copy_old_rows},
    state_enum=ReadState,
)


def _describe(ref: PlannedRead) -> str:
    slots = ref.slots[:_MAX_LISTED].tolist()
    more = int(ref.slots.numel()) - len(slots)
    return f"request {ref.req_id!r}, key {ref.key!r}, slots {slots}" + (f" (+{more} more)" if more > 0 else "")


class PlannedReads:
    """Every live (PENDING or FETCHING) planned read, indexed by key.

    ``pending`` and ``by_key`` change only through the spec's effects.
    Callers hold the manager's reads lock for every method.
    """

    def __init__(self, pool: PrefixBlockPool) -> None:
        self.pool = pool
        self.pending: set[PlannedRead] = set()
        self.by_key: dict[TensorName, set[PlannedRead]] = {}

    def move(self, ref: PlannedRead, trigger: str, reused: set[int] | None = None) -> None:
        """Fire ``trigger`` on ``ref`` and run the move's effects. Raises
        OmniPrefixCacheUnmatchError naming the read and its state when the
        spec declares no such move."""
        move = PLANNED_READ_MACHINE.move(ref.state, trigger)
        if move is None:
            raise OmniPrefixCacheUnmatchError(
                f"planned read of {_describe(ref)}: {trigger} is illegal from {ReadState(ref.state).name} "
                "(spec planned_read)"
            )
        ref.state = move.dest
        for effect in move.effects:
            effect(self, ref, reused)

    def preserve(self, key: TensorName, slots: torch.Tensor) -> None:
        """Copy on write: committed rows of ``key`` at ``slots`` are about to
        be overwritten (or reset); every live read of any of them copies
        them first."""
        refs = self.by_key.get(key)
        if not refs:
            return
        reused = set(slots.tolist())
        for ref in list(refs):
            if not ref.slot_set.isdisjoint(reused):
                self.move(ref, "preserve", reused)
