"""``StepContextAdapter``: plays ``step_context`` on ``omni_prefix_cache.manager.OmniPrefixCacheManager``.

Maps each trigger to the runtime call(s) that fire it, reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime (see ``testing.stateful``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from omni_prefix_cache.interface import (
    OmniPrefixCacheUnmatchError,
)
from omni_prefix_cache.specs.compiled import CompiledMove
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    SpecAdapter,
)


class _EmptyView:
    """A group view with no batch: every save is a leftover-only step."""

    block_size = 4

    def batch_req_ids(self) -> list[str]:
        return []

    def step_slots_cpu(self, order: Sequence[str], num_scheduled: Mapping[str, int]) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64)


class _ManagerSystem:
    def __init__(self, pages: int):
        from omni_prefix_cache.interface import PrefixCacheConfig
        from omni_prefix_cache.manager import OmniPrefixCacheManager

        config = PrefixCacheConfig(num_blocks=4, block_size=4, staging_depth=pages, staging_claim_timeout_s=0)
        self.mgr = OmniPrefixCacheManager(config, _EmptyView(), eager=True)
        self.sids: dict[int, int] = {}


class StepContextAdapter(SpecAdapter):
    """``step_context`` against OmniPrefixCacheManager (eager, CPU).

    A handle is a step: ``save`` runs new_step_starts + a leftover-only
    save_outputs and binds the issued id to the handle; ``materialize`` /
    ``discard`` consume it (an unsaved handle uses an id never issued).
    Observed: whether the staging pool holds the step's holder
    (``release_step_holder`` lets it go). ``save`` of an issued id cannot be
    expressed (the manager issues fresh ids), so that illegal move is skipped.
    """

    handle_name = "step"
    max_handles = 3

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("step_context")
        unknown = sorted(set(self.spec.triggers) - {"save", "materialize", "discard"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: the manager has no call for triggers {unknown}")

    def new_system(self) -> _ManagerSystem:
        return _ManagerSystem(pages=self.max_handles + 1)

    def close(self, system: _ManagerSystem) -> None:
        system.mgr.shutdown()

    def create(self, system: _ManagerSystem, handle: int, args: Mapping[str, Any]) -> None:
        pass  # the manager issues the id at save

    def _sid(self, system: _ManagerSystem, handle: int) -> int:
        return system.sids.get(handle, 10_000 + handle)

    def fire(self, system: _ManagerSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        from types import SimpleNamespace

        mgr = system.mgr
        if trigger == "save":
            mgr.new_step_starts(SimpleNamespace(finished_req_ids=[], scheduled_new_reqs=[], num_scheduled_tokens={}))
            system.sids[handle] = mgr.save_outputs(torch.zeros(0, 4), None, num_tokens_unpadded=0, num_tokens_padded=0)
        elif trigger == "materialize":
            mgr.materialize(self._sid(system, handle), [])
        else:
            mgr.discard_step(self._sid(system, handle))

    def can_express(self, trigger: str, state: str) -> bool:
        return trigger != "save"

    def read_state(self, system: _ManagerSystem, handle: int) -> str:
        from omni_prefix_cache.steps.step_context import StepState

        sid = system.sids.get(handle)
        if sid is None:
            return "UNSAVED"
        ctx = system.mgr.components.steps.get(sid)
        return StepState(ctx.state).name if ctx is not None else "CONSUMED"

    def _pages_held(self, system: _ManagerSystem, handle: int) -> int:
        from omni_prefix_cache.writes.staging import StagingBufferHolder

        holder = StagingBufferHolder.for_step(self._sid(system, handle))
        pool = system.mgr.components.controller.parts.staging_pool
        return sum(holder in pool.page_holders(p) for p in range(pool.depth))

    def observe(self, system: _ManagerSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        return {("pages_held", h): self._pages_held(system, h) for h in handles}

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs[("pages_held", handle)] = 0

    def model_after_move(self, ctx: MoveCtx, move: CompiledMove) -> None:
        if move.trigger == "save":  # save claims the step's page (one_holder_per_saved_step)
            ctx.model.obs[("pages_held", ctx.handle)] = 1

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def release_step_holder(ctx: MoveCtx) -> None:
            ctx.model.obs[("pages_held", ctx.handle)] = 0

        return {"release_step_holder": release_step_holder}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger}\(step \d+\): illegal from")

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def one_holder_per_saved_step(m: GeneratedMachine) -> None:
            for h in m.model.states:
                state = self.read_state(m.system, h)
                held = self._pages_held(m.system, h)
                if held != (1 if state == "SAVED" else 0):
                    raise Discrepancy(f"step {h} is {state} and holds {held} staging pages")

        return {"one_holder_per_saved_step": one_holder_per_saved_step}
