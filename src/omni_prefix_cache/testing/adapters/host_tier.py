"""``HostTierAdapter``: plays ``host_tier`` on ``omni_prefix_cache.tier.store.HostTier``.

Maps each trigger to ``HostTier.move`` with the move's argument, reads the
runtime's state and the observable trace of every declared effect, and
implements the spec's named invariants on the runtime (see ``testing.stateful``).
Two environment rules drive the tier's own entry points: ``reuse`` of a set of
blocks, and ``settle`` after a fill's read finished (served or failed).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from hypothesis import strategies as st

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.specs.loader import MachineSpec, SpecError, load_spec
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

_BS, _WIDTH = 2, 2
_ROW_BYTES = _BS * _WIDTH * 4  # one entry's rows (float32)


def tier_hash(handle: int) -> bytes:
    return bytes([handle + 1]) * 8


def tier_rows(value: float) -> dict[str, torch.Tensor]:
    return {"hidden": torch.full((_BS, _WIDTH), value)}


class _Filler:
    """The manager's side, recorded: fills are futures the test completes."""

    def __init__(self) -> None:
        self.planned: dict[bytes, int] = {}
        self.fills: dict[bytes, Future[Any]] = {}
        self.restored: list[tuple[int, float]] = []

    def plan_fill(self, block_hash: bytes, block_id: int) -> Future[Any]:
        self.planned[block_hash] = self.planned.get(block_hash, 0) + 1
        fut: Future[Any] = Future()
        self.fills[block_hash] = fut
        return fut

    def restore(self, block_id: int, rows: Mapping[str, torch.Tensor]) -> None:
        self.restored.append((block_id, float(rows["hidden"][0, 0])))


class TierSystem:
    def __init__(self, max_entries: int) -> None:
        from omni_prefix_cache.tier.store import HostTier

        self.filler = _Filler()
        self.tier = HostTier(self.filler, max_bytes=max_entries * _ROW_BYTES, fill_timeout_s=0.0)
        self.absent: dict[int, Any] = {}
        self.next_value = 1.0

    def entry(self, handle: int) -> Any:
        """The handle's live entry, or the ABSENT one it would start from."""
        from omni_prefix_cache.specs.types.host_tier import TierState
        from omni_prefix_cache.tier.store import TierEntry

        live = self.tier.entries.get(tier_hash(handle))
        if live is not None:
            return live
        old = self.absent.get(handle)
        if old is None or old.state != TierState.ABSENT:
            old = self.absent[handle] = TierEntry(tier_hash(handle))
        return old

    def value(self) -> float:
        self.next_value += 1.0
        return self.next_value


class HostTierAdapter(SpecAdapter):
    """``host_tier`` against HostTier (room for ``max_entries`` entries' rows).

    A handle is one block hash; its blocks are ``2 * handle`` and ``2 * handle
    + 1`` (a rebind moves between them), so handles never share a block. The
    fill's read is a future the filler hands out; ``filled`` and
    ``overflow`` carry fresh rows. Observed: ``bind_block`` / ``unbind_block``
    as the entry's block and the tier's block index, ``plan_fill`` as fills
    planned per hash and the entry's fill, ``keep_rows`` / ``drop_rows`` as
    its rows and the held bytes, ``keep_surplus`` / ``drop_surplus`` as its
    rows and the surplus bytes, ``drop_fill`` as the fill cleared,
    ``restore_rows`` as the (block, rows) the filler was asked to restore,
    ``report_hash`` as the hashes the tier's reports hold.
    """

    handle_name = "hash"
    max_handles = 4

    def __init__(self, spec: MachineSpec | None = None, max_entries: int = 2):
        self.spec = spec or load_spec("host_tier")
        known = {"bind", "reuse", "filled", "overflow", "lose", "restore", "release"}
        unknown = sorted(set(self.spec.triggers) - known)
        if unknown:
            raise SpecError(f"{self.spec.origin}: HostTier has no call for triggers {unknown}")
        self.max_entries = max_entries

    def new_system(self) -> TierSystem:
        return TierSystem(self.max_entries)

    def create(self, system: TierSystem, handle: int, args: Mapping[str, Any]) -> None:
        pass  # a hash exists (ABSENT) before its first bind

    def fire(self, system: TierSystem, handle: int, trigger: str, args: Mapping[str, Any], defer: bool) -> None:
        from omni_prefix_cache.specs.types.host_tier import HostTierTrigger

        arg: Any = args.get("block")
        if trigger in ("filled", "overflow"):
            arg = tier_rows(args["value"])
        elif trigger == "lose":
            arg = "test"
        if not system.tier.move(system.entry(handle), HostTierTrigger(trigger), arg):
            from omni_prefix_cache.testing.stateful import Refused

            raise Refused(f"{trigger}: a guard refused it")

    def read_state(self, system: TierSystem, handle: int) -> str:
        from omni_prefix_cache.specs.types.host_tier import TierState

        return TierState(int(system.entry(handle).state)).name

    def observe(self, system: TierSystem, handles: Sequence[int]) -> dict[Hashable, Any]:
        tier = system.tier
        out: dict[Hashable, Any] = {("bytes",): tier.held_bytes, ("bound",): frozenset(tier.bound.items())}
        out[("surplus",)] = tier.surplus_bytes
        out[("reported",)] = frozenset(tier.reports.pending())
        out[("restored",)] = tuple(system.filler.restored)
        for h in handles:
            e = system.entry(h)
            out[("block", h)] = e.block
            out[("fill", h)] = e.fill is not None
            out[("rows", h)] = None if e.rows is None else float(e.rows["hidden"][0, 0])
            out[("planned", h)] = system.filler.planned.get(tier_hash(h), 0)
        return out

    # ------------------------------------------------------------ model
    def new_model(self, model: ModelWorld) -> None:
        model.obs.update(
            {("bytes",): 0, ("bound",): frozenset(), ("surplus",): 0, ("reported",): frozenset(), ("restored",): ()}
        )

    def model_create(self, model: ModelWorld, handle: int, args: Mapping[str, Any]) -> None:
        model.obs.update({("block", handle): None, ("fill", handle): False, ("rows", handle): None})
        model.obs[("planned", handle)] = 0

    def model_guards(self) -> dict[str, Callable[[MoveCtx], bool]]:
        return {"fits": lambda ctx: ctx.model.obs[("bytes",)] + _ROW_BYTES <= self.max_entries * _ROW_BYTES}

    def model_effects(self) -> dict[str, Callable[[MoveCtx], None]]:
        def bind_block(ctx: MoveCtx) -> None:
            block = ctx.args["block"]
            ctx.model.obs[("block", ctx.handle)] = block
            ctx.model.obs[("bound",)] = ctx.model.obs[("bound",)] | {(block, tier_hash(ctx.handle))}

        def unbind_block(ctx: MoveCtx) -> None:
            block = ctx.model.obs[("block", ctx.handle)]
            if block is not None:
                ctx.model.obs[("bound",)] = ctx.model.obs[("bound",)] - {(block, tier_hash(ctx.handle))}
            ctx.model.obs[("block", ctx.handle)] = None

        def plan_fill(ctx: MoveCtx) -> None:
            ctx.model.obs[("planned", ctx.handle)] += 1
            ctx.model.obs[("fill", ctx.handle)] = True

        def keep_rows(ctx: MoveCtx) -> None:
            ctx.model.obs[("rows", ctx.handle)] = ctx.args["value"]
            ctx.model.obs[("bytes",)] += _ROW_BYTES
            ctx.model.obs[("fill", ctx.handle)] = False

        def drop_fill(ctx: MoveCtx) -> None:
            ctx.model.obs[("fill", ctx.handle)] = False

        def restore_rows(ctx: MoveCtx) -> None:
            restored = (ctx.args["block"], ctx.model.obs[("rows", ctx.handle)])
            ctx.model.obs[("restored",)] = (*ctx.model.obs[("restored",)], restored)

        def drop_rows(ctx: MoveCtx) -> None:
            ctx.model.obs[("rows", ctx.handle)] = None
            ctx.model.obs[("bytes",)] -= _ROW_BYTES

        def keep_surplus(ctx: MoveCtx) -> None:
            ctx.model.obs[("rows", ctx.handle)] = ctx.args["value"]
            ctx.model.obs[("surplus",)] += _ROW_BYTES
            ctx.model.obs[("fill", ctx.handle)] = False

        def drop_surplus(ctx: MoveCtx) -> None:
            ctx.model.obs[("rows", ctx.handle)] = None
            ctx.model.obs[("surplus",)] -= _ROW_BYTES

        def report_hash(ctx: MoveCtx) -> None:
            ctx.model.obs[("reported",)] = ctx.model.obs[("reported",)] | {tier_hash(ctx.handle)}

        return {
            "keep_surplus": keep_surplus,
            "drop_surplus": drop_surplus,
            "report_hash": report_hash,
            "bind_block": bind_block,
            "unbind_block": unbind_block,
            "plan_fill": plan_fill,
            "keep_rows": keep_rows,
            "drop_fill": drop_fill,
            "restore_rows": restore_rows,
            "drop_rows": drop_rows,
        }

    def trigger_args(self, data: Any, model: ModelWorld, handle: int, trigger: str) -> dict[str, Any]:
        if trigger == "bind":
            return {"block": 2 * handle + data.draw(st.integers(0, 1), label="block")}
        if trigger == "reuse":
            block = model.obs[("block", handle)]
            return {"block": 2 * handle if block is None else block}
        if trigger in ("filled", "overflow"):
            return {"value": float(data.draw(st.integers(1, 1000), label="rows"))}
        if trigger == "restore":
            return {"block": 100 + data.draw(st.integers(0, 3), label="target block")}
        return {}

    def refusal(self, trigger: str, args: Mapping[str, Any], outcome: Outcome) -> Refusal | None:
        if outcome == "blocked":
            from omni_prefix_cache.testing.stateful import Refused

            return Refusal(Refused)
        return Refusal(OmniPrefixCacheUnmatchError, rf"{trigger} is illegal from")

    def env_rules(self) -> Sequence[EnvRule]:
        def reuse_blocks(machine: GeneratedMachine, data: Any) -> None:
            """``HostTier.reuse`` of some blocks: exactly the BOUND entries on them start a fill."""
            blocks = data.draw(st.sets(st.integers(0, 2 * self.max_handles - 1), min_size=1), label="blocks")
            machine.system.tier.reuse(sorted(blocks))
            for h in sorted(machine.model.states):
                block = machine.model.obs[("block", h)]
                if machine.model.states[h] == "BOUND" and block in blocks:
                    outcome, move = machine.model_outcome(h, "reuse", {"block": block})
                    assert outcome == "moved" and move is not None
                    machine.apply_model_move(h, move, {"block": block})
            machine.check_agree(f"reuse of blocks {sorted(blocks)}")

        def settle(machine: GeneratedMachine, data: Any) -> None:
            """A fill's read finished (rows or an error); ``HostTier.settle`` keeps
            the rows where they fit, keeps them apart (surplus) where they do not, and
            loses the entry when the read failed."""
            filling = [h for h, s in sorted(machine.model.states.items()) if s == "FILLING"]
            if not filling:
                return
            h = data.draw(st.sampled_from(filling), label="filled hash")
            fut = machine.system.filler.fills[tier_hash(h)]
            served = data.draw(st.booleans(), label="the read served")
            value = machine.system.value()
            if served:
                fut.set_result(tier_rows(value))
            else:
                fut.set_exception(OmniPrefixCacheUnmatchError("read failed"))
            machine.system.tier.settle()
            outcome, move = machine.model_outcome(h, "filled", {"value": value})
            if served and outcome != "moved":
                outcome, move = machine.model_outcome(h, "overflow", {"value": value})
            elif not served:
                outcome, move = machine.model_outcome(h, "lose", {})
            assert outcome == "moved" and move is not None
            machine.apply_model_move(h, move, {"value": value})
            machine.check_agree(f"settle of hash {h} ({'served' if served else 'failed'})")

        return (
            EnvRule("reuse_blocks", reuse_blocks, lambda model: bool(model.states)),
            EnvRule("settle", settle, lambda model: "FILLING" in model.states.values()),
        )

    # ------------------------------------------------------------ invariants
    def invariants(self) -> Mapping[str, Callable[[GeneratedMachine], None]]:
        def block_iff_bound(m: GeneratedMachine) -> None:
            tier = m.system.tier
            for h in m.model.states:
                e = m.system.entry(h)
                if (e.block is not None) != (self.read_state(m.system, h) == "BOUND"):
                    raise Discrepancy(f"hash {h} is {self.read_state(m.system, h)} with block {e.block}")
                if e.block is not None and tier.bound.get(e.block) != e.block_hash:
                    raise Discrepancy(f"hash {h}: block {e.block} is indexed to {tier.bound.get(e.block)!r}")
            live = {e.block for e in tier.entries.values() if e.block is not None}
            if set(tier.bound) != live:
                raise Discrepancy(f"block index {sorted(tier.bound)} but bound entries name {sorted(live)}")

        def fill_iff_filling(m: GeneratedMachine) -> None:
            for h in m.model.states:
                e = m.system.entry(h)
                if (e.fill is not None) != (self.read_state(m.system, h) == "FILLING"):
                    raise Discrepancy(
                        f"hash {h} is {self.read_state(m.system, h)}; fill in flight {e.fill is not None}"
                    )

        def rows_iff_held(m: GeneratedMachine) -> None:
            for h in m.model.states:
                e = m.system.entry(h)
                if (e.rows is not None) != (self.read_state(m.system, h) in ("HELD", "SURPLUS")):
                    raise Discrepancy(f"hash {h} is {self.read_state(m.system, h)}; rows {e.rows is not None}")
                if e.rows is not None and any(int(t.shape[0]) != _BS for t in e.rows.values()):
                    raise Discrepancy(f"hash {h} holds {[tuple(t.shape) for t in e.rows.values()]}, not {_BS} rows")

        def bytes_within_bound(m: GeneratedMachine) -> None:
            from omni_prefix_cache.specs.types.host_tier import TierState

            tier = m.system.tier

            def nbytes(state: TierState) -> int:
                return sum(
                    int(t.numel()) * t.element_size()
                    for e in tier.entries.values()
                    if e.state == state
                    for t in (e.rows or {}).values()
                )

            held, surplus = nbytes(TierState.HELD), nbytes(TierState.SURPLUS)
            if held != tier.held_bytes or held > tier.max_bytes or surplus != tier.surplus_bytes:
                raise Discrepancy(
                    f"rows hold {held} bytes, counted {tier.held_bytes}, bound {tier.max_bytes}; surplus rows "
                    f"{surplus} bytes, counted {tier.surplus_bytes}"
                )

        def surplus_reported(m: GeneratedMachine) -> None:
            from omni_prefix_cache.specs.types.host_tier import TierState

            tier = m.system.tier
            reported = set(tier.reports.pending())  # nobody drains the reports here
            for h, e in tier.entries.items():
                if e.state == TierState.SURPLUS and h not in reported:
                    raise Discrepancy(f"surplus hash {h.hex()} was never reported to the scheduler side")

        return {
            "block_iff_bound": block_iff_bound,
            "fill_iff_filling": fill_iff_filling,
            "rows_iff_held": rows_iff_held,
            "bytes_within_bound": bytes_within_bound,
            "surplus_reported": surplus_reported,
        }
