"""Planned hit reads with copy on write, driven by the compiled ``planned_read`` spec.

A hit's read of (slots, key) is planned under the manager's state lock and
fetched later on the prefetch thread (spec/planned_read.yaml): PLANNING ->
PENDING (registered) -> FETCHING -> SERVED / FAILED, or DROPPED before its
fetch. While PENDING or FETCHING, a write reusing one of its committed slots
first copies the old rows into it (``preserve``), so the delayed read still
returns the old tenant's rows.

``HitReads`` runs the reads of prefix hits through that machine: ``plan``
(under the state lock) decides where each row comes from, ``fetch`` (the
prefetch thread, never the state lock) reads them and overlays preserved
copies, ``forget`` drops a read nobody will fetch.

Threading: ``PlannedReads`` has no lock of its own. Every move runs under the
manager's reads lock, the same lock that covers the slot versions, so a
version bump and the copy it requires are seen together. Lock order: state,
then reads; the prefetch thread takes only the reads lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import OmniPrefixCacheController, WriteTask
from omni_prefix_cache.device.index_tensors import SlotMarks, int64_ids
from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
    ReqId,
    TensorName,
    Tid,
    WriteSchedule,
    is_hidden_key,
)
from omni_prefix_cache.reads.read_ops import Fetch, compile_read_ops
from omni_prefix_cache.specs import SpecState, compile_machine, load_spec
from omni_prefix_cache.specs.types.planned_read import INITIAL, PlannedReadTrigger
from omni_prefix_cache.specs.types.planned_read import ReadState as ReadState  # re-exported
from omni_prefix_cache.steps import slot_tags
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.slot_tags import READ_FROM_BASELINE, READ_FROM_OWNER, READ_SOURCE, rows_tagged
from omni_prefix_cache.steps.step_context import KeyLayout
from omni_prefix_cache.steps.validation import listed
from omni_prefix_cache.writes.host_rows import HostRows
from omni_prefix_cache.writes.operations import active_protocol, task_failed
from omni_prefix_cache.writes.task_registry import TaskRegistry

logger = logging.getLogger(__name__)

_MAX_LISTED = 16


@dataclass(eq=False)
class StagedRows:
    """Rows of a planned read served by a not-yet-written JOIN_ON_FINISH task.

    ``rows`` pins, at planning, the (chunk, row) of the task that holds each
    slot's rows then: the same write may map a slot again later (its request
    preempted and resumed onto the block), and its newer chunk must not
    answer a read planned for the older rows."""

    task: WriteTask
    positions: torch.Tensor  # int64 positions in the read
    slots: torch.Tensor  # the slots at those positions
    rows: tuple[tuple[int, int], ...] | None = None  # per slot: (chunk index, row) at planning


@dataclass(eq=False)
class PlannedRead:
    """A hit read planned under the state lock and fetched later, off it.

    ``planned_version`` snapshots the slot versions at planning. Rows read
    from the pool are valid only if the version is unchanged, or if a reuse
    copied the old rows into ``preserved`` first (copy on write). ``preserved``
    also holds the baseline of mm slots that were ABSENT at planning, so a
    later tenant's write can never leak into this read."""

    req_id: ReqId
    key: TensorName
    slots: torch.Tensor
    planned_version: torch.Tensor
    join_tids: list[Tid] = field(default_factory=list)  # JOIN_NEXT_STEP owners: wait, then read the pool
    staged_list: list[StagedRows] = field(default_factory=list)  # JOIN_ON_FINISH owners: read the task
    preserved: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> row
    state: SpecState = INITIAL  # a ReadState
    # Why planning refused it (guard rows_planned is false), else None.
    refusal: OmniPrefixCacheUnmatchError | None = None
    _slot_set: set[int] | None = None
    _slot_ids: np.ndarray | None = None

    @property
    def already_staged(self) -> bool:
        """True when every row is in the pool now (nothing to wait for)."""
        return not self.join_tids and not self.staged_list

    @property
    def slot_ids(self) -> np.ndarray:
        """``slots`` as int64 numpy ids, converted once (for ``preserve``)."""
        if self._slot_ids is None:
            self._slot_ids = int64_ids(self.slots)
        return self._slot_ids

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
        # fails as overwritten when it is fetched: an error, not a wrong row.
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
    Callers hold the manager's reads lock for every method."""

    def __init__(self, pool: PrefixBlockPool) -> None:
        self.pool = pool
        self.pending: set[PlannedRead] = set()
        self.by_key: dict[TensorName, set[PlannedRead]] = {}
        self._marks = SlotMarks()  # which live reads a reuse touches

    def move(self, ref: PlannedRead, trigger: PlannedReadTrigger, reused: set[int] | None = None) -> None:
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
        recorder = PLANNED_READ_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, ref)
        for effect in move.effects:
            effect(self, ref, reused)

    def preserve(self, key: TensorName, slots: torch.Tensor) -> None:
        """Copy on write: committed rows of ``key`` at ``slots`` are about to be
        overwritten (or reset); every live read of any of them copies them first."""
        refs = self.by_key.get(key)
        if not refs:
            return
        live = list(refs)
        hits = self._marks.overlaps(self.pool.num_slots, slots, [ref.slot_ids for ref in live])
        touched = [ref for ref, hit in zip(live, hits) if hit]
        if touched:
            reused = set(slots.tolist())
            for ref in touched:
                self.move(ref, PlannedReadTrigger.PRESERVE, reused)


class HitReads:
    """Plans, fetches and drops the planned reads of prefix hits.

    ``registry`` holds every live read; ``lock`` is the manager's reads lock
    (a leaf: taken inside the state lock, or alone by the prefetch thread).
    The occupancy's ``on_reuse`` hook is ``registry.preserve``. A read's owners
    are ``tasks``' (read via ``host_rows`` until written, joined by ``controller``)."""

    def __init__(
        self,
        pool: PrefixBlockPool,
        controller: OmniPrefixCacheController,
        tasks: TaskRegistry,
        host_rows: HostRows,
        occupancy: SlotOccupancy,
        reads_lock: threading.Lock,
    ) -> None:
        self._pool, self._controller, self._tasks, self._host_rows = pool, controller, tasks, host_rows
        self._occupancy = occupancy
        self.lock = reads_lock
        self.registry = PlannedReads(pool)
        # Operation prefetch and new_step's read moves, compiled once.
        self.ops = compile_read_ops(
            active_protocol(), PLANNED_READ_MACHINE, self.registry, self._fetch_rows, reads_lock
        )

    @property
    def pending(self) -> set[PlannedRead]:
        """Every live (PENDING or FETCHING) read."""
        return self.registry.pending

    def plan(self, slots: torch.Tensor, key: TensorName, req_id: ReqId) -> PlannedRead:
        """Plan a read of ``slots`` for ``key`` and register it as pending,
        so a reuse of a committed slot preserves its rows. The hit planner
        calls it with the state lock held; takes the reads lock.
        COMMITTED rows read the pool; rows in transit wait for their
        JOIN_NEXT_STEP write (``join_tids``) or read their JOIN_ON_FINISH
        task (``staged_list``); ABSENT mm rows keep the baseline (zeros) taken
        now. Raises OmniPrefixCacheUnmatchError for ABSENT hidden rows, any
        REJECTED row, an in-transit owner no longer held, or a failed owner.
        """
        got = self.plan_many([slots], key, [req_id])[0]
        if isinstance(got, OmniPrefixCacheUnmatchError):
            raise got
        return got

    def plan_many(
        self, slots: list[torch.Tensor], key: TensorName, req_ids: list[ReqId]
    ) -> list[PlannedRead | OmniPrefixCacheUnmatchError]:
        """``plan`` for several reads of one key (state lock held; takes the
        reads lock once): per read its planned read, or the error ``plan``
        would raise for it (that read refused, the others planned). The
        states and versions of every read are gathered at once, and the
        usual case, every row committed, needs no per-read tensor op."""
        if not slots:
            return []
        table = self._occupancy.get_slot_status(key)
        slots = [s if s.dtype == torch.int64 else s.to(torch.int64) for s in slots]
        every = slots[0] if len(slots) == 1 else torch.cat(slots)
        sizes = [int(s.numel()) for s in slots]
        versions = table.slot_version.index_select(0, every).split(sizes)
        refs = [
            PlannedRead(req_id=rid, key=key, slots=s, planned_version=v) for rid, s, v in zip(req_ids, slots, versions)
        ]
        out: list[PlannedRead | OmniPrefixCacheUnmatchError] = list(refs)
        state = table.state.index_select(0, every)
        if bool(rows_tagged(state, READ_SOURCE).any()):
            # Some row is not committed: each read decides where its rows come from.
            for i, (ref, st) in enumerate(zip(refs, state.split(sizes))):
                try:
                    self._plan_rows(ref, table.tids, st)
                except OmniPrefixCacheUnmatchError as exc:
                    ref.refusal = exc
                    out[i] = exc
        with self.lock:
            # new_step's read moves (compiled): register where rows_planned, else refuse.
            self.ops.settle_planned(refs)
        return out

    def _plan_rows(self, ref: PlannedRead, tids: torch.Tensor, state: torch.Tensor) -> None:
        """Where each row of ``ref`` comes from (see ``plan``)."""
        slots, key, req_id = ref.slots, ref.key, ref.req_id
        source = rows_tagged(state, READ_SOURCE)
        if not bool(source.any()):  # the usual hit: every row is committed, read from the pool
            return
        slot_tags.refuse_rejected(source, slots, f"prefix hit of request {req_id!r}: {key!r} rows")
        absent = (source & READ_FROM_BASELINE) != 0
        if bool(absent.any()):
            if is_hidden_key(key):
                raise OmniPrefixCacheUnmatchError(
                    f"prefix hit of request {req_id!r}: hidden rows at slots {listed(slots[absent])} were never "
                    "written (ABSENT); the omni cache diverged from the KV cache"
                )
            pos = absent.nonzero().flatten()
            # Not the slab's rows: after a tenancy reset they may still be
            # a previous tenant's.
            baseline = self._pool.baseline(key, int(pos.numel()))
            for i, slot in enumerate(slots[pos].tolist()):
                ref.preserved[slot] = baseline[i]
        transit = (source & READ_FROM_OWNER) != 0
        if bool(transit.any()):
            pos = transit.nonzero().flatten()
            owners = tids.index_select(0, slots[pos])
            for tid in dict.fromkeys(owners.tolist()):
                task = self._tasks.get(tid)
                where = pos[owners == tid]
                if task is None:
                    raise OmniPrefixCacheUnmatchError(
                        f"prefix hit of request {req_id!r}: {key!r} rows at slots {listed(slots[where])} are in "
                        f"transit with task {tid}, which the controller no longer holds"
                    )
                if task_failed(task):
                    raise OmniPrefixCacheUnmatchError(
                        f"prefix hit of request {req_id!r}: write failed for task {tid} holding {key!r} rows at "
                        f"slots {listed(slots[where])}"
                    )
                if task.schedule is WriteSchedule.JOIN_NEXT_STEP:
                    ref.join_tids.append(tid)
                else:
                    mine = slots[where]
                    s2r = task.slot_to_row()
                    pinned = tuple(s2r.get(slot, (-1, -1)) for slot in mine.tolist())
                    ref.staged_list.append(StagedRows(task=task, positions=where, slots=mine, rows=pinned))

    def prefetch(self, ref: PlannedRead, layout: KeyLayout, computed: int, total: int) -> torch.Tensor:
        """Prefetch thread: build ``[prefix | empty tail]`` so materialize
        only writes the tail. Raises OmniPrefixCacheUnmatchError naming the
        request, key and slots when the read fails."""
        try:
            buf = torch.empty((total, layout.width), dtype=layout.dtype)
            self.fetch(ref, out=buf[:computed])
        except OmniPrefixCacheUnmatchError:
            raise
        except Exception as exc:
            raise OmniPrefixCacheUnmatchError(
                f"prefix hit of request {ref.req_id!r}: reading {ref.key!r} rows at slots {listed(ref.slots)} "
                f"failed: {exc!r}"
            ) from exc
        return buf

    def fetch(self, src: PlannedRead, out: torch.Tensor | None = None) -> torch.Tensor:
        """Operation ``prefetch`` (compiled) for one read, never under the
        state lock (the prefetch thread or a test): ``fetch`` under the
        reads lock; the rows (``_fetch_rows``) with no lock; then ``serve``,
        or ``fail`` when the fetch raised, under the reads lock again, and
        the error is raised. The read is no longer pending either way."""
        call = Fetch(src, out)
        self.ops.fetch(call)
        if call.error is not None:
            raise call.error
        assert call.rows is not None
        return call.rows

    def _fetch_rows(self, call: Fetch) -> None:
        """Effect ``fetch_rows``: wait for JOIN_NEXT_STEP owners' pool
        writes, read the pool, overlay rows of JOIN_ON_FINISH owners and
        preserved copies, and check versions (``ensure_not_overwritten``,
        which raises when a pool row changed version with no preserved
        copy). What it raises is kept for guard rows_fetched."""
        src, out = call.ref, call.out
        try:
            if src.join_tids:
                # Once `done` is set the rows are in the pool. Publishing the
                # completion (the occupancy commit) is left to the next
                # facade entry: this thread never takes the state lock. A
                # reuse racing this read is caught by the version check.
                self._controller.join(list(src.join_tids))
            # Gathered straight into ``out`` (the prefetch buffer): one copy of the rows.
            rows = self._pool.rows(src.key, src.slots, out=out)
            staged: torch.Tensor | None = None
            for part in src.staged_list:
                got = self._host_rows.fetch(part.task, part.slots, src.key, pinned=part.rows)
                rows.index_copy_(0, part.positions, got.reshape(int(got.shape[0]), int(rows.shape[1])).to(rows.dtype))
                if staged is None:
                    staged = torch.zeros(int(src.slots.numel()), dtype=torch.bool)
                staged[part.positions] = True
            for pos, row in self.ensure_not_overwritten(
                src.slots,
                src.key,
                req_id=src.req_id,
                planned_version=src.planned_version,
                preserved=src.preserved,
                skip=staged,
            ):
                rows[pos] = row
            call.rows = rows
        except BaseException as exc:
            call.error = exc

    def ensure_not_overwritten(
        self,
        slots: torch.Tensor,
        key: TensorName,
        *,
        req_id: ReqId,
        planned_version: torch.Tensor,
        preserved: Mapping[int, torch.Tensor] | None = None,
        skip: torch.Tensor | None = None,
    ) -> list[tuple[int, torch.Tensor]]:
        """Check a delayed pool read against the versions it was planned at.
        Returns ``(position, row)`` overlays from ``preserved``; raises
        OmniPrefixCacheUnmatchError ("overwritten") naming the request, key
        and slots that changed version with no preserved copy (a new tenant
        overwrote rows the read needs). ``skip`` masks positions not read
        from the pool. Any thread; takes the reads lock (versions and
        preserved copies change together under it). ``preserved`` is the
        read's own dict, read only under that lock (a reuse may fill it,
        with the version bump, between this call and the lock)."""
        with self.lock:
            if preserved is None:
                preserved = {}
            current = self._occupancy.get_slot_status(key).slot_version.index_select(0, slots)
            if skip is None and not preserved and torch.equal(current, planned_version):
                return []  # the usual read: no version changed, nothing to overlay (one op, not three)
            changed = current != planned_version
            if skip is not None:
                changed &= ~skip
            if bool(changed.any()):
                lost = [s for s in slots[changed].tolist() if s not in preserved]
                if lost:
                    raise OmniPrefixCacheUnmatchError(
                        f"delayed read for request {req_id!r}: {key!r} rows at slots {listed(lost)} were "
                        "overwritten before the read (slots reassigned to a new tenant, no preserved copy)"
                    )
            if not preserved:
                return []
            skipped = skip.tolist() if skip is not None else None
            return [
                (i, preserved[s])
                for i, s in enumerate(slots.tolist())
                if s in preserved and not (skipped is not None and skipped[i])
            ]

    def forget(self, ref: PlannedRead) -> None:
        """The read is abandoned before its fetch began (``drop``): no later
        reuse needs to preserve rows for it. Any thread; takes the reads
        lock only. Raises OmniPrefixCacheUnmatchError when the read is no
        longer pending (spec planned_read)."""
        with self.lock:
            self.registry.move(ref, PlannedReadTrigger.DROP)
