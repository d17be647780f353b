"""The mutant catalogue: bugs this design has had (or that the seed suite documents), each re-injectable
into the runtime by a patch that lives only here (and in ``tier_mutants``, ``layout_mutants``, ``thread_mutants``
and ``draft_mutants``, which import nothing of this module); the runtime carries no switch for any.
``applied(name)`` applies one for a block (tests/conftest.py does, for a session, with
``OMNI_PREFIX_CACHE_MUTANT=<name>``). ``make mutants`` judges them all with ``mutant_runner``, which says
what counts as a kill. (``testing.mutants`` mutates *specs*.)"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

from omni_prefix_cache.testing import draft_mutants, layout_mutants, thread_mutants, tier_mutants
from omni_prefix_cache.testing.mutant_runner import ENV_VAR as ENV_VAR  # re-exported: conftest, fuzz


@dataclass(frozen=True, eq=False)
class Mutant:
    name: str
    bug: str  # what goes wrong, in one line
    patch: Callable[[contextlib.ExitStack], None]
    outside: str = ""  # why the composition's generated tests cannot reach it ("": they must)


MUTANTS: dict[str, Mutant] = {}
# Real bugs the racing tests do not kill yet within the ci budget. Listed by
# `make mutants` and runnable by name, but not counted until a test kills them.
CANDIDATES: dict[str, Mutant] = {}


def _register(
    name: str, bug: str, *, candidate: bool = False, outside: str = ""
) -> Callable[[Callable[[contextlib.ExitStack], None]], Callable[..., None]]:
    def deco(fn: Callable[[contextlib.ExitStack], None]) -> Callable[..., None]:
        (CANDIDATES if candidate else MUTANTS)[name] = Mutant(name, bug, fn, outside)
        return fn

    return deco


def _set(stack: contextlib.ExitStack, owner: Any, attr: str, value: Any) -> None:
    stack.enter_context(mock.patch.object(owner, attr, value))


# ------------------------------------------------------------------ controller


def _spec_mutant(stack: contextlib.ExitStack, patch: Callable[[dict[str, Any]], None]) -> None:
    """Controllers built while the mutant is applied compile their operations from the composition with ``patch``."""
    from omni_prefix_cache.specs.composition import load_protocol
    from omni_prefix_cache.writes.operations import use_protocol

    stack.enter_context(use_protocol(load_protocol().mutated(patch, check_coverage=False)))


def _op(data: dict[str, Any], name: str) -> dict[str, Any]:
    op: dict[str, Any] = next(o for o in data["operations"] if o["name"] == name)
    return op


def _segment_with(op: dict[str, Any], step: Any) -> list[Any]:
    """The steps list of the segment of ``op`` that holds ``step``."""
    steps: list[Any] = next(seg["steps"] for seg in op["segments"] if step in seg.get("steps", []))
    return steps


@_register("escalate_requeues_claimed", "escalate re-queues a task the committer already claimed (double copy)")
def _escalate_requeues_claimed(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.controller import OmniPrefixCacheController, TaskState
    from omni_prefix_cache.specs.types.copy_queue import QueuePosition

    original = OmniPrefixCacheController.escalate

    def escalate(self: OmniPrefixCacheController, tids: list[int]) -> None:
        with self.lock:
            for tid in tids:
                task = self.parts.registry.get(tid)
                if task is not None and task.state is TaskState.COPYING:
                    with task.lock:
                        task.state = TaskState.QUEUED  # the old bug: no claim check
                    task.position = QueuePosition.HIGH
                    self.queues.high.appendleft(tid)
        original(self, tids)

    _set(stack, OmniPrefixCacheController, "escalate", escalate)


def _done_first(data: dict[str, Any]) -> None:
    # `task.written` (which sets done) moved before publish_completed.
    for name in ("committer_write", "eager_run"):
        op = _op(data, name)
        op["segments"] = [seg for seg in op["segments"] if seg.get("steps") != ["task.written"]]
        steps = _segment_with(op, {"do": "publish_completed"})
        steps.insert(steps.index({"do": "publish_completed"}), "task.written")


@_register("done_before_completion_record", "`done` fires before the completion record is published")
def _done_before_record(stack: contextlib.ExitStack) -> None:
    _spec_mutant(stack, _done_first)


def _wake_first(data: dict[str, Any]) -> None:
    op = _op(data, "fail")
    op["segments"] = [seg for seg in op["segments"] if seg.get("steps") != [{"do": "wake_failed"}]]
    steps = _segment_with(op, {"do": "publish_failed"})
    steps.insert(steps.index({"do": "publish_failed"}), {"do": "wake_failed"})


@_register("failure_wake_before_record", "failure waiters are woken before the failure record is published")
def _failure_wake_before_record(stack: contextlib.ExitStack) -> None:
    _spec_mutant(stack, _wake_first)


@_register("budget_uncharged_twice", "a budget ticket uncharges again when a task releases it twice")
def _budget_uncharged_twice(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.writes.chunks import BudgetTicket

    def release(self: BudgetTicket, tid: int) -> int:
        self.tids.discard(tid)
        return 0 if self.tids else self.nbytes

    _set(stack, BudgetTicket, "release", release)


@_register("committer_dies_on_exception", "a copy failure escapes the committer instead of failing its task")
def _committer_dies(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.writes.committer import Committer

    def copy(self: Committer, tids: list[int]) -> None:
        tasks = [t for tid in tids if (t := self._registry.get(tid)) is not None]
        batch = self._runner.run_batch(self._ops.copy, tasks)
        if batch.errors:
            raise batch.errors[0][1]

    _set(stack, Committer, "_copy", copy)


@_register("pool_write_failure_wrong_task", "a pool-write failure is charged to another task")
def _pool_write_failure_wrong_task(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.writes.committer import Committer

    def write(self: Committer) -> list[int]:
        registry = self._registry
        op = self._ops.pool_write_op(self._mode.eager)
        with self._lock:
            ready = [t for tid in self._queues.blocked if (t := registry.get(tid)) is not None and self._ready(t)]
            for task in ready:
                self._queues.blocked.remove(task.tid)
        for task in ready:
            try:
                op.segments[op.at("pool_write")](task)
            except BaseException:
                others = [t for t in registry.tasks.values() if t is not task and not t.is_terminal]
                if others:
                    self._fail(min(others, key=lambda t: t.tid), None)
        return [t.tid for t in ready]

    _set(stack, Committer, "write", write)


@_register("eager_failure_leaves_later_tasks", "a failed eager dispatch leaves the batch's later tasks unfailed")
def _eager_failure_leaves_later(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.writes.eager import EagerDispatch

    def dispatch(self: EagerDispatch, tasks: list[Any]) -> None:
        writer = self._writer
        batch = writer.open(self._op)
        try:
            self._run(list(tasks))
        finally:
            writer.close(batch)
            writer.land(batch)
        if batch.errors:
            raise batch.errors[0][1]  # the failing task's error, and nobody failed

    _set(stack, EagerDispatch, "dispatch", dispatch)


def _no_release_at_write(data: dict[str, Any]) -> None:
    for name in ("committer_write", "eager_run"):
        _segment_with(_op(data, name), "task_holder.written?").remove("task_holder.written?")


@_register("task_holder_released_at_drain", "a task's staging hold is released at drain, not at its pool write")
def _holder_released_at_drain(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.controller import OmniPrefixCacheController
    from omni_prefix_cache.writes.staging import StagingBufferHolder

    _spec_mutant(stack, _no_release_at_write)
    init = OmniPrefixCacheController.__init__

    def released_at_drain(self: OmniPrefixCacheController, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)  # then its registry's drain releases what the pool writes no longer do
        registry, pool, drain = self.parts.registry, self.parts.staging_pool, self.parts.registry.take_completed

        def take_completed() -> list[int]:
            held = [(t.page, t.tid) for tid in list(registry.completed) if (t := registry.get(tid)) is not None]
            out = drain()
            for page, tid in held:
                if page is not None and pool.enabled("written", page, holder := StagingBufferHolder.for_task(tid)):
                    pool.fire("written", page, holder)
            return out

        registry.take_completed = take_completed  # type: ignore[method-assign]

    _set(stack, OmniPrefixCacheController, "__init__", released_at_drain)


# Composition rules broken by a spec mutation alone.


def _fail_keeps_position(data: dict[str, Any]) -> None:
    _segment_with(_op(data, "fail"), "position.fail").remove("position.fail")


@_register("fail_keeps_queue_entry", "a failed task keeps its queue position, so a later claim pops a dead entry")
def _fail_keeps_queue_entry(stack: contextlib.ExitStack) -> None:
    _spec_mutant(stack, _fail_keeps_position)


def _fail_keeps_hold(data: dict[str, Any]) -> None:
    _segment_with(_op(data, "fail"), "task_holder.fail?").remove("task_holder.fail?")


@_register("fail_keeps_staging_hold", "a failed immediate write keeps its staging page busy")
def _fail_keeps_staging_hold(stack: contextlib.ExitStack) -> None:
    _spec_mutant(stack, _fail_keeps_hold)


def _deferred_high(data: dict[str, Any]) -> None:
    # The dispatch's low push becomes a high push.
    dispatch = next(seg for seg in _op(data, "save")["segments"] if seg["name"] == "dispatch")

    def swap(steps: list[Any]) -> None:
        for i, step in enumerate(steps):
            if step == "position.push_low":
                steps[i] = "position.push"
            elif isinstance(step, dict):
                for branch in ("then", "else"):
                    swap(step.get(branch, []))

    swap(dispatch["steps"])


@_register("queued_deferred_pushed_high", "a deferred write queued at submit is pushed to the high queue")
def _queued_deferred_pushed_high(stack: contextlib.ExitStack) -> None:
    _spec_mutant(stack, _deferred_high)


# ------------------------------------------------------------------ manager


@_register(
    "tombstone_drops_fresh_rows",
    "a rewrite of a slot the write already lost is appended to it, not opened as a new write (rows dropped)",
)
def _tombstone_drops_fresh_rows(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.writes.write_task import WriteTask

    _set(stack, WriteTask, "taken_over_intersects", lambda self, chunk: False)


@_register("leftover_sliced_by_ge", "leftover mm sliced whenever shape[0] >= n, not only when == n")
def _leftover_sliced_by_ge(stack: contextlib.ExitStack) -> None:
    import torch

    from omni_prefix_cache.steps import step_layout

    original = step_layout.snapshot_leftover_mm_cpu

    def snapshot(mm: Any, skip_keys: set[str], n: int) -> Any:
        def cut(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] >= n:
                return value[:n]
            return value

        return original({k: cut(v) for k, v in mm.items()}, skip_keys, n)

    _set(stack, step_layout, "snapshot_leftover_mm_cpu", snapshot)


@_register("state_lock_across_join", "the manager's state lock is held across a join")
def _state_lock_across_join(stack: contextlib.ExitStack) -> None:
    # The save barrier joins the previous step's writes with the state lock held.
    from omni_prefix_cache.steps.write_ledger import WriteLedger

    join_previous_step = WriteLedger.join_previous_step

    def locked_join_previous_step(self: WriteLedger) -> None:
        with self._state_lock:
            join_previous_step(self)

    _set(stack, WriteLedger, "join_previous_step", locked_join_previous_step)


@_register("save_skips_previous_write_barrier", "save does not wait for the previous step's pool writes")
def _save_skips_barrier(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.steps.write_ledger import WriteLedger

    def join_previous_step(self: WriteLedger) -> None:
        self.previous_step_writes = []  # forgotten, never joined

    _set(stack, WriteLedger, "join_previous_step", join_previous_step)


@_register("same_step_hit_planned_early", "a same-step hit is planned before its write is registered")
def _same_step_hit_planned_early(stack: contextlib.ExitStack) -> None:
    # Plan every hit at new_step_starts, even on ABSENT rows this step is
    # about to compute, and never plan it again at save.
    from omni_prefix_cache.reads.hit_planner import HitPlanner

    plan_many = HitPlanner.plan_many  # plan() is plan_many() of one hit
    _set(stack, HitPlanner, "plan_many", lambda self, hits, *, at_save: plan_many(self, hits, at_save=True))
    _set(stack, HitPlanner, "replan_same_step_hits", lambda self, hits, slots: None)


@_register("reused_block_hit_not_replanned", "a hit on a block this step reallocates reads the old tenant's rows")
def _reused_block_hit_not_replanned(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.reads.hit_planner import HitPlanner

    _set(stack, HitPlanner, "replan_same_step_hits", lambda self, hits, slots: None)


@_register("stale_tenant_keys_kept", "a new tenant maps only the keys it writes; its slots keep older tenants' rows")
def _stale_tenant_keys_kept(stack: contextlib.ExitStack) -> None:
    # The bug before slot tenancy was declared: mapping a step touched only
    # the keys in that step, so the others stayed COMMITTED with old rows.
    from omni_prefix_cache.specs.types import SlotOccupancyTrigger
    from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy

    def take_tenancy(self: SlotOccupancy, slots: Any, writes: Any) -> None:
        for key, owners in writes.items():
            self.apply(SlotOccupancyTrigger.MAP, key, slots, owners)

    _set(stack, SlotOccupancy, "take_tenancy", take_tenancy)


@_register("cow_copy_missed_before_reads_lock", "a fetch picks its preserved copies before taking the reads lock")
def _cow_copy_missed_before_reads_lock(stack: contextlib.ExitStack) -> None:
    # The race: `preserved = preserved or {}` ran before the lock, so a
    # still-empty dict was swapped for a fresh one while a reuse filled the
    # read's own dict and bumped the versions.
    from omni_prefix_cache.reads.planned_read import HitReads

    check = HitReads.ensure_not_overwritten

    def ensure_not_overwritten(self: Any, slots: Any, key: Any, *, preserved: Any = None, **kw: Any) -> Any:
        return check(self, slots, key, preserved=preserved or {}, **kw)

    _set(stack, HitReads, "ensure_not_overwritten", ensure_not_overwritten)


# ------------------------------------------------------------------ composition rules
# Each breaks one rule of spec/protocol.yaml in the code that executes it
# (the manager's operations are not compiled from the spec; the binding's
# moves are the runtime's, not the spec's).


@_register(
    "escalate_pushes_high_queued_twice",
    "escalate pushes a task already on the high queue to its head again (escalate's first_of runs both branches)",
)
def _escalate_pushes_high_queued_twice(stack: contextlib.ExitStack) -> None:
    # Patches OmniPrefixCacheController.escalate: a second head entry for a task already HIGH.
    from omni_prefix_cache.controller import OmniPrefixCacheController
    from omni_prefix_cache.specs.types.copy_queue import QueuePosition

    original = OmniPrefixCacheController.escalate

    def escalate(self: OmniPrefixCacheController, tids: list[int]) -> None:
        if not self.mode.eager:
            with self.lock:
                for tid in tids:
                    task = self.parts.registry.get(tid)
                    if task is not None and task.position == QueuePosition.HIGH:
                        self.queues.high.appendleft(tid)
        original(self, tids)

    _set(stack, OmniPrefixCacheController, "escalate", escalate)


@_register(
    "drain_forgets_sticky_failure",
    "drain drops a failed write's rows but never makes the failure sticky (drain's sticky_failure step skipped)",
)
def _drain_forgets_sticky_failure(stack: contextlib.ExitStack) -> None:
    # A spec mutation: drain's `when failures_drained: sticky_failure` step is gone.
    def patch(data: dict[str, Any]) -> None:
        steps = _op(data, "drain")["segments"][0]["steps"]
        steps[:] = [s for s in steps if not (isinstance(s, dict) and s.get("when") == "failures_drained")]

    _spec_mutant(stack, patch)


@_register(
    "fail_keeps_staging_page",
    "the controller's binding of fail's task_holder.fail? releases nothing: a failed task's page never frees",
)
def _fail_keeps_staging_page(stack: contextlib.ExitStack) -> None:
    # A runtime bug, not a spec mutation (that is fail_keeps_staging_hold):
    # the spec still lists the release, ControllerBinding.try_move drops it.
    from omni_prefix_cache.writes.operations import ControllerBinding

    original = ControllerBinding.try_move

    def try_move(self: ControllerBinding, role: str, trigger: str) -> Callable[[Any], bool]:
        if (role, trigger) == ("task_holder", "fail"):
            return lambda task: False
        attempt: Callable[[Any], bool] = original(self, role, trigger)
        return attempt

    _set(stack, ControllerBinding, "try_move", try_move)


@_register(
    "materialize_keeps_step_page",
    "materialize consumes the step but skips its step_holder.consume: the step's staging page is never released",
)
def _materialize_keeps_step_page(stack: contextlib.ExitStack) -> None:
    # A runtime bug: the manager's binding of materialize's step_holder.consume
    # releases nothing (discard and shutdown still release).
    from omni_prefix_cache.manager_ops import ManagerBinding

    original = ManagerBinding.try_move

    def try_move(self: ManagerBinding, role: str, trigger: str) -> Callable[[Any], bool]:
        attempt: Callable[[Any], bool] = original(self, role, trigger)
        if (role, trigger) != ("step_holder", "consume"):
            return attempt
        return lambda call: True if str(call).startswith("materialize") else attempt(call)

    _set(stack, ManagerBinding, "try_move", try_move)


# ------------------------------------------------------------------ request lifecycle and delivery
# Each breaks one rule of spec/request_lifecycle.yaml, spec/delivery.yaml or
# their operations in the runtime (requests/), judged by the generated
# protocol tests' tenure oracle.


@_register(
    "clip_ignores_watermark",
    "delivery_view's clip_outputs ignores the watermark: a shrinking or recovered hit re-delivers positions",
)
def _clip_ignores_watermark(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.requests import delivery

    def clip(item: Any) -> None:
        item.result = (item.start, item.end)

    _set(stack, delivery, "_clip", clip)


@_register("gap_never_raises", "the no_gap guard always holds: a view or acknowledgement skips positions silently")
def _gap_never_raises(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.requests import delivery, tenure

    for module in (delivery, tenure):
        _set(stack, module, "no_gap", lambda *args: True)


@_register(
    "ack_resolves_tenure_by_id",
    "an acknowledgement moves the id's current tenure, not the tenure its output was saved under",
)
def _ack_resolves_tenure_by_id(stack: contextlib.ExitStack) -> None:
    # The request table's binding applies delivery moves through
    # lifecycle.apply_delivery_move: an ack's effects land on the id's tenure.
    from omni_prefix_cache.requests import lifecycle
    from omni_prefix_cache.requests.tenure import apply_delivery_move as original

    def apply(move: Any, m: Any) -> None:
        if move.trigger == "ack" and m.table is not None:
            current = m.table.tenure_of(getattr(m, "req_id", ""))
            if current is not None and current is not m.tenure:
                m.tenure.deliveries[m.consumer] = move.dest
                m.tenure = current
                for effect in move.effects:
                    effect(m)
                return
        original(move, m)

    _set(stack, lifecycle, "apply_delivery_move", apply)


@_register("discard_counts_as_delivery", "discard_step advances each known consumer's watermark to the step's end")
def _discard_counts_as_delivery(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    original = OmniPrefixCacheManager.discard_step

    def discard_step(self: OmniPrefixCacheManager, step_id: int, *args: Any, **kwargs: Any) -> None:
        ctx = self.components.steps.get(step_id)
        if ctx is not None:
            for tenure, (_, end) in zip(ctx.record.tenures, ctx.record.token_ranges):
                for consumer in tenure.delivered_upto:
                    tenure.delivered_upto[consumer] = max(tenure.delivered_upto[consumer], end)
        original(self, step_id, *args, **kwargs)  # accepted_rows (issue 47) passes through

    _set(stack, OmniPrefixCacheManager, "discard_step", discard_step)


@_register("resume_skips_lookup", "a RESUMED event's hit is not installed: positions no consumer received are lost")
def _resume_skips_lookup(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.adapter import PrefixCacheEventKind
    from omni_prefix_cache.requests.lifecycle import RequestTable

    original = RequestTable.install_lookup

    def install_lookup(self: RequestTable, tenure: Any, event: Any) -> None:
        if event.kind is not PrefixCacheEventKind.RESUMED:
            original(self, tenure, event)

    _set(stack, RequestTable, "install_lookup", install_lookup)


@_register("commit_keeps_retired", "commit_output's filter_retired keeps every request: retired tenures are handed off")
def _commit_keeps_retired(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.requests.delivery import DeliveryDesk

    def filter_retired(self: DeliveryDesk, ctx: Any) -> None:
        ctx.live = frozenset(ctx.outputs.token_ranges)

    _set(stack, DeliveryDesk, "_filter_retired", filter_retired)


@_register(
    "replayed_step_applied", "a replayed step sequence applies its events again (the replayed_step guard is lost)"
)
def _replayed_step_applied(stack: contextlib.ExitStack) -> None:
    # The guard new_step's compiled first segment reads.
    from omni_prefix_cache.requests.lifecycle import RequestTable

    _set(stack, RequestTable, "replayed", lambda self, sequence: False)


@_register("view_past_saved_issued", "within_saved always holds: a view of an output edited past saved is issued")
def _view_past_saved_issued(stack: contextlib.ExitStack) -> None:
    # The guard outside_saved (the desk's) and the machine's within_saved both read it.
    from omni_prefix_cache.requests import delivery, tenure

    for module in (delivery, tenure):
        _set(stack, module, "within_saved", lambda *args: True)


def _before_record(stack: contextlib.ExitStack, before: Callable[[Any, Any], None]) -> None:
    """DeliveryDesk.issued_record (guard issued_view's check) runs ``before(record, view)`` first."""
    from omni_prefix_cache.requests.delivery import DeliveryDesk

    original = DeliveryDesk.issued_record

    def record(self: DeliveryDesk, view: Any, consumer: str, **kw: Any) -> Any:
        entry = self._issued.get(id(view))
        if entry is not None and entry[0]() is view:
            before(entry[1], view)
        return original(self, view, consumer, **kw)

    _set(stack, DeliveryDesk, "issued_record", record)


@_register("edited_view_acknowledged", "issued_view ignores edits: a view edited to reach further is acknowledged")
def _edited_view_acknowledged(stack: contextlib.ExitStack) -> None:
    from omni_prefix_cache.interface import output_progress

    def take_edits(record: Any, view: Any) -> None:
        record.ranges, record.tenures = dict(view.token_ranges), dict(output_progress(view))

    _before_record(stack, take_edits)


@_register("view_acknowledged_twice", "issued_view ignores spending: a view committed once is handed off again")
def _view_acknowledged_twice(stack: contextlib.ExitStack) -> None:
    _before_record(stack, lambda record, view: setattr(record, "spent", False))


for _more in (tier_mutants, layout_mutants, thread_mutants, draft_mutants):
    _more.register(_register, _set)


# ------------------------------------------------------------------ applying


@contextlib.contextmanager
def applied(name: str) -> Iterator[Mutant]:
    """Apply mutant ``name`` for the duration of the block."""
    if (mutant := MUTANTS.get(name) or CANDIDATES.get(name)) is None:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS | CANDIDATES))}")
    with contextlib.ExitStack() as stack:
        mutant.patch(stack)
        yield mutant


if __name__ == "__main__":
    from omni_prefix_cache.testing.mutant_runner import main

    raise SystemExit(main(None, MUTANTS, CANDIDATES))
