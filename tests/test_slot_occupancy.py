"""Vectorised slot occupancy against the slot_occupancy spec.

Every move is checked two ways: by hand for the cases the manager relies on
(a takeover hands the taken rows to the old owner, reuse bumps the version and preserves
pending reads, a stale writer's commit is refused) and by a generated
comparison with the ``transitions`` oracle built from the same spec.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, WriteSchedule
from omni_prefix_cache.specs import load_spec
from omni_prefix_cache.specs.oracle import build_oracle, oracle_step
from omni_prefix_cache.steps.slot_occupancy import SLOT_MACHINE, SlotOccupancy, SlotState
from omni_prefix_cache.writes.chunks import WriteChunk
from omni_prefix_cache.writes.write_task import WriteTask

ABSENT, IN_TRANSIT, COMMITTED = int(SlotState.ABSENT), int(SlotState.IN_TRANSIT), int(SlotState.COMMITTED)

KEY = "k"


def slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


class Hooks:
    """Records what the occupancy asks its owner to do."""

    def __init__(self) -> None:
        self.taken_over: list[tuple[int, str, list[int]]] = []
        self.reused: list[tuple[str, list[int]]] = []

    def on_takeover(self, tid: int, key: str, rows: torch.Tensor) -> None:
        self.taken_over.append((tid, key, rows.tolist()))

    def on_reuse(self, key: str, rows: torch.Tensor) -> None:
        self.reused.append((key, sorted(rows.tolist())))


def make(num_slots: int = 16) -> tuple[SlotOccupancy, Hooks]:
    hooks = Hooks()
    occ = SlotOccupancy(num_slots, on_takeover=hooks.on_takeover, on_reuse=hooks.on_reuse)
    occ.add_key(KEY)
    return occ, hooks


def states(occ: SlotOccupancy, *ids: int) -> list[str]:
    return [SlotState(int(s)).name for s in occ.state[KEY][slots(*ids)]]


def test_enum_and_tables_come_from_the_spec() -> None:
    spec = load_spec("slot_occupancy")
    assert [s.name for s in SlotState] == list(spec.state_names)
    assert (ABSENT, IN_TRANSIT, COMMITTED) == (SlotState.ABSENT, SlotState.IN_TRANSIT, SlotState.COMMITTED)
    occ, _ = make()
    status = occ.get_slot_status(KEY)
    assert status.state is occ.state[KEY] and status.state.dtype == torch.int8
    assert int(status.tids.min()) == -1 and int(status.slot_version.max()) == 0
    # The legal-move table the vectorised path uses is the compiled spec's.
    assert SLOT_MACHINE.transition_matrix("commit") == (-1, COMMITTED, -1, -1)


def test_map_commit_cycle_sets_and_clears_owner() -> None:
    occ, hooks = make()
    assert occ.map(KEY, slots(1, 2, 3), torch.tensor([5, 5, 6])) == 3
    assert states(occ, 0, 1, 2, 3) == ["ABSENT", "IN_TRANSIT", "IN_TRANSIT", "IN_TRANSIT"]
    assert occ.get_slot_status(KEY).tids[slots(1, 2, 3)].tolist() == [5, 5, 6]
    assert occ.commit(KEY, slots(1, 2), 5) == 2
    assert states(occ, 1, 2, 3) == ["COMMITTED", "COMMITTED", "IN_TRANSIT"]
    assert occ.get_slot_status(KEY).tids[slots(1, 2, 3)].tolist() == [-1, -1, 6]
    assert hooks.taken_over == [] and hooks.reused == []
    occ.check_invariants(live_tids={6})


def test_commit_by_a_writer_that_lost_the_slot_does_not_move_it() -> None:
    occ, _ = make()
    occ.map(KEY, slots(4, 5), 1)
    occ.map(KEY, slots(5), 2)  # takeover of slot 5
    assert occ.commit(KEY, slots(4, 5), 1) == 1  # owned_by_writer refuses slot 5
    assert states(occ, 4, 5) == ["COMMITTED", "IN_TRANSIT"]
    assert int(occ.get_slot_status(KEY).tids[5]) == 2


@pytest.mark.parametrize("trigger", ["commit", "drop"])
def test_illegal_move_raises_naming_key_and_slots_and_changes_nothing(trigger: str) -> None:
    occ, _ = make()
    occ.map(KEY, slots(1, 2), 3)
    occ.commit(KEY, slots(2), 3)
    before = [t.clone() for t in (occ.state[KEY], occ.get_slot_status(KEY).tids)]
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"'k': {trigger} is illegal from ABSENT for slots \[7, 9\]"):
        getattr(occ, trigger)(KEY, slots(1, 7, 9), 3)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"illegal from COMMITTED for slots \[2\]"):
        getattr(occ, trigger)(KEY, slots(1, 2), 3)
    assert torch.equal(occ.state[KEY], before[0]) and torch.equal(occ.get_slot_status(KEY).tids, before[1])


def test_takeover_hands_the_taken_rows_to_the_old_owner_only() -> None:
    occ, hooks = make()
    occ.map(KEY, slots(0, 1, 2, 3), torch.tensor([7, 7, 8, 8]))
    occ.map(KEY, slots(1, 2, 3, 9), 9)
    assert sorted(hooks.taken_over) == [(7, KEY, [1]), (8, KEY, [2, 3])]
    assert occ.get_slot_status(KEY).tids[slots(0, 1, 2, 3, 9)].tolist() == [7, 9, 9, 9, 9]
    # A write remapping its own in-transit slot (preempt and resume) loses nothing.
    hooks.taken_over.clear()
    occ.map(KEY, slots(1), 9)
    assert hooks.taken_over == []


def test_takeover_feeds_the_old_tasks_scatter_skip() -> None:
    """Wired like the manager: the hook records the rows on the WriteTask."""
    old = WriteTask(
        tid=7,
        req_id="a",
        write_n=1,
        schedule=WriteSchedule.JOIN_ON_FINISH,
        chunks=[WriteChunk(slots_cpu=slots(0, 1), tensors={}, host={KEY: torch.ones(2, 2)})],
    )
    occ = SlotOccupancy(8, on_takeover=lambda tid, key, rows: old.add_taken_over(key, rows) if tid == 7 else None)
    occ.add_key(KEY)
    occ.map(KEY, slots(0, 1), 7)
    occ.map(KEY, slots(1), 8)
    assert old.taken_over[KEY].tolist() == [1]
    ((key, kept, _),) = old.scatter_rows()
    assert key == KEY and kept.tolist() == [0]


def test_reuse_of_committed_slots_bumps_version_once_and_preserves() -> None:
    occ, hooks = make()
    occ.map(KEY, slots(2, 3), 1)
    occ.commit(KEY, slots(2, 3), 1)
    occ.map(KEY, slots(3, 3, 4), 2)  # slot 3 listed twice is one reuse; 4 is fresh
    version = occ.get_slot_status(KEY).slot_version
    assert version[slots(2, 3, 4)].tolist() == [0, 1, 0]
    assert hooks.reused == [(KEY, [3, 3])]
    occ.commit(KEY, slots(3, 4), 2)
    occ.map(KEY, slots(3), 5)
    assert int(version[3]) == 2


def test_mixed_source_map_runs_each_groups_effects_on_its_rows() -> None:
    occ, hooks = make()
    occ.map(KEY, slots(1, 2), 1)
    occ.commit(KEY, slots(2), 1)
    # 0 ABSENT, 1 IN_TRANSIT (owner 1), 2 COMMITTED
    occ.map(KEY, slots(0, 1, 2), torch.tensor([4, 5, 6]))
    assert states(occ, 0, 1, 2) == ["IN_TRANSIT"] * 3
    assert occ.get_slot_status(KEY).tids[slots(0, 1, 2)].tolist() == [4, 5, 6]
    assert hooks.taken_over == [(1, KEY, [1])]
    assert hooks.reused == [(KEY, [2])]
    assert occ.get_slot_status(KEY).slot_version[slots(0, 1, 2)].tolist() == [0, 0, 1]


def test_drop_returns_a_failed_writers_rows_to_absent() -> None:
    occ, _ = make()
    occ.map(KEY, slots(0, 1, 2), torch.tensor([3, 3, 4]))
    assert occ.drop(KEY, slots(0, 1, 2), 3) == 2
    assert states(occ, 0, 1, 2) == ["ABSENT", "ABSENT", "IN_TRANSIT"]
    occ.check_invariants()


def test_settle_skips_rows_a_newer_owner_already_settled() -> None:
    occ, _ = make()
    occ.map(KEY, slots(0, 1, 2), 1)
    occ.map(KEY, slots(1, 2), 2)
    occ.commit(KEY, slots(1), 2)  # new owner committed slot 1 first; slot 2 still in transit
    assert occ.settle("commit", KEY, slots(0, 1, 2), 1) == 1
    assert states(occ, 0, 1, 2) == ["COMMITTED", "COMMITTED", "IN_TRANSIT"]
    with pytest.raises(
        OmniPrefixCacheUnmatchError, match=r"settle takes \['commit', 'drop'\] \(protocol drain\), not 'map'"
    ):
        occ.settle("map", KEY, slots(0), 1)


def test_bad_slots_keys_and_owner_counts_raise() -> None:
    occ, _ = make(8)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"slots \[8, -1\] outside \[0, 8\)"):
        occ.map(KEY, slots(1, 8, -1), 1)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="unknown key 'nope'"):
        occ.map("nope", slots(1), 1)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="3 owners for 2 slots"):
        occ.map(KEY, slots(1, 2), torch.tensor([1, 2, 3]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="unknown trigger"):
        occ.apply("evict", KEY, slots(1), 1)
    assert occ.map(KEY, slots(), 1) == 0


def test_check_invariants_names_the_broken_slots() -> None:
    occ, _ = make()
    occ.map(KEY, slots(3), 1)
    occ.get_slot_status(KEY).tids[5] = 2  # an owner on an ABSENT slot
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"owner_iff_in_transit broken at slots \[5\]"):
        occ.check_invariants()
    occ.get_slot_status(KEY).tids[5] = -1
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"owners \[1\] are not live"):
        occ.check_invariants(live_tids={2})


# ------------------------------------------------------------ generated: runtime vs oracle

NUM_SLOTS = 6
OPS = st.lists(
    st.tuples(
        st.sampled_from(["map", "commit", "drop"]),
        st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=4, unique=True),
        st.integers(1, 3),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_vectorised_moves_match_the_spec_oracle(ops: list[tuple[str, list[int], int]]) -> None:
    """Each vectorised move equals firing the trigger slot by slot on the
    ``transitions`` machine built from the same spec, with owned_by_writer
    evaluated per slot; an illegal row makes the whole call raise unchanged."""
    spec = load_spec("slot_occupancy")
    machine, model = build_oracle(spec)
    occ, hooks = make(NUM_SLOTS)
    ref_state = ["ABSENT"] * NUM_SLOTS
    ref_owner = [-1] * NUM_SLOTS
    ref_version = [0] * NUM_SLOTS
    for trigger, rows, tid in ops:
        outcomes = []
        for s in rows:
            model.guard_values["owned_by_writer"] = ref_owner[s] == tid
            outcomes.append(oracle_step(machine, model, ref_state[s], trigger))
        hooks.taken_over.clear()
        hooks.reused.clear()
        if any(kind == "illegal" for kind, _, _ in outcomes):
            before = occ.state[KEY].clone()
            with pytest.raises(OmniPrefixCacheUnmatchError, match="illegal"):
                occ.apply(trigger, KEY, torch.tensor(rows), tid)
            assert torch.equal(occ.state[KEY], before)
            continue
        moved = occ.apply(trigger, KEY, torch.tensor(rows), tid)
        assert moved == sum(kind == "moved" for kind, _, _ in outcomes)
        want_taken: dict[int, list[int]] = {}
        want_reused: list[int] = []
        for s, (kind, dest, effects) in zip(rows, outcomes):
            if kind != "moved":
                continue
            if "reassign_from_old_owner" in effects and ref_owner[s] != tid:
                want_taken.setdefault(ref_owner[s], []).append(s)
            if "preserve_pending_reads" in effects:
                want_reused.append(s)
            if "bump_version" in effects:
                ref_version[s] += 1
            if "set_owner" in effects:
                ref_owner[s] = tid
            if "clear_owner" in effects:
                ref_owner[s] = -1
            ref_state[s] = dest
        got_taken: dict[int, list[int]] = {}
        for old, _, taken in hooks.taken_over:
            got_taken.setdefault(old, []).extend(taken)
        assert {k: sorted(v) for k, v in got_taken.items()} == {k: sorted(v) for k, v in want_taken.items()}
        assert sorted(s for _, group in hooks.reused for s in group) == sorted(want_reused)
        table = occ.get_slot_status(KEY)
        assert [SlotState(int(x)).name for x in table.state] == ref_state
        assert table.tids.tolist() == ref_owner
        assert table.slot_version.tolist() == ref_version
        occ.check_invariants()


def test_apply_where_enabled_leaves_rows_without_the_move() -> None:
    occ, _ = make()
    occ.map(KEY, slots(0), 1)
    # Slot 1 is ABSENT: strict commit refuses it, the protocol's `slot.commit?` skips it.
    with pytest.raises(OmniPrefixCacheUnmatchError, match="commit is illegal from ABSENT"):
        occ.apply("commit", KEY, slots(0, 1), 1)
    assert occ.apply("commit", KEY, slots(0, 1), 1, where_enabled=True) == 1
    assert states(occ, 0, 1) == ["COMMITTED", "ABSENT"]
