"""The manager's side of the host tier: fill reads and restores (``tier.store.TierFiller``).

A fill is a planned read of one block's rows for every open key, planned under
the state lock before the block's slots change tenant, so the slots' copy on
write (``preserve``) keeps the old rows for it, and fetched on the prefetch
thread like a hit's read. A restore makes a block's slots hold rows the tier
kept: slot occupancy's ``restore_tenancy`` coupling and the pool write, both
under the state lock (the reads lock around the occupancy move).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError, TensorName
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_record import Hit
from omni_prefix_cache.tier import channel
from omni_prefix_cache.tier.metadata import BlockHash, TierStepMetadata
from omni_prefix_cache.tier.store import STAT_NAMES, HostTier, Rows, short


class TierFill:
    """Plans and fetches fills, writes restores (state lock held for both)."""

    def __init__(
        self,
        pool: PrefixBlockPool,
        occupancy: SlotOccupancy,
        reads: HitReads,
        prefetch: ThreadPoolExecutor,
        block_slots: Callable[[list[int]], torch.Tensor],
    ) -> None:
        self._pool = pool
        self._occupancy = occupancy
        self._reads = reads
        self._prefetch = prefetch
        self._block_slots = block_slots

    def plan_fill(self, block_hash: BlockHash, block_id: int) -> Future[Rows]:
        """A read of every open key's rows of ``block_id``, planned now and
        fetched on the prefetch thread. A key whose rows cannot be served
        (hidden rows never written, a failed owner) fails the whole fill."""
        slots = self._block_slots([block_id])
        who = f"host tier fill of block hash {short(block_hash)} (block {block_id})"
        refs: dict[TensorName, PlannedRead] = {}
        for key in self._occupancy.keys():
            got = self._reads.plan_many([slots], key, [who])[0]
            if isinstance(got, OmniPrefixCacheUnmatchError):
                self._forget(refs)
                return _failed(got)
            refs[key] = got
        try:
            fut = self._prefetch.submit(self._fetch, refs)
        except Exception as exc:  # shut down: the fill never runs
            self._forget(refs)
            error = OmniPrefixCacheUnmatchError(f"{who} could not start: {exc!r}")
            error.__cause__ = exc
            return _failed(error)
        # A fill cancelled before it ran (released) must not leave its reads pending.
        fut.add_done_callback(lambda f: self._forget(refs) if f.cancelled() else None)
        return fut

    def _fetch(self, refs: dict[TensorName, PlannedRead]) -> Rows:
        """Prefetch thread: every key's rows; on the first failure the reads
        not fetched yet are forgotten and the error raised."""
        rows: dict[TensorName, torch.Tensor] = {}
        todo = dict(refs)
        try:
            for key in list(todo):
                ref = todo.pop(key)
                rows[key] = self._reads.fetch(ref)  # a fresh tensor (gathered)
        except BaseException:
            self._forget(todo)
            raise
        return rows

    def _forget(self, refs: dict[TensorName, PlannedRead]) -> None:
        for ref in refs.values():
            try:
                self._reads.forget(ref)
            except OmniPrefixCacheUnmatchError:
                pass  # already fetched or failed: no longer pending

    def restore(self, block_id: int, rows: Rows) -> None:
        """``block_id``'s slots hold ``rows`` from now on: occupancy
        ``restore_tenancy`` (keys in ``rows`` restored, every other open key
        reset), then the pool write."""
        slots = self._block_slots([block_id])
        # Rows come from the pool's own keys, opened in the occupancy with them.
        with self._reads.lock:
            self._occupancy.restore_tenancy(slots, rows.keys())
        for key, t in rows.items():
            self._pool.write(key, slots, t)


def _failed(error: BaseException) -> Future[Rows]:
    fut: Future[Rows] = Future()
    fut.set_exception(error)
    return fut


TIER_STAT_KEYS = (
    *("host_tier_entries", "host_tier_held_bytes", "host_tier_surplus_bytes", "host_tier_reported"),
    *(f"host_tier_{name}" for name in STAT_NAMES),
)

# A restore a step's tier loads asked for: (request, block hash, target block).
Restore = tuple[str, BlockHash, int]


class TierDesk:
    """The host tier as the manager's operations see it (protocol effects
    ``apply_tier``, ``fill_reused_blocks`` and coupling
    ``slot.restore_tenancy``). The tier opens on the first step that
    carries tier metadata. State lock held for every method but ``join_for_loads``."""

    def __init__(
        self,
        fill: TierFill,
        *,
        block_size: int,
        group_index: int = 0,
        max_bytes: int | None,
        fill_timeout_s: float,
        commit_drained: Callable[[], None],
        join: Callable[[list[int]], None],
    ) -> None:
        self._fill = fill
        self._block_size = int(block_size)
        self._group = int(group_index)  # the keyed KV cache group (PrefixCacheConfig.kv_cache_group_index)
        self._max_bytes = max_bytes
        self._timeout = fill_timeout_s
        self._commit_drained = commit_drained
        self._join = join
        self.tier: HostTier | None = None

    def _open(self) -> HostTier:
        if self.tier is None:
            bound = self._max_bytes if self._max_bytes is not None else 1 << 62  # the scheduler side bounds it
            reports = channel.TierReports()
            self.tier = HostTier(self._fill, max_bytes=bound, fill_timeout_s=self._timeout, reports=reports)
            channel.open_reports(reports)  # the worker connector drains it into each step's worker metadata
        return self.tier

    def close(self) -> None:
        """The manager shut down: its reports are no longer drained."""
        if self.tier is not None:
            channel.close_reports(self.tier.reports)

    def stats(self) -> dict[str, int]:
        """The host tier's operator figures (state lock held): entries held,
        their bytes (and the surplus kept past this side's bound), hashes
        reported to the scheduler side, and its move counts since the
        manager started."""
        tier = self.tier
        if tier is None:
            return dict.fromkeys(TIER_STAT_KEYS, 0)
        out = {
            "host_tier_entries": len(tier.entries),
            "host_tier_held_bytes": tier.held_bytes,
            "host_tier_surplus_bytes": tier.surplus_bytes,
            "host_tier_reported": tier.reports.reported,
        }
        out.update((f"host_tier_{name}", n) for name, n in tier.stats.items())
        return out

    @property
    def active(self) -> bool:
        """The tier holds an entry (a bound block's rows may still be on their way to the pool)."""
        return self.tier is not None and bool(self.tier.entries)

    def join_for_loads(self, meta: TierStepMetadata | None, previous: list[int], escalated: list[int]) -> None:
        """Protocol effect ``join_for_tier`` (no lock): wait for the writes
        that may still land on blocks the tier binds or restores (see
        spec/protocol.yaml): the ones just ``escalated`` and, when the step
        restores, the ``previous`` step's. A bound block's rows are then in the
        pool before its reuse, and no old write lands over a restored row."""
        tids = (previous if meta is not None and meta.loads else []) + escalated
        if tids:
            self._join(tids)

    def check_loads(self, meta: TierStepMetadata | None, events: Sequence[Any]) -> None:
        """Part of new_step's ``validate_events`` (before anything moves): a
        load is never dropped, so each one's request must be named by an
        event of the step with its computed tokens and blocks (its hit: a
        STARTED, RESUMED or any lookup of it), and start block aligned.
        Raises the invalid-argument error naming the request and the blocks
        otherwise: its new blocks could not get their rows back, and a later
        hit on them would read another tenant's rows."""
        if meta is None or not meta.loads:
            return
        bs = self._block_size
        named = {e.req_id for e in events if e.hit_end > 0 and len(e.block_ids) > self._group}  # the keyed group's
        for rid, load in meta.loads.items():
            if load.token_start % bs or load.token_start < 0:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"host tier load of request {rid!r}: token_start {load.token_start} is not block aligned "
                    f"(block_size {bs})"
                )
            if rid not in named:
                first = load.token_start // bs
                raise OmniPrefixCacheInvalidArgumentError(
                    f"host tier load of request {rid!r} (blocks {first}..{first + len(load.hashes) - 1} of its "
                    f"prefix, hashes {[short(h) for h in load.hashes]}): no event of the step names its hit and "
                    "blocks, so its new blocks cannot get their rows back; the step is refused (a resumed request "
                    "needs its RESUMED event)"
                )

    def apply(
        self,
        meta: TierStepMetadata | None,
        candidates: Sequence[Hit],
        events: Sequence[Any] = (),
    ) -> list[Restore]:
        """Protocol effect ``apply_tier``: release, bind, then the loads'
        restores (returned, for the ``restore_tenancy`` coupling): each
        target block's bound entry starts its fill first (its slots are
        about to change tenant). Only blocks inside the request's hit this
        step are restored: the hits the step's events installed, and any
        other event of the step naming the request's computed tokens and
        blocks (a resume whose rows no consumer still needs: its blocks must
        hold their hashes' rows for the next local hit on them). A load is
        never dropped: one no event names raises (``check_loads`` refused
        the step before anything moved), the invalid-argument error for a
        load not block aligned, and OmniPrefixCacheUnmatchError
        (``HostTier.restore``) when the tier lacks a loaded hash."""
        if meta is None or meta.empty:
            if self.tier is not None:
                self.tier.settle()
            return []
        tier = self._open()
        self._commit_drained()  # writes that landed are COMMITTED: a fill reads them from the pool
        tier.settle()
        tier.release(meta.release)
        tier.bind(meta.bind)
        if not meta.loads:
            return []
        bs = self._block_size
        hits: dict[str, tuple[int, Sequence[int]]] = {}
        g = self._group
        for e in events:  # what vLLM counts computed, and the keyed group's blocks, of each request the step names
            if e.req_id in meta.loads and e.hit_end > 0 and len(e.block_ids) > g:
                hits[e.req_id] = (int(e.hit_end), e.block_ids[g])
        hits.update((hit.req_id, (hit.hit_end, hit.block_ids)) for hit in candidates)
        self.check_loads(meta, events)  # also where new_step's validation did not run (a replayed sequence)
        restores: list[Restore] = []
        for rid, load in meta.loads.items():
            hit = hits.get(rid)
            if hit is None:  # named by an event (check_loads), whose hit a lookup replaced: never dropped
                raise OmniPrefixCacheUnmatchError(
                    f"host tier load of request {rid!r}: the step installed no hit for it; its loaded blocks "
                    "cannot be restored"
                )
            end, blocks = hit
            first = load.token_start // bs
            for i, block_hash in enumerate(load.hashes):
                index = first + i
                if index >= end // bs:
                    break  # past what vLLM counts as computed (a failed load recomputes it)
                restores.append((rid, block_hash, blocks[index]))
        tier.reuse(block for _, _, block in restores)
        return restores

    def restore(self, restores: list[Restore]) -> None:
        """Coupling ``slot.restore_tenancy`` for each restore, in order."""
        tier = self.tier
        if tier is None or not restores:
            return
        for rid, block_hash, block in restores:
            tier.restore(rid, block_hash, block)

    def fill_reused(self, slots: torch.Tensor) -> None:
        """Protocol effect ``fill_reused_blocks``: every bound block among
        ``slots`` (the save's) starts its fill before the save takes them."""
        tier = self.tier
        if tier is None or not tier.bound or int(slots.numel()) == 0:
            return
        blocks = torch.unique(slots // self._block_size).tolist()
        if any(b in tier.bound for b in blocks):
            self._commit_drained()
            tier.reuse(blocks)
