"""Prefix hits: from new_step_starts to planned reads on the prefetch thread.

``HitPlanner`` validates a hit (block aligned, block ids of the keyed KV
cache group, ``PrefixCacheConfig.kv_cache_group_index``, in range),
keeps it pending until its step's save, plans one read per cached key
(``HitReads.plan``; a step's hits key by key with ``plan_many``) and submits
the reads to the prefetch thread. A hit on a block its own step reallocates
is planned again at save, against that step's tables
(``replan_same_step_hits``).

Threading: every method but ``hit_blocks`` and ``block_slots`` (pure)
expects the manager's state lock held; ``start_prefetch`` runs in the same
state segment that planned the reads (operation new_step), so a shutdown
under that lock cancels or waits for each of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from omni_prefix_cache.device.index_tensors import SlotMarks
from omni_prefix_cache.interface import (
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    ReqId,
    TensorName,
)
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.slot_tags import READ_BASELINE, READ_REFUSED, rows_tagged
from omni_prefix_cache.steps.step_context import KeyLayout, StepContext
from omni_prefix_cache.steps.step_record import Hit as Hit  # re-exported (the manager's annotations)
from omni_prefix_cache.steps.validation import as_int, listed
from omni_prefix_cache.telemetry.registry import dropped

logger = logging.getLogger(__name__)

_INT: frozenset[type] = frozenset({int})


# One planned hit read waiting for the prefetch thread.
HitJob = tuple[Hit, TensorName, PlannedRead]


# Rows a hit's read waits for save to plan: absent, or a rejected draft (this step may write either).
_WAIT_FOR_SAVE = READ_BASELINE | READ_REFUSED


class HitPlanner:
    """Pending hits (``pending``, by request) and the planning of their reads.

    ``prefetch`` is the executor the reads run on (the facade shuts it down).

    ``policy`` and ``is_closed`` are read when called (the facade may swap
    its policy); ``layouts`` is the step layout's ``known`` table.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        occupancy: SlotOccupancy,
        reads: HitReads,
        prefetch: ThreadPoolExecutor,
        layouts: Mapping[TensorName, KeyLayout],
        policy: Callable[[], ModelCachePolicy],
        is_closed: Callable[[], bool],
    ) -> None:
        self._config = config
        self._block_size = int(config.block_size)
        self._group = int(config.kv_cache_group_index)
        self._occupancy = occupancy
        self._reads = reads
        self.prefetch = prefetch
        self._layouts = layouts
        self._policy = policy
        self._is_closed = is_closed
        self.pending: dict[ReqId, Hit] = {}
        self._marks = SlotMarks()  # the same-step hit check's table over the pool's slots

    def hit_blocks(self, rid: ReqId, computed: int, block_ids: Any) -> list[int]:
        """Validate a hit and return its prefix block ids in the keyed KV
        cache group (``block_ids[kv_cache_group_index]``). Raises the
        invalid-argument or invalid-type error naming the request."""
        bs, g = self._block_size, self._group
        if computed % bs:
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit not block aligned: request {rid!r} has num_computed_tokens={computed}, block_size={bs}"
            )
        need = computed // bs
        group = None
        if isinstance(block_ids, (str, bytes)) or (block_ids is not None and not isinstance(block_ids, Sequence)):
            raise OmniPrefixCacheInvalidTypeError(
                f"prefix hit of request {rid!r}: block_ids must be a sequence of per-group block id lists, "
                f"got {type(block_ids).__name__}"
            )
        if block_ids is not None and len(block_ids) > g:
            group = block_ids[g]
        elif need and block_ids:  # ids of other groups only: not an empty hit, a layout mismatch
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r} ({computed} tokens) carries block ids of {len(block_ids)} KV cache "
                f"group(s); the prefix cache keys rows by group {g} (PrefixCacheConfig.kv_cache_group_index)"
            )
        if group is not None and (isinstance(group, (str, bytes)) or not isinstance(group, Sequence)):
            raise OmniPrefixCacheInvalidTypeError(
                f"prefix hit of request {rid!r}: group-{g} block ids must be a sequence, got {type(group).__name__}"
            )
        if group is None or (need and not group):  # "carries no block_ids": upstream's phrase
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r} ({computed} tokens, {need} blocks) carries no block_ids (group {g})"
            )
        if len(group) < need:
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r} ({computed} tokens, {need} blocks) comes with only "
                f"{len(group)} group-{g} block ids"
            )
        blocks = list(group)[:need]
        if not set(map(type, blocks)) <= _INT:  # exact ints (the usual case) need no call per block
            blocks = [as_int(f"prefix hit of request {rid!r}: block id", b) for b in blocks]
        if blocks and (min(blocks) < 0 or max(blocks) >= self._config.num_blocks):
            bad = [b for b in blocks if b < 0 or b >= self._config.num_blocks]
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r}: block ids {listed(bad)} outside [0, {self._config.num_blocks})"
            )
        return blocks

    def block_slots(self, blocks: list[int]) -> torch.Tensor:
        """The KV slot ids of ``blocks``, in order."""
        return self.block_slots_many([blocks])[0]

    def block_slots_many(self, hits: list[list[int]]) -> list[torch.Tensor]:
        """``block_slots`` of several block lists at once (numpy: a few ops
        for all of them, each result a view of one array)."""
        if not hits:
            return []
        bs = self._block_size
        every = np.fromiter((b for blocks in hits for b in blocks), dtype=np.int64)
        slots = np.add.outer(every * bs, np.arange(bs, dtype=np.int64)).reshape(-1)
        # One torch split (views) rather than numpy's split: numpy's is a
        # Python loop of several calls per part, on the engine thread.
        return list(torch.from_numpy(slots).split([len(blocks) * bs for blocks in hits]))

    def register(self, hits: list[Hit], num_sched: Mapping[ReqId, int]) -> list[Hit]:
        """Make each hit (its blocks validated by ``hit_blocks``) the
        request's pending hit, dropping an older one (new_step_starts, state
        lock): its slots are those of positions ``[hit_start, hit_end)``."""
        if not hits:
            return hits
        all_slots = self.block_slots_many([hit.block_ids for hit in hits])
        for hit, slots in zip(hits, all_slots):
            start = hit.hit_start
            hit.slots = slots[start : hit.hit_end] if start else slots
            hit.num_scheduled = num_sched.get(hit.req_id, 0)
            self.drop_request(hit.req_id)
            self.pending[hit.req_id] = hit
        return hits

    def drop_request(self, rid: ReqId) -> None:
        """The request finished (or hits again): its pending hit, if any,
        will never be served (state lock)."""
        stale = self.pending.pop(rid, None)
        if stale is not None:
            self.drop(stale)

    def take_all(self) -> dict[ReqId, Hit]:
        """Hand every pending hit to the save that serves it (state lock)."""
        hits, self.pending = self.pending, {}
        return hits

    def drop_all(self) -> None:
        """Drop every pending hit (shutdown, state lock)."""
        for hit in self.pending.values():
            self.drop(hit)
        self.pending.clear()

    def put_back(self, hits: dict[ReqId, Hit], retry: bool) -> bool:
        """A failed save hands back the hits it took (``take_all``). With
        ``retry`` and no hit registered since, they are pending again and
        True is returned (the save may be retried); otherwise each is
        dropped. State lock held."""
        if retry and not self.pending:
            self.pending = hits
            return True
        for hit in hits.values():
            self.drop(hit)
        return False

    def drop(self, hit: Hit) -> None:
        """A hit that will never be served: cancel its prefetches and forget
        its pending reads (a running prefetch forgets its own). Any lock."""
        dropped(len(hit.futures))  # a running one finishes unread
        for key, fut in hit.futures.items():
            if fut.cancel():
                ref = hit.refs.get(key)
                if ref is not None:
                    self._reads.forget(ref)
        for key, ref in hit.refs.items():
            if key not in hit.futures:
                self._reads.forget(ref)

    def plan(self, hit: Hit, *, at_save: bool) -> list[HitJob]:
        """Plan the hit's reads for every cached key not planned yet (state
        lock held): ``plan_many`` of this one hit."""
        return self.plan_many([hit], at_save=at_save)

    def plan_many(self, hits: Sequence[Hit], *, at_save: bool) -> list[HitJob]:
        """Plan the hits' reads for every cached key not planned yet (state
        lock held), key by key: one state gather per key for all the hits,
        their reads planned together (``HitReads.plan_many``). Jobs come hit
        by hit, keys in policy order. At new_step_starts a key with ABSENT
        rows (or no slab yet) waits for save: this very step may compute
        them. A read that cannot be served becomes a failed future, raised
        by materialize."""
        hits = [hit for hit in hits if hit.num_computed > 0]
        if not hits:
            return []
        occupancy = self._occupancy
        keys = self._policy().get_hit_keys(occupancy.keys())
        planned: dict[int, list[HitJob]] = {id(hit): [] for hit in hits}
        for key in keys:
            todo = [hit for hit in hits if key not in hit.futures]
            if not todo:
                continue
            if not occupancy.has_key(key):
                if at_save:
                    for hit in todo:
                        self._fail(hit, key, _never_cached(hit, key))
                continue
            if not at_save:
                todo = self._without_absent_rows(todo, key)
                if not todo:
                    continue
            refs = self._reads.plan_many([hit.slots for hit in todo], key, [hit.req_id for hit in todo])
            for hit, ref in zip(todo, refs):
                if isinstance(ref, OmniPrefixCacheUnmatchError):
                    self._fail(hit, key, ref)
                    continue
                hit.refs[key] = ref
                planned[id(hit)].append((hit, key, ref))
        return [job for hit in hits for job in planned[id(hit)]]

    def _without_absent_rows(self, hits: list[Hit], key: TensorName) -> list[Hit]:
        """The hits with no row of ``key`` in a read_baseline or
        read_refused state: at new_step_starts such a key waits for save
        (``plan``), where this step may write the rows (a same-step hit on a
        block whose position it recomputes after a rejected draft)."""
        sizes = [int(hit.slots.numel()) for hit in hits]
        state = self._occupancy.state[key].index_select(0, torch.cat([hit.slots for hit in hits]))
        absent = rows_tagged(state, _WAIT_FOR_SAVE)
        if not bool(absent.any()):
            return hits
        return [hit for hit, rows in zip(hits, absent.split(sizes)) if not bool(rows.any())]

    def replan_same_step_hits(self, hits: dict[ReqId, Hit], slots: torch.Tensor) -> None:
        """A hit planned at new_step_starts whose slots this very step maps
        is a same-step hit on a reused block: vLLM dropped the old block
        hash before reallocating it, so the hit means the rows this step
        computes, not the old tenant's (which the reuse just preserved for
        it). The step is the new tenant of every key of those slots (keys it
        does not write were reset), so drop the plans of every key; save
        plans them again against this step's tables right after (state lock
        held)."""
        planned = [hit for hit in hits.values() if hit.futures and int(hit.slots.numel())]
        if int(slots.numel()) == 0 or not planned:
            return
        for hit, overlaps in zip(planned, self.overlaps(slots, [hit.slots for hit in planned])):
            if not overlaps:
                continue
            for key in list(hit.futures):
                fut = hit.futures.pop(key)
                ref = hit.refs.pop(key, None)
                # A prefetch already running forgets its own read; its
                # result is simply never looked at.
                dropped(1)
                if fut.cancel() and ref is not None:
                    self._reads.forget(ref)

    def overlaps(self, slots: torch.Tensor, groups: list[torch.Tensor]) -> list[bool]:
        """Whether each non-empty slot tensor of ``groups`` shares a slot with
        ``slots`` (all in range), with a few array ops whatever the number
        of groups (``SlotMarks``)."""
        return self._marks.overlaps(self._occupancy.num_slots, slots, groups)

    def attach_to_step(self, hits: dict[ReqId, Hit], ctx: StepContext) -> list[HitJob]:
        """Hand the save's hits to its step's record (``StepRecord.add_hits``:
        a hit not scheduled this step gets an entry without rows) and plan
        their reads at save (state lock held). Returns the reads to start on
        the prefetch thread."""
        record = ctx.record
        index, counts = record.index, record.row_counts
        for rid, hit in hits.items():
            i = index.get(rid)
            if i is not None:
                hit.num_scheduled = counts[i]
        jobs = self.plan_many(list(hits.values()), at_save=True)
        record.add_hits(hits)
        return jobs

    @staticmethod
    def _fail(hit: Hit, key: TensorName, exc: OmniPrefixCacheUnmatchError) -> None:
        logger.warning("omni prefix cache unmatch: %s", exc)
        fut: Future[torch.Tensor] = Future()
        fut.set_exception(exc)
        hit.futures[key] = fut

    def start_prefetch(self, jobs: list[HitJob]) -> None:
        """Submit planned reads to the prefetch thread (engine thread, state
        lock held: the segment that planned them). A read that cannot start
        becomes a failed future (the shutdown error after shutdown)."""
        for hit, key, ref in jobs:
            layout = self._layouts[key]
            total = hit.num_computed + hit.num_scheduled
            try:
                fut = self.prefetch.submit(self._reads.prefetch, ref, layout, hit.num_computed, total)
            except Exception as exc:
                self._reads.forget(ref)
                fut = Future()
                kind = OmniPrefixCacheShutdownError if self._is_closed() else OmniPrefixCacheUnmatchError
                error = kind(f"prefetch of {key!r} rows for request {hit.req_id!r} could not start: {exc!r}")
                error.__cause__ = exc
                fut.set_exception(error)
            hit.futures[key] = fut


def _never_cached(hit: Hit, key: TensorName) -> OmniPrefixCacheUnmatchError:
    return OmniPrefixCacheUnmatchError(
        f"prefix hit of request {hit.req_id!r}: key {key!r} was never cached (slots {listed(hit.slots)} are ABSENT)"
    )
