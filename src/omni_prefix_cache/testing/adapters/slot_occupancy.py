"""``SlotOccupancyAdapter``: plays ``slot_occupancy`` on ``omni_prefix_cache.steps.slot_occupancy.SlotOccupancy``.

Maps each trigger to the runtime call(s) that fire it, reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime (see ``testing.stateful``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheUnmatchError,
)
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.specs.types import SlotOccupancyTrigger
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    EnvRule,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    Refused,
    SpecAdapter,
)

# The second key of the occupancy under test: moved only by take_tenancy.
_OTHER_KEY = "m"


class _OccSystem:
    """A SlotOccupancy over the key under test and a second key that only
    slot tenancy moves, with its manager hooks recorded per key."""

    def __init__(self, num_slots: int):
        from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy

        self.occ = SlotOccupancy(num_slots, on_takeover=self._on_takeover, on_reuse=self._on_reuse)
        self.table = self.occ.add_key(HIDDEN_KEY)
        self.other = self.occ.add_key(_OTHER_KEY)
        self.reassigned: dict[int, frozenset[int]] = {}
        self.other_reassigned: dict[int, frozenset[int]] = {}
        self.reuses: dict[int, int] = {}
        self.rejects: dict[int, int] = {}  # rejections of a committed row (they bump its version too)
        self.seen_versions: dict[int, int] = {}

    def _on_takeover(self, tid: int, key: str, slots: torch.Tensor) -> None:
        book = self.reassigned if key == HIDDEN_KEY else self.other_reassigned
        book[tid] = book.get(tid, frozenset()) | frozenset(slots.tolist())

    def _on_reuse(self, key: str, slots: torch.Tensor) -> None:
        if key != HIDDEN_KEY:
            return
        for s in slots.tolist():
            self.reuses[s] = self.reuses.get(s, 0) + 1


class SlotOccupancyAdapter(SpecAdapter):
    """``slot_occupancy`` against SlotOccupancy (one key, ``num_slots`` rows).

    A handle is one slot. ``map`` draws the new owner tid, ``commit`` /
    ``drop`` the writer (mostly the current owner). Observed effects:
    ``set_owner`` / ``clear_owner`` as the slot's tid, ``bump_version`` as
    its version, ``reassign_from_old_owner`` as the slots the manager's
    on_takeover hook records per old owner, ``preserve_pending_reads`` as
    the on_reuse hook calls per slot, ``stamp_writer`` / ``clear_writer`` as
    the slot's writer (the tenancy current at a map: the occupancy's
    counter, which take_tenancy advances; -1 after a restore). ``reset`` has
    no new owner (tid -1); ``reject`` draws the rejecting tenancy (mostly
    the slot's writer, so guard ``written_by_step`` holds).
    An environment rule applies one trigger to several slots in one
    vectorised call (all or nothing when a row is illegal); another takes
    slot tenancy (the ``take_tenancy`` coupling) writing the key under test
    and maybe the second key, which must then be IN_TRANSIT with the
    tenant or, when not written, ABSENT (``tenant_owns_all_keys``).
    """

    handle_name = "slot"
    max_handles = 4
    tids = 3

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("slot_occupancy")
        unknown = sorted(set(self.spec.triggers) - {"map", "commit", "drop", "reset", "restore", "reject"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: SlotOccupancy has no call for triggers {unknown}")
        self.tenancy = {c.name: c for c in self.spec.couplings}.get("take_tenancy")

    def new_system(self) -> _OccSystem:
        return _OccSystem(self.max_handles)

    def create(self, system: _OccSystem, handle: int, args: Mapping[str, Any]) -> None:
        pass  # every slot row exists from the start; the handle brings it under test

    def fire(self, system: _OccSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        committed = self.read_state(system, handle) == "COMMITTED"
        moved = system.occ.apply(
            SlotOccupancyTrigger(trigger),
            HIDDEN_KEY,
            torch.tensor([handle]),
            args["tid"],
            tenancy=args.get("tenancy", -1),
        )
        if moved != 1:
            raise Refused(f"{trigger}: {moved} rows moved")
        if trigger == "reject" and committed:
            system.rejects[handle] = system.rejects.get(handle, 0) + 1

    def read_state(self, system: _OccSystem, handle: int) -> str:
        from omni_prefix_cache.steps.slot_occupancy import SlotState

        return SlotState(int(system.table.state[handle])).name

    def observe(self, system: _OccSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            out[("owner", h)] = int(system.table.tids[h])
            out[("version", h)] = int(system.table.slot_version[h])
            out[("reuses", h)] = system.reuses.get(h, 0)
            out[("writer", h)] = int(system.table.writer[h])
        for tid, slots in system.reassigned.items():
            out[("reassigned", tid)] = slots
        return out

    # ------------------------------------------------------------ model
    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update({("owner", handle): -1, ("version", handle): 0, ("reuses", handle): 0, ("writer", handle): -1})

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {
            "owned_by_writer": lambda ctx: ctx.model.obs[("owner", ctx.handle)] == ctx.args["tid"],
            "written_by_step": lambda ctx: ctx.model.obs[("writer", ctx.handle)] == ctx.args.get("tenancy", -1),
        }

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def set_owner(ctx: MoveCtx) -> None:
            ctx.model.obs[("owner", ctx.handle)] = ctx.args["tid"]

        def clear_owner(ctx: MoveCtx) -> None:
            ctx.model.obs[("owner", ctx.handle)] = -1

        def bump_version(ctx: MoveCtx) -> None:
            ctx.model.obs[("version", ctx.handle)] += 1

        def preserve_pending_reads(ctx: MoveCtx) -> None:
            ctx.model.obs[("reuses", ctx.handle)] += 1

        def reassign_from_old_owner(ctx: MoveCtx) -> None:
            old = ctx.model.obs[("owner", ctx.handle)]
            if old != ctx.args["tid"]:  # remapping its own slot takes nothing
                key = ("reassigned", old)
                ctx.model.obs[key] = ctx.model.obs.get(key, frozenset()) | {ctx.handle}

        def stamp_writer(ctx: MoveCtx) -> None:
            ctx.model.obs[("writer", ctx.handle)] = ctx.model.env.get("tenancy", 0)

        def clear_writer(ctx: MoveCtx) -> None:
            ctx.model.obs[("writer", ctx.handle)] = -1

        return {
            "stamp_writer": stamp_writer,
            "clear_writer": clear_writer,
            "set_owner": set_owner,
            "clear_owner": clear_owner,
            "bump_version": bump_version,
            "preserve_pending_reads": preserve_pending_reads,
            "reassign_from_old_owner": reassign_from_old_owner,
        }

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if trigger == "reject":
            # A rejection takes the row from any owner; its tenancy is mostly the one that wrote the slot.
            writer = model.obs[("writer", handle)]
            other = model.env.get("tenancy", 0) + 1
            return {"tid": -1, "tenancy": data.draw(st.sampled_from(sorted({max(writer, 0), other})), label="tenancy")}
        if trigger == "restore" or (self.tenancy is not None and trigger == self.tenancy.others):
            # The key loses its rows to a tenant that does not write it, or
            # the host tier restores them: no owner either way.
            return {"tid": -1}
        owner = model.obs[("owner", handle)]
        if trigger != "map" and owner >= 0 and data.draw(st.booleans(), label="the owner writes"):
            return {"tid": owner}
        return {"tid": data.draw(st.integers(0, self.tids - 1), label="tid")}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if outcome == "blocked":
            return Refusal(Refused)  # a guard-refused row stays; apply reports 0 moved
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger} is illegal from")

    def env_rules(self) -> Sequence[EnvRule]:
        def vector(machine: GeneratedMachine, data: Any) -> None:
            handles = sorted(machine.model.states)
            picked = data.draw(st.lists(st.sampled_from(handles), min_size=2, unique=True), label="slots")
            trigger = data.draw(st.sampled_from(self.spec.triggers), label="trigger")
            rows = [(h, self.trigger_args(data, machine.model, h, trigger)) for h in picked]
            if trigger == "reject":  # one rejecting tenancy for the whole call
                rows = [(h, {**a, "tenancy": rows[0][1]["tenancy"]}) for h, a in rows]
            outcomes = [machine.model_outcome(h, trigger, a) for h, a in rows]
            committed = [h for h, _ in rows if machine.model.states[h] == "COMMITTED"]
            call: Callable[[], Any] = lambda: machine.system.occ.apply(  # noqa: E731
                trigger,
                HIDDEN_KEY,
                torch.tensor(picked),
                torch.tensor([a["tid"] for _, a in rows]),
                tenancy=rows[0][1].get("tenancy", -1),
            )
            where = f"vectorised {trigger} on slots {picked}"
            if any(o == "illegal" for o, _ in outcomes):
                machine.expect_refusal(where, Refusal(OmniPrefixCacheUnmatchError, "is illegal from"), call)
                return
            moved = call()
            expected = sum(o == "moved" for o, _ in outcomes)
            if moved != expected:
                raise Discrepancy(f"{where}: {moved} rows moved, spec {expected}")
            for (h, a), (o, move) in zip(rows, outcomes, strict=True):
                if o == "moved" and move is not None:
                    machine.apply_model_move(h, move, a)
                    if trigger == "reject" and h in committed:
                        machine.system.rejects[h] = machine.system.rejects.get(h, 0) + 1

        def take_tenancy(machine: GeneratedMachine, data: Any) -> None:
            assert self.tenancy is not None
            handles = sorted(machine.model.states)
            picked = data.draw(st.lists(st.sampled_from(handles), min_size=1, unique=True), label="slots")
            tid = data.draw(st.integers(0, self.tids - 1), label="tenant tid")
            both = data.draw(st.booleans(), label=f"the tenant writes {_OTHER_KEY!r} too")
            writes: dict[str, Any] = {HIDDEN_KEY: tid, **({_OTHER_KEY: tid} if both else {})}
            machine.system.occ.take_tenancy(torch.tensor(picked), writes)
            machine.model.env["tenancy"] = machine.model.env.get("tenancy", 0) + 1  # a new tenancy stamps the maps
            other = machine.model.env.setdefault("other", {})
            lost = machine.model.env.setdefault("other_reassigned", {})
            for h in picked:
                outcome, move = machine.model_outcome(h, self.tenancy.fires, {"tid": tid})
                if outcome != "moved" or move is None:
                    raise Discrepancy(f"take_tenancy: {self.tenancy.fires} is {outcome} from {machine.model.states[h]}")
                machine.apply_model_move(h, move, {"tid": tid})
                old = other.get(h, ("ABSENT", -1))
                # Reset takes the rows from any owner, a takeover from another one.
                if old[0] == "IN_TRANSIT" and (not both or old[1] != tid):
                    lost[old[1]] = lost.get(old[1], frozenset()) | {h}
                other[h] = ("IN_TRANSIT", tid) if both else ("ABSENT", -1)
            machine.check_agree(f"take_tenancy of slots {picked} by tid {tid} (writes {sorted(writes)})")

        rules = [EnvRule("vector_apply", vector, lambda model: len(model.states) >= 2)]
        if self.tenancy is not None:
            rules.append(EnvRule("take_tenancy", take_tenancy, lambda model: len(model.states) >= 1))
        return tuple(rules)

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def owner_iff_in_transit(m: GeneratedMachine) -> None:
            m.system.occ.check_invariants()
            t = m.system.table
            bad = ((t.state == 1) != (t.tids != -1)).nonzero().flatten().tolist()
            if bad:
                raise Discrepancy(f"slots {bad}: owner set iff IN_TRANSIT broken")

        def version_monotonic(m: GeneratedMachine) -> None:
            for h in m.model.states:
                v = int(m.system.table.slot_version[h])
                if v < m.system.seen_versions.get(h, 0):
                    raise Discrepancy(f"slot {h}: version went down to {v}")
                bumps = m.system.reuses.get(h, 0) + m.system.rejects.get(h, 0)
                if v != bumps:
                    raise Discrepancy(f"slot {h}: version {v} after {bumps} reuses and rejections of committed rows")
                m.system.seen_versions[h] = v

        def tenant_owns_all_keys(m: GeneratedMachine) -> None:
            from omni_prefix_cache.steps.slot_occupancy import SlotState

            t = m.system.other
            for h, (state, owner) in m.model.env.get("other", {}).items():
                got = (SlotState(int(t.state[h])).name, int(t.tids[h]))
                if got != (state, owner):
                    raise Discrepancy(f"slot {h}: key {_OTHER_KEY!r} is {got} after its last tenancy, expected {state}")
            want = m.model.env.get("other_reassigned", {})
            if m.system.other_reassigned != want:
                raise Discrepancy(
                    f"key {_OTHER_KEY!r}: rows taken from old owners {m.system.other_reassigned}, expected {want}"
                )

        return {
            "owner_iff_in_transit": owner_iff_in_transit,
            "version_monotonic": version_monotonic,
            "tenant_owns_all_keys": tenant_owns_all_keys,
        }

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {
            "owner_is_live_task": "needs the manager's task registry; the composed model check covers it",
            "rejected_never_served": "a hit's planned reads are the manager's: the composed model check "
            "(copy_on_write, rows_fetched) and the protocol tests' row oracle cover it",
        }
