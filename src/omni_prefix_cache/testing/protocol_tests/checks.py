"""The protocol tests' checkers: one method per invariant the spec
declares for the tests (``workload.CHECKERS`` binds each by name), over the
real manager and controller of a run and what its drivers recorded.

A checker reads the runtime between rules (no rule runs concurrently),
through the runtime's public accessors; it raises AssertionError naming
the invariant's breach ("row oracle: ..." for the row oracle).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from hypothesis import event

from omni_prefix_cache.controller import OmniPrefixCacheController, TaskState
from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError, WriteSchedule
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.specs.composition import ProtocolSpec
from omni_prefix_cache.specs.types.copy_queue import QueuePosition
from omni_prefix_cache.steps.slot_occupancy import SlotState
from omni_prefix_cache.testing.protocol_tests.consumers import Desk
from omni_prefix_cache.testing.protocol_tests.lifecycle import TenureOracle
from omni_prefix_cache.testing.protocol_tests.workload import (
    BLOCK_SIZE,
    ENTRY_OF,
    LEFTOVER,
    WIDTHS,
    Sched,
    Served,
    leftover_rows,
    sparse_rows,
)
from omni_prefix_cache.testing.serving_model import PlannedStep, ServingModel
from omni_prefix_cache.tools.simulate.rows import rows_from_hashes


class CheckedRun(Protocol):
    """What the checkers read of a run (``machine.ProtocolMachine``)."""

    SPEC: ProtocolSpec
    ctrl: OmniPrefixCacheController
    mgr: OmniPrefixCacheManager
    model: ServingModel
    violations: dict[str, list[str]]
    escalated: set[int]
    dead: bool
    desk: Desk
    oracle: TenureOracle
    prefetch_errors: list[str]
    pending: PlannedStep | None
    paused: threading.Thread | None


class ProtocolChecks:
    """The invariant checkers of one run ``m``. A checker may mark the run
    dead (``failure_is_sticky`` found the facade raising) and consumes
    what the drivers queued for the row oracle (``rows_match_reference``);
    ``check_served``, the row oracle on a materialized step, runs in the
    materialize rule itself, before any consumer takes the output."""

    def __init__(self, m: CheckedRun):
        self.m = m

    def position_matches_task(self) -> None:
        """Every task's copy_queue state (``task.position``, the runtime's
        own) and its task state form a pair the spec's ``pairs`` lists."""
        pairs = self.m.SPEC.pairs
        for tid, task in list(self.m.ctrl.parts.registry.tasks.items()):
            pos = QueuePosition(int(task.position)).name
            assert task.state.name in pairs[pos], (
                f"task {tid} is {task.state.name} at queue position {pos} (pairs allow {list(pairs[pos])})"
            )

    def one_queue_entry(self) -> None:
        """A task is on at most one queue or list, once, and that entry is
        the one its position names (HIGH/LOW/STALE: a copy queue; CLAIMED:
        claimed; BLOCKED: blocked; any other position: none)."""
        queues = self.m.ctrl.queues
        lists = {"high": queues.high, "low": queues.low, "claimed": queues.claimed, "blocked": queues.blocked}
        entries = [tid for box in lists.values() for tid in box]
        twice = sorted({t for t in entries if entries.count(t) > 1})
        assert not twice, f"tasks {twice} on more than one queue entry: " + ", ".join(
            f"{name}={list(box)}" for name, box in lists.items()
        )
        where = {tid: name for name, box in lists.items() for tid in box}
        for tid, task in list(self.m.ctrl.parts.registry.tasks.items()):
            pos = QueuePosition(int(task.position)).name
            allowed = ENTRY_OF.get(pos, ())
            got = where.get(tid)
            assert (got in allowed) if allowed else got is None, (
                f"task {tid} at position {pos} has queue entry {got or 'none'} (expected {allowed or 'none'})"
            )
        unknown = sorted(t for t in where if t not in self.m.ctrl.parts.registry.tasks)
        assert not unknown, f"queue entries {unknown} name no registered task"

    def done_after_record(self) -> None:
        assert not self.m.violations["done_after_record"], self.m.violations["done_after_record"]

    def staged_bytes(self) -> None:
        tickets = {
            id(c.budget): c.budget
            for t in list(self.m.ctrl.parts.registry.tasks.values())
            for c in t.chunks
            if c.budget
        }
        live = sum(t.nbytes for t in tickets.values() if not t.freed)
        assert self.m.ctrl.parts.budget.staged_bytes == live, (
            f"budget counter {self.m.ctrl.parts.budget.staged_bytes} != live clone bytes {live}"
        )

    def task_views_step_page(self) -> None:
        pool = self.m.ctrl.parts.staging_pool
        for page in range(pool.depth):
            holders = pool.page_holders(page)
            kinds = {h.kind for h in holders}
            steps = {h.owner_id for h in holders if h.kind == "step"}
            for h in holders:
                if h.kind == "task":
                    task = self.m.ctrl.parts.registry.get(h.owner_id)
                    assert task is not None and not task.is_terminal, f"task {h.owner_id} holds page {page} after done"
                    assert task.page == page, f"task {h.owner_id} holds page {page}, views {task.page}"
            assert steps <= set(self.m.mgr.components.steps), f"page {page} held by consumed steps {steps}"
            assert kinds <= {"step", "task"}, kinds
        held = {h.owner_id for page in range(pool.depth) for h in pool.page_holders(page) if h.kind == "step"}
        assert held == set(self.m.mgr.components.steps), (
            f"step holders {held} != live steps {set(self.m.mgr.components.steps)}"
        )

    def copy_on_write(self) -> None:
        status = self.m.mgr.components.occupancy
        for ref in list(self.m.mgr.components.reads.pending):
            if not status.has_key(ref.key):
                continue
            current = status.get_slot_status(ref.key).slot_version.index_select(0, ref.slots)
            changed = current != ref.planned_version
            for part in ref.staged_list:  # served from the task itself, not the pool
                changed[part.positions] = False
            lost = [s for s in ref.slots[changed].tolist() if s not in ref.preserved]
            assert not lost, f"planned read of {ref.req_id} {ref.key}: slots {lost} were reused with no preserved copy"

    def failure_is_sticky(self) -> None:
        assert not self.m.violations["failure_is_sticky"], self.m.violations["failure_is_sticky"]
        drained = [t for t, task in list(self.m.ctrl.parts.registry.tasks.items()) if task.state is TaskState.FAILED]
        drained = [t for t in drained if t not in self.m.ctrl.parts.registry.failed]
        if drained:
            try:
                self.m.mgr.new_step_starts(Sched([], set(), {}))
            except OmniPrefixCacheUnmatchError as exc:
                assert "write failed" in str(exc), exc
                self.m.dead = True
                return
            raise AssertionError(f"failed writes {drained} were drained, yet a facade entry did not raise")

    def save_waits_previous_writes(self) -> None:
        assert not self.m.violations["save_waits_previous_writes"], self.m.violations["save_waits_previous_writes"]

    def queue_by_priority(self) -> None:
        for tid, task in list(self.m.ctrl.parts.registry.tasks.items()):
            pos = QueuePosition(int(task.position))
            immediate = task.schedule is WriteSchedule.JOIN_NEXT_STEP
            if pos is QueuePosition.HIGH:
                assert immediate or tid in self.m.escalated, (
                    f"deferred task {tid} is on the high queue, never escalated"
                )
            elif pos is QueuePosition.LOW:
                assert not immediate and tid not in self.m.escalated, (
                    f"task {tid} ({task.schedule.value}, escalated: {tid in self.m.escalated}) is on the low queue"
                )

    def committer_never_raises(self) -> None:
        assert not self.m.violations["committer_never_raises"], self.m.violations["committer_never_raises"]

    def no_join_under_state_lock(self) -> None:
        assert not self.m.violations["no_join_under_state_lock"], self.m.violations["no_join_under_state_lock"]

    def rows_match_reference(self) -> None:
        errors, self.m.prefetch_errors = self.m.prefetch_errors, []
        assert not errors, f"row oracle: {errors}"
        if not self.m.dead and self.m.pending is None and self.m.paused is None:
            self._check_committed_rows()

    def check_served(self, item: Served) -> None:
        """The row oracle on one materialized step: each request's range and rows are the expected ones."""
        sid, outs, planned = item.sid, item.outs, item.planned
        for exp in planned.expects:
            got_range = outs.token_ranges.get(exp.rid)
            assert got_range == (exp.start, exp.end), (
                f"row oracle: step {sid} req {exp.rid} covers positions {got_range}, expected [{exp.start},{exp.end})"
            )
            for key in WIDTHS:
                got = outs.hidden_states[exp.rid] if key == HIDDEN_KEY else outs.mm_outputs[key][exp.rid]
                want = sparse_rows(planned.n, key) if key in item.absent else self.m.model.expected_rows(exp, key)
                assert got.shape == want.shape, f"row oracle: step {sid} req {exp.rid} key {key}: {tuple(got.shape)}"
                assert torch.equal(got, want), (
                    f"row oracle: step {sid} req {exp.rid} key {key} rows [{exp.start},{exp.end}) differ"
                )
            assert torch.equal(outs.mm_outputs[LEFTOVER][exp.rid], leftover_rows(planned.n)), (
                f"row oracle: step {sid} req {exp.rid} leftover"
            )
            event("materialized a prefix hit" if exp.hit else "materialized a step's own rows")

    def _check_committed_rows(self) -> None:
        """Every cached block's COMMITTED rows are its content's rows, and an
        mm key its tenant never wrote is ABSENT there (never an older
        tenant's rows behind a hash a later request could hit)."""
        status = self.m.mgr.components.occupancy
        for block, hashes in sorted(self.m.model.cached_blocks().items()):
            slots = torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            for key, width in WIDTHS.items():
                if not status.has_key(key):
                    continue
                state = status.state[key][slots]
                absent = torch.zeros(BLOCK_SIZE, dtype=torch.bool)
                if key != HIDDEN_KEY:
                    absent = self.m.model.absent_slots(key, slots)
                    stale = absent & (state == int(SlotState.COMMITTED))
                    assert not bool(stale.any()), (
                        f"row oracle: block {block} key {key}: slots {slots[stale].tolist()} its tenant never wrote "
                        "are COMMITTED (an older tenant's rows would be served)"
                    )
                committed = (state == int(SlotState.COMMITTED)) & ~absent
                if bool(committed.any()):
                    want = rows_from_hashes(hashes, key, width, torch.float32)
                    got = self.m.mgr.components.pool.rows(key, slots)
                    assert torch.equal(got[committed], want[committed]), (
                        f"row oracle: block {block} key {key}: committed pool rows at slots "
                        f"{slots[committed].tolist()} differ from the block's content"
                    )

    # ------------------------------------------------ request lifecycle and delivery
    # The drivers (life_drivers, consumers.Desk) judge each call against the
    # tenure oracle and record breaches by invariant; these report them.

    def _reported(self, name: str) -> None:
        found, self.m.violations[name] = self.m.violations[name], []
        assert not found, f"{name}: {found}"

    def delivered_within_saved(self) -> None:
        """No consumer's watermark passes what its tenure saved or was served."""
        self._reported("delivered_within_saved")
        self.m.desk.within_saved()

    def at_most_once_in_order(self) -> None:
        """Each view starts at the consumer's watermark and holds the
        output's positions from there; each watermark is the oracle's."""
        self._reported("at_most_once_in_order")

    def gap_raises(self) -> None:
        """A view or acknowledgement past the watermark raises, moving nothing;
        nothing else raises the gap error."""
        self._reported("gap_raises")

    def old_owner_never_moves_current(self) -> None:
        """Older owners' events, retired tenures' acknowledgements and
        commits move no current tenure; commit hands off no retired tenure."""
        self._reported("old_owner_never_moves_current")

    def discard_is_not_delivery(self) -> None:
        """A discard, or a view never acknowledged, moves no watermark."""
        self._reported("discard_is_not_delivery")

    def resumed_hit_recovers(self) -> None:
        """A RESUMED hit's output starts at the lowest watermark of the consumers seen."""
        self._reported("resumed_hit_recovers")

    def accepted_rows_only(self) -> None:
        """No tenure counts a rejected (or not yet accepted) speculative
        draft: its computed, saved and rows watermarks stay within what the
        oracle knows its steps verified or its hits served; a hit over
        rejected drafts' rows is refused (``drive_optimistic_hit``). The row
        oracle checks that each output ends at its step's accepted end."""
        self._reported("accepted_rows_only")
        if self.m.dead:
            return  # a save that failed after recording its rows is no save to the oracle
        for tenure in self.m.oracle.every:
            got = tenure.runtime
            if got is None:
                continue
            bound = tenure.bound()
            assert max(got.computed_upto, got.saved_upto, got.rows_upto) <= bound, (
                f"tenure {tenure}: computed {got.computed_upto}, saved {got.saved_upto}, rows {got.rows_upto} count "
                f"positions past what its steps verified or its hits served ({bound}): a rejected draft's row"
            )
