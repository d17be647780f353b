"""Slot tenancy across keys (spec/slot_occupancy.yaml, ``tenancy``).

A KV block's new tenant owns every key of its slots: a key the new tenant
does not write there is absent (served as the pool baseline, zeros), never
the previous tenant's rows. Request a writes hidden and ``m`` into block 0,
b reuses block 0 without ``m`` (no ``m`` at all, or ``m`` not token-major so
it is a leftover), c hits b's block: c must get b's hidden rows and the
baseline for ``m``, in eager and threaded mode, for immediate and deferred
``m``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache.interface import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.steps.slot_occupancy import SLOT_MACHINE, SlotState
from test_manager import BS, BlockView

ABSENT = int(SlotState.ABSENT)

HID, MW = 6, 3


def step(
    mgr: OmniPrefixCacheManager,
    view: BlockView,
    rid: str,
    blocks: list[int],
    start: int,
    count: int,
    *,
    hit: int = 0,
    finished: Iterable[str] = (),
    hidden: float,
    mm: dict[str, Any],
) -> int:
    view.order, view.blocks[rid], view.start[rid] = [rid], blocks, start
    mgr.new_step_starts(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=hit, block_ids=(blocks,))],
            finished_req_ids=set(finished),
            num_scheduled_tokens={rid: count},
        )
    )
    return mgr.save_outputs(torch.full((count, HID), hidden), mm, num_tokens_unpadded=count, num_tokens_padded=count)


MODES = [pytest.param(True, id="eager"), pytest.param(False, id="threaded")]
M_SCHEDULES = [pytest.param(frozenset(), id="immediate_m"), pytest.param(frozenset({"m"}), id="deferred_m")]
B_OUTPUTS = [
    pytest.param(lambda n: {}, id="b_without_m"),
    pytest.param(lambda n: {"m": torch.full((n + 3, MW), 7.0)}, id="b_m_leftover"),
]


@pytest.mark.parametrize("b_mm", B_OUTPUTS)
@pytest.mark.parametrize("deferred", M_SCHEDULES)
@pytest.mark.parametrize("eager", MODES)
def test_new_tenant_without_a_key_leaves_it_absent_not_stale(
    eager: bool, deferred: frozenset[str], b_mm: Any, managers: list
) -> None:
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=eager)
    managers.append(mgr)
    view = mgr._view
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=deferred))
    s = step(mgr, view, "a", [0], 0, 4, hidden=1.0, mm={"m": torch.full((4, MW), 2.0)})
    mgr.materialize(s, ["a"])
    s = step(mgr, view, "b", [0], 0, 4, finished=["a"], hidden=3.0, mm=b_mm(4))
    mgr.materialize(s, ["b"])
    s = step(mgr, view, "c", [0, 1], 4, 1, hit=4, finished=["b"], hidden=5.0, mm={"m": torch.full((1, MW), 6.0)})
    out = mgr.materialize(s, ["c"])
    assert out.hidden_states["c"][:, 0].tolist() == [3.0] * 4 + [5.0]
    # Block 0's m rows belong to no write of b (the tenant): the baseline.
    assert out.mm_outputs["m"]["c"][:, 0].tolist() == [0.0] * 4 + [6.0], "c was served a's stale m rows"


@pytest.mark.parametrize("eager", MODES)
def test_new_tenant_resets_every_key_of_its_slots_in_the_tables(eager: bool, managers: list) -> None:
    """After b's save, block 0's ``m`` rows are ABSENT with no owner, and a
    second request writing ``m`` there later starts from ABSENT."""
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=8, block_size=BS), BlockView(), eager=eager)
    managers.append(mgr)
    view = mgr._view
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"m"})))
    s = step(mgr, view, "a", [0], 0, 4, hidden=1.0, mm={"m": torch.full((4, MW), 2.0)})
    mgr.materialize(s, ["a"])
    s = step(mgr, view, "b", [0], 0, 4, finished=["a"], hidden=3.0, mm={})
    mgr.materialize(s, ["b"])
    # The tables are the state lock's: a threaded committer may be draining b's write.
    with mgr.components.state_lock:
        table = mgr._slot_status.get_slot_status("m")
        assert table.state[:BS].tolist() == [ABSENT] * BS
        assert table.tids[:BS].tolist() == [-1] * BS
        mgr._slot_status.check_invariants()


def test_tenancy_is_declared_in_the_spec() -> None:
    rules = {(c.name, c.fires, c.others) for c in SLOT_MACHINE.spec.couplings}
    assert rules == {("take_tenancy", "map", "reset"), ("restore_tenancy", "restore", "reset")}
    reset = {SLOT_MACHINE.State(int(m.source)).name: m.dest.name for m in SLOT_MACHINE.moves if m.trigger == "reset"}
    assert reset == {"ABSENT": "ABSENT", "IN_TRANSIT": "ABSENT", "COMMITTED": "ABSENT", "REJECTED": "ABSENT"}


def test_a_coupling_naming_an_unknown_trigger_is_refused() -> None:
    from omni_prefix_cache.specs import SpecError, load_spec, parse_spec
    from omni_prefix_cache.testing.mutants import spec_to_dict

    data = spec_to_dict(load_spec("slot_occupancy"))
    data["couplings"][0]["others"] = "evict"
    with pytest.raises(SpecError, match="others 'evict' is not a trigger"):
        parse_spec(data, origin="slot_occupancy.yaml (bad coupling)")
