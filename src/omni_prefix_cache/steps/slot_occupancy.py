"""Slot occupancy per (slot, key), driven by the compiled ``slot_occupancy`` spec.

Each pool key has four tables with one row per KV slot (``slot_tables``):
``state`` (a ``SlotState``), ``tids`` (the owning write, -1 when none),
``slot_version`` (+1 per reuse of a committed slot) and ``writer`` (the
save, a tenancy, that last mapped it: a rejection of its speculative drafts
moves only slots no later save wrote). A move is applied to a whole slot
tensor at once, per source-state group, on numpy views of the tables.

Threading: a ``SlotOccupancy`` has no lock of its own. The manager calls it
under its state lock only (the hooks it installs run under that lock too).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from omni_prefix_cache.device.index_tensors import all_set, int64_ids, out_of_range, uniform_value
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, TensorName, Tid
from omni_prefix_cache.specs import CompiledMove, compile_machine, load_spec
from omni_prefix_cache.specs.composition import load_protocol
from omni_prefix_cache.specs.types.slot_occupancy import SlotOccupancyTrigger
from omni_prefix_cache.specs.types.slot_occupancy import SlotState as SlotState  # re-exported
from omni_prefix_cache.steps.slot_tables import NO_OWNER, KeyArrays, KeySlots, SlotGroup, check_tables
from omni_prefix_cache.steps.validation import listed

# ------------------------------------------------------------ spec handlers
# Signature (occupancy, group). Guards return a bool mask over the group's
# rows; effects mutate the tables or call the occupancy's hooks.


def _owned_by_writer(occ: SlotOccupancy, group: SlotGroup) -> np.ndarray:
    owned: np.ndarray = occ._arrays[group.key].tids[group.slots] == group.owners
    return owned


def _written_by_step(occ: SlotOccupancy, group: SlotGroup) -> np.ndarray:
    # No later save, and no restore, wrote the slot since the rejecting step's save.
    mine: np.ndarray = occ._arrays[group.key].writer[group.slots] == group.tenancy
    return mine


def _set_owner(occ: SlotOccupancy, group: SlotGroup) -> None:
    occ._arrays[group.key].tids[group.slots] = group.owners


def _stamp_writer(occ: SlotOccupancy, group: SlotGroup) -> None:
    occ._arrays[group.key].writer[group.slots] = occ.tenancy


def _clear_writer(occ: SlotOccupancy, group: SlotGroup) -> None:
    occ._arrays[group.key].writer[group.slots] = NO_OWNER


def _clear_owner(occ: SlotOccupancy, group: SlotGroup) -> None:
    occ._arrays[group.key].tids[group.slots] = NO_OWNER


def _bump_version(occ: SlotOccupancy, group: SlotGroup) -> None:
    # Gather-add-scatter: a slot listed twice in one map is still one reuse
    # (its copies all write the same bumped value).
    versions = occ._arrays[group.key].slot_version
    versions[group.slots] = versions[group.slots] + 1


def _record_takeover(occ: SlotOccupancy, group: SlotGroup) -> None:
    # The spec's `reassign_from_old_owner`. Runs before set_owner (spec
    # order), so `tids` still names the old owner.
    old = occ._arrays[group.key].tids[group.slots]
    # A task remapping its own slot loses nothing; a rejection (no new owner) takes every row.
    taken = old != group.owners if group.tenancy < 0 else old != NO_OWNER
    if not taken.any():
        return
    old, slots = old[taken], group.slots[taken]
    hook = occ.on_takeover
    if hook is None:
        return
    for tid in dict.fromkeys(old.tolist()):  # usually one or two owners
        hook(int(tid), group.key, torch.from_numpy(slots[old == tid]))


def _preserve_pending_reads(occ: SlotOccupancy, group: SlotGroup) -> None:
    hook = occ.on_reuse
    if hook is not None:
        hook(group.key, torch.from_numpy(group.slots))


SLOT_MACHINE = compile_machine(
    load_spec("slot_occupancy"),
    guards={"owned_by_writer": _owned_by_writer, "written_by_step": _written_by_step},
    effects={
        "set_owner": _set_owner,
        "stamp_writer": _stamp_writer,
        "clear_writer": _clear_writer,
        "reassign_from_old_owner": _record_takeover,
        "preserve_pending_reads": _preserve_pending_reads,
        "bump_version": _bump_version,
        "clear_owner": _clear_owner,
    },
    state_enum=SlotState,
)
# The slot moves the protocol's drain operation fires (where enabled).
_SETTLE_TRIGGERS = frozenset(
    SlotOccupancyTrigger(t) for role, t in load_protocol().ops["drain"].moves if role == "slot"
)
INITIAL = int(SLOT_MACHINE.initial)


# Hooks the manager installs. on_takeover(old_tid, key, slots): a newer write
# took these in-transit rows over from old_tid. on_reuse(key, slots): these
# committed rows are about to be overwritten by a new tenant.
TakeoverHook = Callable[[Tid, TensorName, torch.Tensor], None]
ReuseHook = Callable[[TensorName, torch.Tensor], None]


class SlotOccupancy:
    """Occupancy tables for every pool key, moved by the compiled spec.

    ``state`` maps key -> int8 state tensor (the seed suite reads it
    directly). Callers hold the manager's state lock for every method.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        on_takeover: TakeoverHook | None = None,
        on_reuse: ReuseHook | None = None,
    ) -> None:
        if int(num_slots) <= 0:
            raise OmniPrefixCacheUnmatchError(f"slot occupancy: num_slots must be positive, got {num_slots}")
        self.num_slots = int(num_slots)
        self.on_takeover = on_takeover
        self.on_reuse = on_reuse
        # The current tenancy: each take_tenancy (a save) is a new one, and
        # every slot a map moves records it (effect stamp_writer).
        self.tenancy = 0
        self._keys: dict[TensorName, KeySlots] = {}
        self._arrays: dict[TensorName, KeyArrays] = {}
        self.state: dict[TensorName, torch.Tensor] = {}
        n_states = len(SlotState)
        # Slot tenancy (the spec's couplings): the triggers a save (take_tenancy)
        # or a tier restore (restore_tenancy) fires on the keys it writes and
        # on every other open key.
        couplings = {c.name: c for c in SLOT_MACHINE.spec.couplings}
        for name in ("take_tenancy", "restore_tenancy"):
            if name not in couplings:
                raise OmniPrefixCacheUnmatchError(f"{SLOT_MACHINE.spec.origin}: no {name!r} coupling declared")
        tenancy, restore = couplings["take_tenancy"], couplings["restore_tenancy"]
        self._tenant_writes = SlotOccupancyTrigger(tenancy.fires)
        self._tenant_others = SlotOccupancyTrigger(tenancy.others)
        self._restore_writes = SlotOccupancyTrigger(restore.fires)
        self._restore_others = SlotOccupancyTrigger(restore.others)
        # Per trigger: the move from each source state (None where the spec
        # declares none), and the source states that make it illegal.
        self._moves: dict[SlotOccupancyTrigger, tuple[CompiledMove | None, ...]] = {}
        self._illegal: dict[SlotOccupancyTrigger, tuple[int, ...]] = {}
        for trigger in map(SlotOccupancyTrigger, SLOT_MACHINE.triggers):
            row = tuple(SLOT_MACHINE.move(s, trigger) for s in range(n_states))
            self._moves[trigger] = row
            self._illegal[trigger] = tuple(s for s, m in enumerate(row) if m is None)

    # ------------------------------------------------------------ keys

    def add_key(self, key: TensorName) -> KeySlots:
        """Open ``key``'s tables (all ABSENT, no owner, version 0); idempotent.
        Manager, under its state lock, when the pool key is published."""
        table = self._keys.get(key)
        if table is None:
            table = KeySlots(
                state=torch.full((self.num_slots,), INITIAL, dtype=torch.int8),
                tids=torch.full((self.num_slots,), NO_OWNER, dtype=torch.int64),
                slot_version=torch.zeros((self.num_slots,), dtype=torch.int64),
                writer=torch.full((self.num_slots,), NO_OWNER, dtype=torch.int64),
            )
            self._keys[key] = table
            self._arrays[key] = KeyArrays(
                table.state.numpy(), table.tids.numpy(), table.slot_version.numpy(), table.writer.numpy()
            )
            self.state[key] = table.state
        return table

    def has_key(self, key: TensorName) -> bool:
        return key in self._keys

    def keys(self) -> list[TensorName]:
        """Open keys, in opening order."""
        return list(self._keys)

    def get_slot_status(self, key: TensorName) -> KeySlots:
        """The tables of ``key``; raises OmniPrefixCacheUnmatchError naming an unknown key."""
        table = self._keys.get(key)
        if table is None:
            raise self._unknown(key)
        return table

    def _unknown(self, key: TensorName) -> OmniPrefixCacheUnmatchError:
        return OmniPrefixCacheUnmatchError(f"slot occupancy: unknown key {key!r} (open: {sorted(self._keys)})")

    # ------------------------------------------------------------ moves

    def apply(
        self,
        trigger: SlotOccupancyTrigger,
        key: TensorName,
        slots: torch.Tensor,
        owners: torch.Tensor | int,
        *,
        where_enabled: bool = False,
        tenancy: int = -1,
    ) -> int:
        """Fire ``trigger`` on every row of ``slots`` for ``key``; returns how
        many rows moved (a guard-refused row stays). Raises
        OmniPrefixCacheUnmatchError naming key, trigger, source state and
        slots when a row has no such move, changing nothing; with
        ``where_enabled`` (``slot.trigger?``) such rows stay. ``tenancy``:
        the rejecting save's (``reject``). State lock."""
        return self._apply(trigger, key, self._as_slots(key, slots), owners, where_enabled, tenancy)

    def _apply(
        self,
        trigger: SlotOccupancyTrigger,
        key: TensorName,
        slots: np.ndarray,
        owners: torch.Tensor | np.ndarray | int,
        where_enabled: bool,
        tenancy: int = -1,
    ) -> int:
        """``apply`` over slots already checked by ``_as_slots`` (owners as
        given to ``apply``, or already converted by ``_as_owners``;
        ``tenancy``: the rejecting save's, for reject)."""
        arrays = self._arrays.get(key)
        if arrays is None:
            raise self._unknown(key)
        state = arrays.state
        moves = self._moves.get(trigger)
        if moves is None:
            raise OmniPrefixCacheUnmatchError(f"slot occupancy: unknown trigger {trigger!r} for key {key!r}")
        n = int(slots.size)
        if n == 0:
            return 0
        owner_rows = self._as_owners(owners, n)
        src = state[slots]
        moved = 0
        recorder = SLOT_MACHINE.recorder
        for move, group in self._groups(key, trigger, moves, src, slots, owner_rows, where_enabled):
            if tenancy >= 0:
                group = group._replace(tenancy=tenancy)
            for guard in move.guards:
                ok = guard(self, group)
                if not all_set(ok):
                    group = SlotGroup(
                        key, group.slots[ok], group.owners[ok] if group.owners.ndim else group.owners, tenancy
                    )
            if group.slots.size == 0:
                continue
            state[group.slots] = int(move.dest)
            for effect in move.effects:
                effect(self, group)
            moved += int(group.slots.size)
            if recorder is not None:
                recorder.counted(move, int(group.slots.size), group)
        return moved

    def _groups(
        self,
        key: TensorName,
        trigger: SlotOccupancyTrigger,
        moves: tuple[CompiledMove | None, ...],
        src: np.ndarray,
        slots: np.ndarray,
        owners: np.ndarray,
        where_enabled: bool,
    ) -> list[tuple[CompiledMove, SlotGroup]]:
        """Split rows by source state, raising first (unless
        ``where_enabled``) if any row is in a state without the move. Every
        group is cut from the state snapshot taken before any group moves,
        so a group's move never re-routes another group's rows. A few array
        ops: one count per state, then one mask per state present, whatever
        the number of rows."""
        single = uniform_value(src)  # the common case: every row starts in one state
        if single is not None:
            if not where_enabled and single in self._illegal[trigger]:
                self._refuse(key, trigger, single, slots)
            move = moves[single]
            return [] if move is None else [(move, SlotGroup(key, slots, owners))]
        counts: list[int] = np.bincount(src, minlength=len(moves)).tolist()
        if not where_enabled:
            for bad in self._illegal[trigger]:
                if counts[bad]:
                    self._refuse(key, trigger, bad, slots[src == bad])
        groups: list[tuple[CompiledMove, SlotGroup]] = []
        for state, move in enumerate(moves):
            if move is None or not counts[state]:
                continue
            rows = src == state  # a mask keeps row order: a slot listed twice stays in order
            groups.append((move, SlotGroup(key, slots[rows], owners if owners.ndim == 0 else owners[rows])))
        return groups

    @staticmethod
    def _refuse(key: TensorName, trigger: SlotOccupancyTrigger, state: int, slots: np.ndarray) -> None:
        raise OmniPrefixCacheUnmatchError(
            f"slot occupancy {key!r}: {trigger} is illegal from {SlotState(state).name} "
            f"for slots {listed(slots)} (spec slot_occupancy)"
        )

    def map(self, key: TensorName, slots: torch.Tensor, owners: torch.Tensor | int) -> int:
        """A write maps ``slots`` (ABSENT/IN_TRANSIT/COMMITTED -> IN_TRANSIT,
        owned by ``owners``). A takeover hands the rows it took to the old
        owner (``on_takeover``); reuse of a committed slot preserves pending reads and bumps
        its version. Under the state lock."""
        return self.apply(SlotOccupancyTrigger.MAP, key, slots, owners)

    def take_tenancy(self, slots: torch.Tensor, writes: Mapping[TensorName, torch.Tensor | np.ndarray | int]) -> int:
        """A save's step takes ``slots`` for its writes (coupling
        ``take_tenancy``): every key in ``writes`` fires the coupling's
        ``fires`` trigger (``map``, owned by the given tids), every other
        open key fires ``others`` (``reset``: its rows become absent, never
        the previous tenant's). Returns the save's tenancy (a new one per
        call, stamped on the slots it maps). Under the state lock."""
        self.tenancy += 1
        first = next(iter(writes), next(iter(self._keys), None))
        if int(slots.numel()) == 0 or first is None:
            return self.tenancy
        # One check of the slots for every key's move (named after the key
        # moved first, as a per-key check would be).
        self.get_slot_status(first)
        rows = self._as_slots(first, slots)
        for key, owners in writes.items():
            self._apply(self._tenant_writes, key, rows, owners, False)
        for key in self._keys:
            if key not in writes:
                self._apply(self._tenant_others, key, rows, NO_OWNER, False)
        return self.tenancy

    def reject(self, slots: torch.Tensor, tenancy: int) -> int:
        """``slot.reject?`` of a step's rejected drafts (``slots``): every
        open key the save of ``tenancy`` mapped last moves to REJECTED (an
        owner skips it at its pool write, a committed row's version moves).
        Returns the rows moved over all keys. State lock and reads lock."""
        if int(slots.numel()) == 0 or not self._keys or tenancy < 0:
            return 0
        rows = self._as_slots(next(iter(self._keys)), slots)
        moved = 0
        for key in self._keys:
            moved += self._apply(SlotOccupancyTrigger.REJECT, key, rows, NO_OWNER, True, tenancy)
        return moved

    def restore_tenancy(self, slots: torch.Tensor, keys: Collection[TensorName]) -> None:
        """The host tier restores a block into ``slots`` (coupling
        ``restore_tenancy``): every key in ``keys`` fires ``restore``
        (COMMITTED, no owner; the caller writes the rows to the pool under
        the same lock), every other open key fires ``reset``. Under the
        state lock and the reads lock (version bumps and preserved copies
        change together)."""
        if int(slots.numel()) == 0 or not self._keys:
            return
        first = next(iter(self._keys))
        rows = self._as_slots(first, slots)
        for key in self._keys:
            trigger = self._restore_writes if key in keys else self._restore_others
            self._apply(trigger, key, rows, NO_OWNER, False)

    def commit(self, key: TensorName, slots: torch.Tensor, writers: torch.Tensor | int) -> int:
        """Strict ``commit``: every row must be IN_TRANSIT (else raises);
        rows now owned by another write stay. Under the state lock."""
        return self.apply(SlotOccupancyTrigger.COMMIT, key, slots, writers)

    def drop(self, key: TensorName, slots: torch.Tensor, writers: torch.Tensor | int) -> int:
        """Strict ``drop`` (the writer failed): IN_TRANSIT -> ABSENT for rows
        it still owns. Under the state lock."""
        return self.apply(SlotOccupancyTrigger.DROP, key, slots, writers)

    def settle(
        self, trigger: SlotOccupancyTrigger, key: TensorName, slots: torch.Tensor, writers: torch.Tensor | int
    ) -> int:
        """The drain's ``slot.commit?`` / ``slot.drop?`` (operation ``drain``)
        for a drained write's own rows, where enabled: a row already moved
        on was taken over, and ``owned_by_writer`` leaves rows another write
        owns. State lock; raises for a trigger the drain does not fire."""
        return self.settle_keys(trigger, (key,), slots, writers)

    def settle_keys(
        self,
        trigger: SlotOccupancyTrigger,
        keys: Sequence[TensorName],
        slots: torch.Tensor,
        writers: torch.Tensor | np.ndarray | int,
    ) -> int:
        """``settle`` of the same rows for each of ``keys`` in order; returns
        the rows moved over all keys. Slots and writers (or one int64 writer
        per row) are checked and converted once, as the first key's would be."""
        if trigger not in _SETTLE_TRIGGERS:
            raise OmniPrefixCacheUnmatchError(
                f"slot occupancy: settle takes {sorted(map(str, _SETTLE_TRIGGERS))} (protocol drain), not {trigger!r}"
            )
        if not keys:
            return 0
        rows = self._as_slots(keys[0], slots)
        if keys[0] not in self._arrays:
            raise self._unknown(keys[0])
        owners = self._as_owners(writers, int(rows.size)) if rows.size else writers
        moved = 0
        for key in keys:
            moved += self._apply(trigger, key, rows, owners, True)
        return moved

    # ------------------------------------------------------------ checks

    def check_invariants(self, live_tids: set[Tid] | None = None) -> None:
        """Raise OmniPrefixCacheUnmatchError naming the key and slots that break
        ``owner_iff_in_transit``, or ``owner_is_live_task`` given ``live_tids``."""
        check_tables(self._keys, live_tids)

    # ------------------------------------------------------------ helpers

    def _as_slots(self, key: TensorName, slots: torch.Tensor) -> np.ndarray:
        """The slots as a 1-D int64 array (a view of a CPU int64 tensor);
        raises naming the key for non-integer or out-of-range slots."""
        if not isinstance(slots, torch.Tensor):
            slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise OmniPrefixCacheUnmatchError(f"slot occupancy {key!r}: slots must be integers, got {slots.dtype}")
        rows = int64_ids(slots)
        if out_of_range(rows, self.num_slots):
            bad = rows[(rows < 0) | (rows >= self.num_slots)]
            raise OmniPrefixCacheUnmatchError(
                f"slot occupancy {key!r}: slots {listed(bad)} outside [0, {self.num_slots})"
            )
        return rows

    @staticmethod
    def _as_owners(owners: torch.Tensor | np.ndarray | int, n: int) -> np.ndarray:
        if isinstance(owners, np.ndarray):  # per row (settle_keys), or 0-d: one owner of every row
            if owners.ndim and owners.size != n:
                raise OmniPrefixCacheUnmatchError(f"slot occupancy: {owners.size} owners for {n} slots")
            return owners
        if isinstance(owners, torch.Tensor):
            if owners.numel() == 1 and n != 1:  # one owner of every row, 0-d
                return np.array(int(owners.reshape(())), dtype=np.int64)
            if int(owners.numel()) != n:
                raise OmniPrefixCacheUnmatchError(f"slot occupancy: {owners.numel()} owners for {n} slots")
            return int64_ids(owners)
        return np.array(int(owners), dtype=np.int64)
