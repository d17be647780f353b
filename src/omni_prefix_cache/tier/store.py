"""The host tier's worker side: one entry per block hash, moved by the compiled ``host_tier`` spec.

``HostTier`` follows the scheduler side's metadata (``tier.metadata``): it binds
hashes to the blocks that hold their rows, starts a fill when a bound block is
about to be reused (``reuse``: a read of the old rows is planned before the
slots change tenant), keeps the fetched rows (``filled``; past its byte bound,
``overflow``: kept apart as a surplus), restores them into a load's new block
(``restore``) and drops what the scheduler side releases. Every hash it does
not keep as the scheduler side believes (a surplus, a lost fill, a rebound
block) is reported (``tier.channel.TierReports``), for the scheduler side to
forget and release.

It never touches the pool or the occupancy itself: a ``TierFiller`` (the
manager's ``reads.tier_fill.TierFill``) plans the fill reads and writes the
restored rows. Threading: every method expects the manager's state lock held
(the fills' futures complete on the prefetch thread; only the engine thread
looks at them, in ``settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, TensorName
from omni_prefix_cache.specs import SpecState, compile_machine, load_spec
from omni_prefix_cache.specs.types.host_tier import HostTierTrigger, TierState
from omni_prefix_cache.tier.channel import TierReports
from omni_prefix_cache.tier.metadata import BlockHash, TierBind

logger = logging.getLogger(__name__)

Rows = Mapping[TensorName, torch.Tensor]  # one block's rows per key, block_size rows each


class TierFiller(Protocol):
    """What the tier asks of the manager (state lock held)."""

    def plan_fill(self, block_hash: BlockHash, block_id: int) -> Future[Rows]:
        """Plan a read of every open key's rows of ``block_id`` now (before its
        slots change tenant) and fetch it off the state lock."""
        ...

    def restore(self, block_id: int, rows: Rows) -> None:
        """Make ``block_id``'s slots hold ``rows`` (occupancy restore_tenancy and the pool write)."""
        ...


def short(block_hash: BlockHash) -> str:
    """A hash as messages name it."""
    return block_hash[:8].hex()


@dataclass(eq=False)
class TierEntry:
    """One block hash the tier holds (see spec/host_tier.yaml for its states)."""

    block_hash: BlockHash
    state: SpecState = TierState.ABSENT
    block: int | None = None  # BOUND: the block whose slots hold the rows
    fill: Future[Rows] | None = None  # FILLING: the read of the reused block's rows
    rows: dict[TensorName, torch.Tensor] | None = None  # HELD or SURPLUS
    nbytes: int = 0
    lost_why: str = ""


def _rows_nbytes(rows: Rows) -> int:
    return sum(int(t.numel()) * t.element_size() for t in rows.values())


# ------------------------------------------------------------ spec effects and guards
# Signature (tier, entry, arg): arg is the move's block id, rows or reason.


def _bind_block(tier: HostTier, entry: TierEntry, block: Any) -> None:
    entry.block = int(block)
    tier.bound[entry.block] = entry.block_hash
    tier.reported_why.pop(entry.block_hash, None)


def _unbind_block(tier: HostTier, entry: TierEntry, arg: Any) -> None:
    if entry.block is not None:
        tier.bound.pop(entry.block, None)
        entry.block = None


def _plan_fill(tier: HostTier, entry: TierEntry, block: Any) -> None:
    entry.fill = tier.filler.plan_fill(entry.block_hash, int(block))


def _fits(tier: HostTier, entry: TierEntry, rows: Any) -> bool:
    return tier.held_bytes + _rows_nbytes(rows) <= tier.max_bytes


def _keep_rows(tier: HostTier, entry: TierEntry, rows: Any) -> None:
    entry.rows = dict(rows)
    entry.nbytes = _rows_nbytes(rows)
    entry.fill = None
    tier.held_bytes += entry.nbytes


def _drop_fill(tier: HostTier, entry: TierEntry, why: Any) -> None:
    if entry.fill is not None:
        entry.fill.cancel()  # a running fetch finishes unread
    entry.fill = None
    entry.lost_why = str(why or "")


def _restore_rows(tier: HostTier, entry: TierEntry, block: Any) -> None:
    assert entry.rows is not None
    tier.filler.restore(int(block), entry.rows)


def _drop_rows(tier: HostTier, entry: TierEntry, arg: Any) -> None:
    tier.held_bytes -= entry.nbytes
    entry.rows, entry.nbytes = None, 0


def _keep_surplus(tier: HostTier, entry: TierEntry, rows: Any) -> None:
    entry.rows = dict(rows)
    entry.nbytes = _rows_nbytes(rows)
    entry.fill = None
    tier.surplus_bytes += entry.nbytes


def _drop_surplus(tier: HostTier, entry: TierEntry, arg: Any) -> None:
    tier.surplus_bytes -= entry.nbytes
    entry.rows, entry.nbytes = None, 0


def _report_hash(tier: HostTier, entry: TierEntry, arg: Any) -> None:
    tier.reports.report((entry.block_hash,))
    why = tier.reported_why
    why.pop(entry.block_hash, None)
    # For the error of a load that comes anyway: a lose move's reason, or an overflow's (its arg is the rows).
    reason = "its rows passed this side's byte bound" if isinstance(arg, Mapping) else str(arg or "")
    why[entry.block_hash] = entry.lost_why or reason
    if len(why) > _REMEMBER_REPORTED:
        del why[next(iter(why))]


# The spec's names bound to their handlers (public: a mutant recompiles with one replaced).
TIER_GUARDS: Mapping[str, Callable[..., Any]] = {"fits": _fits}
TIER_EFFECTS: Mapping[str, Callable[..., Any]] = {
    "bind_block": _bind_block,
    "unbind_block": _unbind_block,
    "plan_fill": _plan_fill,
    "keep_rows": _keep_rows,
    "drop_fill": _drop_fill,
    "restore_rows": _restore_rows,
    "drop_rows": _drop_rows,
    "keep_surplus": _keep_surplus,
    "drop_surplus": _drop_surplus,
    "report_hash": _report_hash,
}
TIER_MACHINE = compile_machine(load_spec("host_tier"), guards=TIER_GUARDS, effects=TIER_EFFECTS, state_enum=TierState)
_HELD = frozenset(int(TierState[s.name]) for s in TIER_MACHINE.spec.states if "tier_held" in s.tags)
_WITH_ROWS = frozenset((TierState.HELD, TierState.SURPLUS))

STAT_NAMES = ("bound", "fills", "filled", "surplus", "lost", "restored", "released")
_REMEMBER_REPORTED = 4096  # the reported hashes whose reason a later load's error names


class HostTier:
    """The tier's entries, by hash (only entries the tier holds are kept).

    ``bound`` maps a block id to the hash bound to it; ``held_bytes`` counts
    HELD rows against ``max_bytes``, ``surplus_bytes`` SURPLUS rows (kept
    past it until the scheduler side releases them). ``reports`` gets every
    hash this side does not keep as the scheduler side believes. ``stats``
    counts moves the operators see (fills, surplus and lost fills,
    restores). State lock held for every method.
    """

    def __init__(
        self, filler: TierFiller, *, max_bytes: int, fill_timeout_s: float, reports: TierReports | None = None
    ) -> None:
        if max_bytes <= 0:
            raise OmniPrefixCacheUnmatchError(f"host tier: max_bytes must be positive, got {max_bytes}")
        self.filler = filler
        self.max_bytes = int(max_bytes)
        self.fill_timeout_s = float(fill_timeout_s)
        self.reports = reports if reports is not None else TierReports()
        self.entries: dict[BlockHash, TierEntry] = {}
        self.bound: dict[int, BlockHash] = {}
        self.held_bytes = 0
        self.surplus_bytes = 0
        self._warned_surplus = False
        # Hash -> why it was reported (the most recent, bounded): a load of one raises naming it.
        self.reported_why: dict[BlockHash, str] = {}
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)

    # ------------------------------------------------------------ moves

    def move(self, entry: TierEntry, trigger: HostTierTrigger, arg: Any = None) -> bool:
        """Fire ``trigger`` on ``entry`` with the move's argument; False when a
        guard refused it (nothing moved). Raises OmniPrefixCacheUnmatchError
        naming the hash and state when the spec declares no such move."""
        move = TIER_MACHINE.move(entry.state, trigger)
        if move is None:
            raise OmniPrefixCacheUnmatchError(
                f"host tier: {trigger} is illegal from {TierState(entry.state).name} for block hash "
                f"{short(entry.block_hash)} (spec host_tier)"
            )
        for guard in move.guards:
            if not guard(self, entry, arg):
                return False
        entry.state = move.dest
        recorder = TIER_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, entry)
        for effect in move.effects:
            effect(self, entry, arg)
        if int(entry.state) not in _HELD:
            self.entries.pop(entry.block_hash, None)
        else:
            self.entries[entry.block_hash] = entry
        return True

    def state_of(self, block_hash: BlockHash) -> TierState:
        entry = self.entries.get(block_hash)
        return TierState.ABSENT if entry is None else TierState(entry.state)

    # ------------------------------------------------------------ the scheduler side's metadata

    def release(self, hashes: Iterable[BlockHash]) -> None:
        """The scheduler side no longer holds these hashes. One it never bound
        here, or whose fill was lost, is already absent."""
        for block_hash in hashes:
            entry = self.entries.get(block_hash)
            if entry is not None:
                self.move(entry, HostTierTrigger.RELEASE)
                self.stats["released"] += 1

    def bind(self, binds: Iterable[TierBind]) -> None:
        """The scheduler side holds these hashes from now on, their rows in
        the named blocks. A block bound to another hash lost that hash's rows
        without a reuse this side saw: that entry is lost (logged)."""
        for b in binds:
            other = self.bound.get(b.block_id)
            if other is not None and other != b.block_hash:
                stale = self.entries[other]
                logger.warning(
                    "host tier: block %d is bound to %s and now to %s; %s is lost",
                    b.block_id,
                    short(other),
                    short(b.block_hash),
                    short(other),
                )
                self.move(stale, HostTierTrigger.LOSE, f"block {b.block_id} was rebound")
                self.stats["lost"] += 1
            entry = self.entries.get(b.block_hash) or TierEntry(b.block_hash)
            self.move(entry, HostTierTrigger.BIND, b.block_id)
            self.stats["bound"] += 1

    def reuse(self, blocks: Iterable[int]) -> None:
        """These blocks' slots are about to change tenant: each bound one
        starts its fill now (``reuse``)."""
        if not self.bound:
            return
        for block in blocks:
            block_hash = self.bound.get(block)
            if block_hash is not None:
                self.move(self.entries[block_hash], HostTierTrigger.REUSE, block)
                self.stats["fills"] += 1

    def settle(self, only: Iterable[BlockHash] | None = None, *, wait: bool = False) -> None:
        """Move every FILLING entry whose fill is done (all of ``only``, waiting
        up to ``fill_timeout_s`` each, with ``wait``) to HELD; to SURPLUS
        (reported) when its rows would pass ``max_bytes``; to ABSENT
        (reported) when its read failed."""
        if only is None:
            todo = [e for e in self.entries.values() if e.fill is not None]
        else:
            todo = [e for e in map(self.entries.get, only) if e is not None and e.fill is not None]
        for entry in todo:
            fill = entry.fill
            assert fill is not None
            if not fill.done() and not wait:
                continue
            try:
                rows = fill.result(timeout=self.fill_timeout_s)
            except FutureTimeout:
                why = f"its fill did not finish within {self.fill_timeout_s} s"
                self.move(entry, HostTierTrigger.LOSE, why)
                self.stats["lost"] += 1
                continue
            except Exception as exc:
                self.move(entry, HostTierTrigger.LOSE, f"its fill failed: {exc}")
                self.stats["lost"] += 1
                continue
            if self.move(entry, HostTierTrigger.FILLED, rows):
                self.stats["filled"] += 1
                continue
            if not self._warned_surplus:
                self._warned_surplus = True
                logger.warning(
                    "host tier: block hash %s's %d bytes pass this side's bound (PrefixCacheConfig.host_tier_bytes"
                    "=%d, %d held): kept apart and handed back to the scheduler side, which forgets it (vLLM "
                    "recomputes). Give host_tier_bytes at least what omni_tier_max_bytes admits (logged once)",
                    short(entry.block_hash),
                    _rows_nbytes(rows),
                    self.max_bytes,
                    self.held_bytes,
                )
            self.move(entry, HostTierTrigger.OVERFLOW, rows)
            self.stats["surplus"] += 1

    def restore(self, req_id: str, block_hash: BlockHash, block_id: int) -> None:
        """Restore ``block_hash``'s rows into ``block_id`` (a load of
        ``req_id``). An entry still bound to its block is filled first, and
        a FILLING one is waited for. Raises OmniPrefixCacheUnmatchError
        naming the request, hash and block when the tier does not hold it."""
        entry = self.entries.get(block_hash)
        if entry is not None and entry.block is not None:
            self.move(entry, HostTierTrigger.REUSE, entry.block)
            self.stats["fills"] += 1
        if entry is not None and entry.fill is not None:
            self.settle([block_hash], wait=True)
            entry = self.entries.get(block_hash)
        if entry is None or entry.rows is None:
            lost = entry.lost_why if entry is not None and entry.lost_why else self.reported_why.get(block_hash)
            why = f" ({lost}; reported to the scheduler side)" if lost else ""
            raise OmniPrefixCacheUnmatchError(
                f"host tier: request {req_id!r} was loaded into block {block_id} from block hash "
                f"{short(block_hash)}, which the tier does not hold{why}; its rows cannot be served"
            )
        self.move(entry, HostTierTrigger.RESTORE, block_id)
        self.stats["restored"] += 1

    # ------------------------------------------------------------ invariants

    def check_invariants(self, block_size: int) -> None:
        """The spec's invariants on this tier; raises OmniPrefixCacheUnmatchError naming the first break."""
        seen: dict[int, BlockHash] = {}
        total = surplus = 0
        for h, e in self.entries.items():
            state = TierState(e.state)
            if (e.block is not None) != (state is TierState.BOUND):
                raise OmniPrefixCacheUnmatchError(
                    f"host tier block_iff_bound: {short(h)} is {state.name}, block {e.block}"
                )
            if e.block is not None:
                if e.block in seen or self.bound.get(e.block) != h:
                    raise OmniPrefixCacheUnmatchError(
                        f"host tier block_iff_bound: block {e.block} bound twice or not indexed"
                    )
                seen[e.block] = h
            if (e.fill is not None) != (state is TierState.FILLING):
                raise OmniPrefixCacheUnmatchError(f"host tier fill_iff_filling: {short(h)} is {state.name}")
            if (e.rows is not None) != (state in _WITH_ROWS):
                raise OmniPrefixCacheUnmatchError(f"host tier rows_iff_held: {short(h)} is {state.name}")
            if e.rows is not None:
                bad = {k: int(t.shape[0]) for k, t in e.rows.items() if int(t.shape[0]) != block_size}
                if bad:
                    raise OmniPrefixCacheUnmatchError(f"host tier rows_iff_held: {short(h)} holds rows {bad}")
                if state is TierState.HELD:
                    total += _rows_nbytes(e.rows)
                else:
                    surplus += _rows_nbytes(e.rows)
        if len(seen) != len(self.bound):
            raise OmniPrefixCacheUnmatchError(
                f"host tier block_iff_bound: index {sorted(self.bound)} vs {sorted(seen)}"
            )
        if total != self.held_bytes or total > self.max_bytes or surplus != self.surplus_bytes:
            raise OmniPrefixCacheUnmatchError(
                f"host tier bytes_within_bound: rows hold {total} bytes, counted {self.held_bytes}, "
                f"bound {self.max_bytes}; surplus rows {surplus} bytes, counted {self.surplus_bytes}"
            )
