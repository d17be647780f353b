"""``StagingHolderAdapter``: plays ``staging_holder`` on ``omni_prefix_cache.writes.staging.StagingBufferPool``.

Maps each trigger to the runtime call(s) that fire it, reads the runtime's
state and the observable trace of every declared effect, and implements the
spec's named invariants on the runtime (see ``testing.stateful``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from omni_prefix_cache.interface import (
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
)
from omni_prefix_cache.specs.compiled import CompiledMove
from omni_prefix_cache.specs.loader import MachineSpec, load_spec
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    SpecAdapter,
)


class _CountingCondition(threading.Condition):
    """A condition that counts ``notify_all`` calls (the pool's wakes)."""

    def __init__(self) -> None:
        super().__init__()
        self.wakes = 0

    def notify_all(self) -> None:
        self.wakes += 1
        super().notify_all()


class _PoolSystem:
    def __init__(self, depth: int, capacity: int):
        from omni_prefix_cache.device import sync
        from omni_prefix_cache.writes.staging import StagingBufferPool

        # The pool's condition comes from the sync seam: a counting one sees every wake.
        with sync.installed(Condition=_CountingCondition):
            self.pool = StagingBufferPool(depth, capacity)
        wakes = self.pool.lock
        assert isinstance(wakes, _CountingCondition)
        self.wakes = wakes
        self.kinds: dict[int, str] = {}
        # Holder ids are issued at a handle's first move, as the runtime issues
        # step ids and tids from counters: first holds come in id order.
        self.holders: dict[int, Any] = {}
        self.next_id: dict[str, int] = {"step": 0, "task": 0}

    def holder(self, handle: int) -> Any:
        """The handle's holder; one that never held a page gets the next id
        tentatively (kept by ``issued`` only once a claim or bind succeeds)."""
        from omni_prefix_cache.writes.staging import StagingBufferHolder

        if handle in self.holders:
            return self.holders[handle]
        kind = self.kinds[handle]
        make = StagingBufferHolder.for_step if kind == "step" else StagingBufferHolder.for_task
        return make(self.next_id[kind])

    def issued(self, handle: int, holder: Any) -> None:
        if handle not in self.holders:
            self.holders[handle] = holder
            self.next_id[holder.kind] += 1


class StagingHolderAdapter(SpecAdapter):
    """``staging_holder`` against StagingBufferPool over ``depth`` pages.

    A handle is one holder (a step or a task holder). ``claim`` takes the
    lowest free page (the model predicts it); ``bind`` draws the page; the
    release triggers name the page the model says the holder holds (or a
    drawn one when it holds none). Observed: each page's holder set, and
    the number of claimer wakes (``wake_claimers_if_free``).

    RELEASED is final on the pool too: a released holder that tries to
    claim or bind again is refused.
    """

    handle_name = "holder"
    max_handles = 6
    retire_final = False

    def __init__(self, spec: MachineSpec | None = None, depth: int = 2):
        self.spec = spec or load_spec("staging_holder")
        self.depth = depth

    def new_system(self) -> _PoolSystem:
        return _PoolSystem(self.depth, capacity=4)

    def create(self, system: _PoolSystem, handle: int, args: Mapping[str, Any]) -> None:
        system.kinds[handle] = args["kind"]

    def fire(self, system: _PoolSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        holder = system.holder(handle)
        if trigger == "claim":
            system.pool.claim(holder, timeout=0)
            system.issued(handle, holder)
        elif trigger == "bind":
            system.pool.bind(args["page"], holder)
            system.issued(handle, holder)
        else:
            system.pool.release(args["page"], holder, StagingHolderTrigger(trigger))

    def read_state(self, system: _PoolSystem, handle: int) -> str:
        if handle not in system.holders:
            return "UNHELD"  # no id issued yet: it never held a page
        return str(system.pool.holder_state(system.holders[handle]).name)

    def observe(self, system: _PoolSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        index = {holder: h for h, holder in system.holders.items()}
        out: dict[Hashable, Any] = {("wakes",): system.wakes.wakes}
        pool = system.pool
        out.update({("page", p): frozenset(index[x] for x in pool.page_holders(p)) for p in range(pool.depth)})
        return out

    # ------------------------------------------------------------ model
    def new_model(self, model: ModelWorld) -> None:
        model.obs.update({("page", p): frozenset() for p in range(self.depth)})
        model.obs[("wakes",)] = 0

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.info[handle] = {"kind": args["kind"], "page": None}

    @staticmethod
    def _free_pages(model: ModelWorld) -> list[int]:
        pages = [k for k in model.obs if isinstance(k, tuple) and k[0] == "page"]
        return [p for p in range(len(pages)) if not model.obs[("page", p)]]

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {
            "is_step_holder": lambda ctx: ctx.model.info[ctx.handle]["kind"] == "step",
            "is_task_holder": lambda ctx: ctx.model.info[ctx.handle]["kind"] == "task",
            "page_free": lambda ctx: bool(self._free_pages(ctx.model)),
            "page_busy": lambda ctx: bool(ctx.model.obs[("page", ctx.args["page"])]),
        }

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def wake_claimers_if_free(ctx: MoveCtx) -> None:
            # Runs after the release: wakes claimers when the page is now free.
            page = ctx.args["page"]
            if not ctx.model.obs[("page", page)]:
                ctx.model.obs[("wakes",)] += 1

        return {"wake_claimers_if_free": wake_claimers_if_free}

    def model_after_move(self, ctx: MoveCtx, move: CompiledMove) -> None:
        info = ctx.model.info[ctx.handle]
        if move.dest.name == "HELD":
            page = self._free_pages(ctx.model)[0] if move.trigger == "claim" else ctx.args["page"]
            info["page"] = page
            ctx.model.obs[("page", page)] = ctx.model.obs[("page", page)] | {ctx.handle}
        else:
            page = info["page"]
            info["page"] = None
            ctx.model.obs[("page", page)] = ctx.model.obs[("page", page)] - {ctx.handle}

    def create_args(self, data: Any, model: ModelWorld) -> dict[str, Any]:
        return {"kind": data.draw(st.sampled_from(["step", "task"]), label="kind")}

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if trigger == "claim":
            return {}
        page = model.info[handle]["page"]
        if page is None or trigger == "bind":
            busy = [p for p in range(self.depth) if model.obs[("page", p)]]
            # Mostly a busy page, so binds are not all refused by page_busy.
            if busy and data.draw(st.booleans(), label="busy page"):
                page = data.draw(st.sampled_from(busy), label="page")
            else:
                page = data.draw(st.integers(0, self.depth - 1), label="page")
        return {"page": page}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if trigger == "claim" and outcome == "blocked":
            return Refusal(OmniPrefixCacheStagingTimeoutError, r"no free staging page")
        return Refusal(OmniPrefixCacheUnmatchError)

    # ------------------------------------------------------------ invariants
    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def free_iff_no_holder(m: GeneratedMachine) -> None:
            pool = m.system.pool
            holders = pool.holders()
            for p in range(pool.depth):
                busy = set(pool.page_holders(p))
                held_here = {x for x in holders if pool.page_of(x) == p}
                if busy != held_here:
                    raise Discrepancy(f"page {p}: busy set {busy} but holders on it {held_here}")
                for x in busy:
                    if pool.holder_state(x).name != "HELD":
                        raise Discrepancy(f"page {p} is busy with {x}, which is not HELD")

        def one_step_holder_per_page(m: GeneratedMachine) -> None:
            pool = m.system.pool
            for p in range(pool.depth):
                steps = [x for x in pool.page_holders(p) if x.kind == "step"]
                if len(steps) > 1:
                    raise Discrepancy(f"page {p} has step holders {steps}")

        return {"free_iff_no_holder": free_iff_no_holder, "one_step_holder_per_page": one_step_holder_per_page}

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {"task_holder_has_live_task": "needs the controller's tasks; the composed model check covers it"}
