"""``PlannedReadAdapter``: plays ``planned_read`` on ``omni_prefix_cache.reads.planned_read.PlannedReads``.

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
from omni_prefix_cache.specs.types import PlannedReadTrigger
from omni_prefix_cache.testing.specfacts import states_after
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    EnvRule,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    SpecAdapter,
)


class _ReadSystem:
    """PlannedReads over a two-slot pool, plus the slot versions and values
    a reuse would bump and overwrite (what occupancy and the committer do)."""

    slots = 2

    def __init__(self) -> None:
        from omni_prefix_cache.block_pool import PrefixBlockPool
        from omni_prefix_cache.interface import PrefixCacheConfig
        from omni_prefix_cache.reads.planned_read import PlannedReads

        self.pool = PrefixBlockPool(PrefixCacheConfig(num_blocks=1, block_size=self.slots))
        self.pool.ensure_key(HIDDEN_KEY, torch.float32, 2)
        self.reads = PlannedReads(self.pool)
        self.refs: dict[int, Any] = {}
        self.version = [0] * self.slots
        self.planned_value: dict[int, float] = {}
        self._writes = 0
        for slot in range(self.slots):
            self.overwrite(slot)

    def overwrite(self, slot: int) -> None:
        self._writes += 1
        self.pool.write(HIDDEN_KEY, torch.tensor([slot]), torch.full((1, 2), float(self._writes)))

    def value(self, slot: int) -> float:
        return float(self.pool.rows(HIDDEN_KEY, torch.tensor([slot]))[0, 0])


class PlannedReadAdapter(SpecAdapter):
    """``planned_read`` against PlannedReads (the manager's planned reads).

    A handle is one read of one slot (``handle % 2``). Every trigger is a
    ``PlannedReads.move`` on the read; an environment rule reuses a slot the
    way a new tenant's map does: the bulk ``preserve`` over every live read
    of it, then the version bump and the overwrite of the pool row.
    Observed: ``add_pending`` / ``forget_pending`` as membership of the
    pending index, ``copy_old_rows`` as the read's preserved slots.
    """

    handle_name = "read"
    max_handles = 4

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("planned_read")
        unknown = sorted(set(self.spec.triggers) - {"register", "refuse", "preserve", "fetch", "serve", "fail", "drop"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: PlannedReads has no call for triggers {unknown}")
        always_added, _ = states_after(self.spec, lambda m: "add_pending" in m.effects)
        _, maybe_forgotten = states_after(self.spec, lambda m: "forget_pending" in m.effects)
        self.live = always_added - maybe_forgotten

    @staticmethod
    def _slot(handle: int) -> int:
        return handle % _ReadSystem.slots

    def new_system(self) -> _ReadSystem:
        return _ReadSystem()

    def create(self, system: _ReadSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.reads.planned_read import PlannedRead

        slot = self._slot(handle)
        system.refs[handle] = PlannedRead(
            req_id=f"r{handle}",
            key=HIDDEN_KEY,
            slots=torch.tensor([slot]),
            planned_version=torch.tensor([system.version[slot]]),
        )
        system.planned_value[handle] = system.value(slot)

    def fire(self, system: _ReadSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        reused = {self._slot(handle)} if trigger == "preserve" else None
        system.reads.move(system.refs[handle], PlannedReadTrigger(trigger), reused)

    def read_state(self, system: _ReadSystem, handle: int) -> str:
        from omni_prefix_cache.reads.planned_read import ReadState

        return ReadState(int(system.refs[handle].state)).name

    def observe(self, system: _ReadSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            ref = system.refs[h]
            indexed = ref in system.reads.by_key.get(HIDDEN_KEY, ())
            out[("pending", h)] = (ref in system.reads.pending, indexed)
            out[("preserved", h)] = frozenset(ref.preserved)
        return out

    # ------------------------------------------------------------ model
    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update({("pending", handle): (False, False), ("preserved", handle): frozenset()})

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def add_pending(ctx: MoveCtx) -> None:
            ctx.model.obs[("pending", ctx.handle)] = (True, True)

        def forget_pending(ctx: MoveCtx) -> None:
            ctx.model.obs[("pending", ctx.handle)] = (False, False)

        def copy_old_rows(ctx: MoveCtx) -> None:
            ctx.model.obs[("preserved", ctx.handle)] |= {self._slot(ctx.handle)}

        return {"add_pending": add_pending, "forget_pending": forget_pending, "copy_old_rows": copy_old_rows}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger} is illegal from")

    def env_rules(self) -> Sequence[EnvRule]:
        def reuse_slot(machine: GeneratedMachine, data: Any) -> None:
            system: _ReadSystem = machine.system
            # Planning runs under the state lock a reuse needs too: no reuse
            # of a slot while a read of it is being planned.
            planning = {self._slot(h) for h, s in machine.model.states.items() if s == self.spec.initial}
            free = [s for s in range(_ReadSystem.slots) if s not in planning]
            if not free:
                return
            slot = data.draw(st.sampled_from(free), label="reused slot")
            readers = [h for h in sorted(machine.model.states) if self._slot(h) == slot]
            # The bulk preserve reaches exactly the reads in the pending index.
            indexed = [h for h in readers if machine.model.obs[("pending", h)][1]]
            outcomes = [(h, *machine.model_outcome(h, "preserve", {})) for h in indexed]
            where = f"reuse of slot {slot} (live reads {indexed})"

            def call() -> None:
                system.reads.preserve(HIDDEN_KEY, torch.tensor([slot]))

            if any(o == "illegal" for _, o, _ in outcomes):
                machine.expect_refusal(where, Refusal(OmniPrefixCacheUnmatchError, "preserve is illegal from"), call)
                return
            call()
            for h, _, move in outcomes:
                assert move is not None
                machine.apply_model_move(h, move, {})
            system.version[slot] += 1
            system.overwrite(slot)
            machine.check_agree(where)

        return (EnvRule("reuse_slot", reuse_slot, lambda model: bool(model.states)),)

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def pending_iff_live(m: GeneratedMachine) -> None:
            for h in m.model.states:
                state = self.read_state(m.system, h)
                ref = m.system.refs[h]
                if (ref in m.system.reads.pending) != (state in self.live):
                    raise Discrepancy(f"read {h} is {state}; pending index membership {ref in m.system.reads.pending}")

        def copy_on_write(m: GeneratedMachine) -> None:
            for h in m.model.states:
                ref = m.system.refs[h]
                if self.read_state(m.system, h) not in self.live:
                    continue
                slot = self._slot(h)
                if m.system.version[slot] == int(ref.planned_version[0]):
                    continue
                row = ref.preserved.get(slot)
                if row is None or float(row[0]) != m.system.planned_value[h]:
                    got = None if row is None else float(row[0])
                    raise Discrepancy(
                        f"read {h}: slot {slot} was reused (version {m.system.version[slot]}) and the read holds "
                        f"{got}, not the rows it planned ({m.system.planned_value[h]})"
                    )

        return {"pending_iff_live": pending_iff_live, "copy_on_write": copy_on_write}
