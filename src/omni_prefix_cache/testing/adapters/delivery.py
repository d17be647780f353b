"""``DeliveryAdapter``: plays ``delivery`` on a ``Tenure``'s consumer watermarks.

Every trigger fires through ``requests.lifecycle.RequestBinding`` (the
binding ``DeliveryDesk`` and ``RequestTable.retire_delivery`` run), so the
runtime's compiled table ``lifecycle.DELIVERY_MACHINE`` decides what moves
(its ``no_gap``, ``within_saved``, ``issued_view`` and ``spent_view``
guards) and runs ``advance_watermark`` and ``spend_view``. Reads the consumer's delivery
state and watermark (see ``testing.stateful``).
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
SAVED = 7  # every tenure here saved positions [0, 7): a range ending past it is outside what was saved


class _DeskSystem:
    def __init__(self) -> None:
        from omni_prefix_cache.requests.lifecycle import RequestBinding

        self.binding = RequestBinding()
        self.tenures: dict[int, Any] = {}  # handle -> (tenure, consumer)
        self.highest: dict[int, int] = {}  # the highest watermark seen per handle
        self.records: dict[int, Any] = {}  # handle -> the IssuedView its acknowledgements come from


class DeliveryAdapter(SpecAdapter):
    """``delivery`` against one (tenure, consumer) watermark per handle.

    Handles pair up: two consumers of one tenure (so one consumer's
    acknowledgement must not move the other's watermark). Each trigger
    draws the available range ``[start, end)`` the ``no_gap`` and
    ``within_saved`` guards and ``advance_watermark`` read, and whether its
    view was issued as is (``issued_view``). Observed: the consumer's watermark.
    """

    handle_name = "watermark"
    max_handles = 4

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("delivery")
        unknown = sorted(set(self.spec.triggers) - {"view", "ack", "ack_again", "retire"})
        if unknown:
            raise SpecError(f"{self.spec.origin}: the delivery desk has no move for triggers {unknown}")

    def new_system(self) -> _DeskSystem:
        return _DeskSystem()

    def create(self, system: _DeskSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.requests.tenure import Tenure

        if handle % 2:
            tenure = system.tenures[handle - 1][0]
        else:
            tenure = Tenure(req_id=f"r{handle // 2}", rows_upto=SAVED)
        system.tenures[handle] = (tenure, _CONSUMERS[handle % 2])

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        start = data.draw(st.integers(0, 6), label="start")
        end = data.draw(st.integers(start, 8), label="end")
        return {"start": start, "end": end, "issued": data.draw(st.booleans(), label="issued")}

    def _move(self, system: _DeskSystem, handle: int, args: Mapping[str, Any]) -> Any:
        from omni_prefix_cache.requests.tenure import IssuedView, TenureMove

        tenure, consumer = system.tenures[handle]
        record = system.records.setdefault(handle, IssuedView(consumer, {}, {}))
        start, end = args.get("start", 0), args.get("end", 0)
        # A retried ack presents the view an acknowledgement spent (as the desk decides once per view).
        return TenureMove(tenure, None, None, consumer, start, end, args.get("issued", True), record, record.spent)

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
            record = system.records.get(h)
            out[("spent", h)] = record is not None and record.spent
        return out

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs[("delivered", handle)] = 0
        model.obs[("spent", handle)] = False

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        def no_gap(ctx: MoveCtx) -> bool:
            seen = ctx.model.obs[("delivered", ctx.handle)]
            start, end = ctx.args["start"], ctx.args["end"]
            return bool(end <= seen or start <= seen or start >= end)

        def within_saved(ctx: MoveCtx) -> bool:
            return bool(ctx.args["end"] <= SAVED)

        def issued_view(ctx: MoveCtx) -> bool:
            return bool(ctx.args.get("issued", True))

        def spent_view(ctx: MoveCtx) -> bool:
            return bool(ctx.model.obs[("spent", ctx.handle)])

        return {"no_gap": no_gap, "within_saved": within_saved, "issued_view": issued_view, "spent_view": spent_view}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def advance_watermark(ctx: MoveCtx) -> None:
            key = ("delivered", ctx.handle)
            if ctx.args["start"] <= ctx.model.obs[key]:  # only a range that continues the watermark
                ctx.model.obs[key] = max(ctx.model.obs[key], ctx.args["end"])

        def spend_view(ctx: MoveCtx) -> None:
            ctx.model.obs[("spent", ctx.handle)] = True

        return {"advance_watermark": advance_watermark, "spend_view": spend_view}

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
            "issued_once": "the issued_view guard: an acknowledgement drawn as not issued is fired at the runtime "
            "and must be refused (blocked moves); at most once: spend_view marks the view's record, observed, "
            "and ack_again (guard spent_view) moves nothing: the watermark is observed after it",
        }
