"""``RequestLifecycleAdapter``: plays ``request_lifecycle`` on a ``Tenure`` in a ``RequestTable``.

Every trigger fires through ``requests.lifecycle.RequestBinding`` (the
binding the table's compiled ``request_event`` runs), so the runtime's
compiled table ``lifecycle.REQUEST_MACHINE`` decides what moves and its
handlers (``RequestTable.install_lookup`` / ``detach_writes``) run the
effects. Reads the tenure's state and the observable trace of every
declared effect (see ``testing.stateful``).
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

_KINDS = ("RESUMED", "EXTENDED", "STARTED")


class _TableSystem:
    """A RequestTable whose write ledger records each detach per request id."""

    def __init__(self) -> None:
        from omni_prefix_cache.requests.lifecycle import RequestBinding, RequestTable

        self.detached: dict[str, int] = {}
        try:
            self.table = RequestTable(self._detach, lambda rid, end, blocks: None, set())
        except SpecError as exc:  # its compiled request_event fires a move the runtime's table lacks
            raise Discrepancy(f"the request table does not build on the runtime's table: {exc}") from exc
        self.binding = RequestBinding()
        self.tenures: dict[int, Any] = {}

    def _detach(self, rid: str) -> list[int]:
        self.detached[rid] = self.detached.get(rid, 0) + 1
        return []


class RequestLifecycleAdapter(SpecAdapter):
    """``request_lifecycle`` against the request table's tenures.

    A handle is one tenure of its own request id (``r<handle>``), opened as
    the table's current one (what ``open_tenure`` does). Each trigger draws
    an event (its kind: the ``resumed_event`` guard reads it; its hit end:
    what ``install_lookup`` installs) and fires ``RequestBinding.move``.
    Observed: ``install_lookup`` as the tenure's lookup end and
    ``computed_upto``; ``detach_writes`` as the ledger's detach calls, and
    whether the tenure is still its id's current or its finished one;
    ``count_accepted`` (accept draws an accepted end and whether the step
    saved cached keys) as ``computed_upto``, ``saved_upto`` and ``rows_upto``.
    """

    handle_name = "tenure"
    max_handles = 3

    def __init__(self, spec: MachineSpec | None = None):
        self.spec = spec or load_spec("request_lifecycle")
        known = {"admit", "start", "lookup", "resume", "extend", "finish", "retire", "accept"}
        unknown = sorted(set(self.spec.triggers) - known)
        if unknown:
            raise SpecError(f"{self.spec.origin}: the request table has no move for triggers {unknown}")

    def new_system(self) -> _TableSystem:
        return _TableSystem()

    def create(self, system: _TableSystem, handle: int, args: Mapping[str, Any]) -> None:
        from omni_prefix_cache.adapter import PrefixCacheRequestOwner
        from omni_prefix_cache.requests.tenure import Tenure

        rid = f"r{handle}"
        tenure = Tenure(owner=PrefixCacheRequestOwner(handle + 1), req_id=rid)
        system.table.current[rid] = tenure
        system.tenures[handle] = tenure

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if trigger == "accept":
            end = data.draw(st.integers(0, 8), label="accepted end")
            return {"kind": "EXTENDED", "hit_end": 0, "end": end, "saves": data.draw(st.booleans(), label="saves")}
        kind = data.draw(st.sampled_from(_KINDS), label="event kind")
        return {"kind": kind, "hit_end": data.draw(st.integers(0, 8), label="hit end")}

    def fire(self, system: _TableSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestEvent
        from omni_prefix_cache.requests.tenure import TenureMove

        tenure = system.tenures[handle]
        event = PrefixCacheRequestEvent(
            tenure.req_id, PrefixCacheEventKind[args["kind"]], 0, args["hit_end"], ((0,),), owner=tenure.owner
        )
        can, run = system.binding.move("request", trigger)
        move = TenureMove(tenure, system.table, event, end=args.get("end", 0))
        move.saves = bool(args.get("saves", True))
        if not can(move):
            raise Refused(f"{trigger} is not enabled for {tenure!r}")
        run(move)

    def read_state(self, system: _TableSystem, handle: int) -> str:
        from omni_prefix_cache.requests.tenure import RequestState

        return RequestState(int(system.tenures[handle].state)).name

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        return Refusal(Refused)

    def observe(self, system: _TableSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        for h in handles:
            tenure = system.tenures[h]
            rid = tenure.req_id
            out[("lookup", h)] = tenure.lookup[0] if tenure.lookup is not None else None
            out[("computed", h)] = tenure.computed_upto
            out[("saved", h)] = tenure.saved_upto
            out[("rows", h)] = tenure.rows_upto
            out[("detached", h)] = system.detached.get(rid, 0)
            out[("current", h)] = system.table.current.get(rid) is tenure
            out[("finished", h)] = system.table.finished.get(rid) is tenure
        return out

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update(
            {
                ("lookup", handle): None,
                ("computed", handle): 0,
                ("saved", handle): 0,
                ("rows", handle): 0,
                ("detached", handle): 0,
                ("current", handle): True,
                ("finished", handle): False,
            }
        )

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {"resumed_event": lambda ctx: ctx.args["kind"] == "RESUMED"}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def install_lookup(ctx: MoveCtx) -> None:
            ctx.model.obs[("lookup", ctx.handle)] = ctx.args["hit_end"]
            ctx.model.obs[("computed", ctx.handle)] = ctx.args["hit_end"]

        def detach_writes(ctx: MoveCtx) -> None:
            obs, h = ctx.model.obs, ctx.handle
            if obs[("current", h)]:
                obs[("current", h)] = False
                obs[("detached", h)] += 1
            if ctx.model.states[h] == "FINISHED":
                obs[("finished", h)] = True
            elif obs[("finished", h)]:
                obs[("finished", h)] = False

        def count_accepted(ctx: MoveCtx) -> None:
            obs, h, end = ctx.model.obs, ctx.handle, ctx.args["end"]
            obs[("computed", h)] = max(obs[("computed", h)], end)
            obs[("rows", h)] = max(obs[("rows", h)], end)
            if ctx.args["saves"]:
                obs[("saved", h)] = max(obs[("saved", h)], end)

        return {"install_lookup": install_lookup, "detach_writes": detach_writes, "count_accepted": count_accepted}

    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def one_current_tenure(m: GeneratedMachine) -> None:
            for h, tenure in m.system.tenures.items():
                state = self.read_state(m.system, h)
                current = m.system.table.current.get(tenure.req_id) is tenure
                if state in ("ADMITTED", "RUNNING") and not current:
                    raise Discrepancy(f"tenure {h} is {state} but not its id's current tenure")

        return {"one_current_tenure": one_current_tenure}

    def unchecked_invariants(self) -> Mapping[str, str]:
        return {
            "monotonic_owner": "one tenure per id here: the owner order is request_event's, checked by the "
            "lifecycle model (request_lifecycle.monotonic_owner) and the protocol tests",
            "drafts_count_once_accepted": "which rows are drafts is the step's (record_saved, materialize's "
            "accepted rows), not the tenure's: the lifecycle model and the protocol tests check it "
            "(accepted_rows_only)",
        }
