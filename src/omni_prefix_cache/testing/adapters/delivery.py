"""``DeliveryAdapter``: plays ``delivery`` on a ``Tenure``'s consumer watermarks.

Every trigger fires through ``requests.lifecycle.RequestBinding`` (the
binding ``DeliveryDesk`` and ``RequestTable.retire_delivery`` run), so the
runtime's compiled table ``lifecycle.DELIVERY_MACHINE`` decides what moves
(its ``no_gap`` guard) and runs ``advance_watermark``. Reads the
consumer's delivery state and watermark (see ``testing.stateful``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
from omni_prefix_cache.testing.stateful import (
    Discrepancy,
    GeneratedMachine,
    ModelWorld,
    MoveCtx,
    Outcome,
    Refusal,
    Refused,
    SpecAdapter,
)

_CONSUMERS = ("talker", "detok")


class _DeskSystem:
    def __init__(self) -> None:
        from omni_prefix_cache.requests.lifecycle import RequestBinding

        self.binding = RequestBinding()
        self.tenures: dict[int, Any] = {}  # handle -> (tenure, consumer)
        self.highest: dict[int, int] = {}  # the highest watermark seen per handle


class DeliveryAdapter(SpecAdapter):
    """``delivery`` against one (tenure, consumer) watermark per handle.

    Handles pair up: two consumers of one tenure (so one consumer's
    acknowledgement must not move the other's watermark). Each trigger
    draws the available range ``[start, end)`` the ``no_gap`` guard and
    ``advance_watermark`` read. Observed: the consumer's watermark.
    """

    handle_name = "watermark"
    max_handles = 4

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("delivery")
        unknown = sorted(set(self.spec.triggers) - {"view", "ack", "retire"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: the delivery desk has no move for triggers {unknown}")

    def new_system(self) -> _DeskSystem:
        return _DeskSystem()

    def create(self, system: _DeskSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.requests.tenure import Tenure

        if handle % 2:
            tenure = system.tenures[handle - 1][0]
        else:
            tenure = Tenure(req_id=f"r{handle // 2}")
        system.tenures[handle] = (tenure, _CONSUMERS[handle % 2])

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        start = data.draw(st.integers(0, 6), label="start")
        return {"start": start, "end": data.draw(st.integers(start, 8), label="end")}

    def _move(self, system: _DeskSystem, handle: int, args: Mapping[str, Any]) -> Any:
        from omni_prefix_cache.requests.tenure import TenureMove

        tenure, consumer = system.tenures[handle]
        return TenureMove(tenure, None, None, consumer, args.get("start", 0), args.get("end", 0))

    def fire(self, system: _DeskSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        can, run = system.binding.move("delivery", trigger)
        move = self._move(system, handle, args)
        if not can(move):
            raise Refused(f"{trigger} is not enabled for watermark {handle}")
        run(move)

    def read_state(self, system: _DeskSystem, handle: int) -> str:
        from omni_prefix_cache.requests.tenure import DeliveryState

        tenure, consumer = system.tenures[handle]
        return DeliveryState(int(tenure.delivery_state(consumer))).name

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(Refused)

    def observe(self, system: _DeskSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            tenure, consumer = system.tenures[h]
            out[("delivered", h)] = tenure.watermark(consumer)
        return out

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs[("delivered", handle)] = 0

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        def no_gap(ctx: MoveCtx) -> bool:
            seen = ctx.model.obs[("delivered", ctx.handle)]
            start, end = ctx.args["start"], ctx.args["end"]
            return bool(end <= seen or start <= seen or start >= end)

        return {"no_gap": no_gap}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def advance_watermark(ctx: MoveCtx) -> None:
            key = ("delivered", ctx.handle)
            if ctx.args["start"] <= ctx.model.obs[key]:  # only a range that continues the watermark
                ctx.model.obs[key] = max(ctx.model.obs[key], ctx.args["end"])

        return {"advance_watermark": advance_watermark}

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def watermark_monotonic(m: GeneratedMachine) -> None:
            for h, (tenure, consumer) in m.system.tenures.items():
                now = tenure.watermark(consumer)
                if now < m.system.highest.get(h, 0):
                    raise Discrepancy(f"watermark {h} went back to {now} from {m.system.highest[h]}")
                m.system.highest[h] = now

        return {"watermark_monotonic": watermark_monotonic}

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {
            "no_gap_crossed": "the no_gap guard: every view or ack the spec refuses (a later start) is "
            "fired at the runtime and must be refused (the generated machine's blocked moves)",
        }
