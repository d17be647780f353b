"""The manager's share of the composition (spec/protocol.yaml), compiled.

``ManagerBinding`` resolves the roles executor ``manager`` moves: ``step``
(the step table), ``step_holder`` (a step's staging page), ``read`` (planned
reads, dropped where their prefetch has not started), ``slot.reject`` (a
materialize or discard rejecting its step's speculative drafts) and the
couplings ``slot.take_tenancy`` and ``slot.restore_tenancy`` (the host
tier's, ``reads.tier_fill``). ``FacadeOps`` (a mixin of the manager) compiles, once
per manager, the manager's share of new_step, save, abandon_save,
materialize, discard and shutdown, and its ``SegmentRunner``: a ``state``
segment takes the state lock and first raises the shutdown error once
shutdown began (abandon_save excepted: it undoes a failed save whatever
happened since); the save barrier waits for the previous step's immediate
writes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    StepId,
    Tid,
)
from omni_prefix_cache.manager_calls import AbandonCall, NewStepCall, SaveCall, StepCall
from omni_prefix_cache.manager_drafts import DraftOps
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.materializer import Materializer
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.reads.tier_fill import TierDesk
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.specs.composition import CompiledOperation, compile_operation
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.runner import LockRule, SegmentRunner
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.specs.types.step_context import StepContextTrigger
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import StepContext, StepTable
from omni_prefix_cache.steps.step_layout import SchedSnapshot, StepLayout
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.telemetry.registry import dropped
from omni_prefix_cache.writes.operations import active_protocol
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool

__all__ = ["FacadeOps", "ManagerBinding", "ManagerOps"]

logger = logging.getLogger(__name__)

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]


def drop_step_reads(ctx: StepContext, reads: HitReads) -> None:
    """``read.drop?`` of a consumed step's reads: each prefetch not started
    is cancelled and its read forgotten (a running one finishes itself)."""
    for hit in filter(None, ctx.record.hits):
        for key, fut in hit.futures.items():
            if fut.cancel():
                dropped(1)
                ref = hit.refs.get(key)
                if ref is not None:
                    reads.forget(ref)


class ManagerBinding:
    """``Binding`` for the manager's roles. A move over several instances
    (the steps shutdown discards, their reads) fires on each; a required
    move with no instance (a step without a page) is vacuously done, as in
    the model's binding. ``claim_page(call)`` is ``step_holder.claim``: it
    claims the save's page and launches the step's copy into it."""

    def __init__(
        self,
        steps: StepTable,
        staging: StagingBufferPool,
        hits: HitPlanner,
        reads: HitReads,
        couplings: Mapping[str, Run],
        claim_page: Run,
        reject_rows: Run,
    ) -> None:
        self._steps = steps
        self._staging = staging
        self._hits = hits
        self._reads = reads
        self._couplings = couplings  # slot couplings by name
        self._claim_page = claim_page
        self._reject_rows = reject_rows

    def try_move(self, role: str, trigger: TriggerName) -> Pred:
        steps, staging = self._steps, self._staging
        if role == "step" and trigger == "save":

            def attempt_save(call: SaveCall) -> bool:
                assert call.ctx is not None  # the register segment built it
                steps.publish_locked(call.ctx)  # raises naming the step when refused
                return True

            return attempt_save
        if role == "step" and trigger in ("materialize", "discard"):
            consume = StepContextTrigger(trigger)

            def attempt_consume(call: StepCall) -> bool:
                if call.sid is None:  # shutdown: every open step
                    moved = steps.discard_all_locked()
                    call.steps, call.moves = [ctx for ctx, _ in moved], [move for _, move in moved]
                else:  # raises naming the step for an unknown or consumed id
                    ctx, move = steps.consume_locked(call.sid, consume)
                    call.steps, call.moves = [ctx], [move]
                return True

            return attempt_consume
        if role == "step_holder" and trigger == "claim":
            claim_page = self._claim_page

            def attempt_claim(call: SaveCall) -> bool:
                claim_page(call)  # waits for a page (the staging timeout raises)
                return True

            return attempt_claim
        if role == "step_holder" and trigger == "consume":

            def attempt_release(call: StepCall) -> bool:
                # The consume move's effects (step_context: release_step_holder)
                # are this move: they release the step's page (raising when
                # the pool refuses). Shutdown's release is cleanup: a refused
                # one is logged and the others go on.
                for ctx, move in zip(call.steps, call.moves):
                    if move is None:
                        continue
                    try:
                        for effect in move.effects:
                            effect(ctx)
                    except Exception:
                        if call.sid is not None:
                            raise
                        logger.exception("omni prefix cache: releasing step %s at shutdown failed", ctx.step_id)
                return True

            return attempt_release
        if role == "step_holder" and trigger == "abandon":
            abandon = StagingHolderTrigger.ABANDON

            def attempt_abandon(call: AbandonCall) -> bool:
                claimed, holder = call.save.claimed, StagingBufferHolder.for_step(call.save.sid)
                # No page claimed, or shutdown already released it: no instance.
                if claimed is None or not staging.holds(holder):
                    return True
                return staging.try_fire(abandon, claimed.page, holder)

            return attempt_abandon
        if role == "slot" and trigger == "reject":
            reject_rows = self._reject_rows

            def attempt_reject(call: StepCall) -> bool:
                reject_rows(call)  # where enabled: only slots no later save wrote move
                return True

            return attempt_reject
        if role == "read" and trigger == "drop":
            hits, reads = self._hits, self._reads

            def attempt_drop(call: StepCall) -> bool:
                for ctx in call.steps:
                    drop_step_reads(ctx, reads)
                for hit in call.hits:
                    hits.drop(hit)
                return True

            return attempt_drop
        raise SpecError(f"protocol.yaml: the manager fires no {role}.{trigger} (its roles: executor manager)")

    def move(self, role: str, trigger: TriggerName) -> tuple[Pred, Run]:
        attempt = self.try_move(role, trigger)

        def fire(call: Any) -> None:
            attempt(call)

        return (lambda call: True), fire

    def coupling(self, role: str, name: str) -> Run:
        if role == "slot" and name in self._couplings:
            return self._couplings[name]
        raise SpecError(f"protocol.yaml: the manager runs no coupling {role}.{name}")


@dataclass(frozen=True, eq=False, slots=True)
class ManagerOps:
    """Executor ``manager``'s share of each operation it runs, compiled."""

    new_step: CompiledOperation
    save: CompiledOperation
    abandon_save: CompiledOperation
    materialize: CompiledOperation
    discard: CompiledOperation
    shutdown: CompiledOperation


class FacadeOps(DraftOps):
    """The manager's compiled operations, its runner and their effect and
    guard handlers (a mixin of ``OmniPrefixCacheManager``: the handlers are
    its own)."""

    _state_lock: threading.Lock
    _controller: OmniPrefixCacheController
    _steps: StepTable
    _hits: HitPlanner
    _tier_desk: TierDesk
    _reads: HitReads
    _requests: RequestTable
    _ledger: WriteLedger
    _layout: StepLayout
    _materializer: Materializer
    _counters: Counter[str]
    _pending_sched: SchedSnapshot | None
    _closed: bool
    _step_ctxs: dict[StepId, StepContext]
    _finish_escalations: tuple[StepId, list[Tid]]
    _slot_status: SlotOccupancy
    _policy: ModelCachePolicy

    def _check_open(self, call: str) -> None: ...  # the manager's

    def _compile_facade_ops(self) -> tuple[ManagerOps, SegmentRunner]:
        """Compile, once per manager, the manager's share of the active
        composition (``writes.operations.use_protocol`` swaps it in tests),
        and the runner its segments run through."""
        spec = active_protocol()
        tier = self._tier_desk
        couplings = {"take_tenancy": self._couple_take_tenancy, "restore_tenancy": lambda c: tier.restore(c.restores)}
        binding = ManagerBinding(
            self._steps,
            self._controller.parts.staging_pool,
            self._hits,
            self._reads,
            couplings,
            self._claim_page,
            self._reject_rows,
        )
        effects: dict[str, Run] = {
            "validate_events": self._validate_events,
            "apply_events": self._apply_events,
            "escalate_detached": self._escalate_detached,
            "plan_hits": self._plan_hits,
            "take_step_input": self._take_step_input,
            "replan_same_step_hits": self._replan_same_step_hits,
            "apply_tier": lambda c: setattr(c, "restores", tier.apply(c.given.tier, c.candidates, c.given.events)),
            "join_for_tier": lambda c: tier.join_for_loads(c.given.tier, self._ledger.previous_step_writes, c.escalate),
            "fill_reused_blocks": lambda c: tier.fill_reused(c.slots),
            "record_saved": self._record_saved,
            "start_prefetch": self._start_prefetch,
            "merge_outputs": self._merge_outputs,
            "cut_rejected": self._cut_rejected,
            "refuse_accepted_rows": self._refuse_accepted_rows,
            "restore_step_input": self._restore_step_input,
            "fail_stranded": self._fail_stranded,
            "close_facade": self._close_facade,
        }
        guards: dict[str, Pred] = {
            "replayed_step": lambda call: self._requests.replayed(call.given.sequence),
            "accepted_rows_refused": self._accepted_rows_refused,
        }
        guards["tier_loads"] = lambda call: call.given.tier is not None and bool(call.given.tier.loads)
        guards["tier_joins"] = lambda call: guards["tier_loads"](call) or (tier.active and bool(call.escalate))

        def make(name: str) -> CompiledOperation:
            return compile_operation(spec.share("manager", name), binding, effects, guards)

        ops = ManagerOps(
            new_step=make("new_step"),
            save=make("save"),
            abandon_save=make("abandon_save"),
            materialize=make("materialize"),
            discard=make("discard"),
            shutdown=make("shutdown"),
        )
        check_open = self._check_open
        runner = SegmentRunner(
            {"state": LockRule(lock=self._state_lock, check=lambda call: check_open(call.name))},
            {"previous_immediate_writes": lambda call: self._ledger.join_previous_step()},
            unchecked=frozenset({"abandon_save", "save.start_reads"}),
        )
        return ops, runner

    # ------------------------------------------------------------ new_step

    def _validate_events(self, call: NewStepCall) -> None:
        """Effect ``validate_events`` (state lock, before anything moves): the
        events (``RequestTable.validate``), then the host tier's loads: each
        one's request must be named by an event with its hit (``TierDesk.check_loads``)."""
        given = call.given
        self._requests.validate(given.events)
        if given.tier is not None:
            self._tier_desk.check_loads(given.tier, given.events)

    def _apply_events(self, call: NewStepCall) -> None:
        """Effect ``apply_events`` (state lock): the events move their
        tenures; what they installed (lookups) and detached (writes) is kept
        for the later segments, and the step's scheduler snapshot is taken."""
        given = call.given
        requests = self._requests
        requests.apply_validated(given.events, given.sequence)
        hit_blocks, call.candidates = self._hits.hit_blocks, requests.take_lookups()
        for hit in call.candidates:
            hit.block_ids = hit_blocks(hit.req_id, hit.hit_end, hit.block_ids)
        call.escalate = requests.take_detached()
        # A step with nothing scheduled has no save: the next snapshot
        # replaces it. Its hits (if any) stay pending for the next save.
        self._pending_sched = SchedSnapshot(given.num_scheduled, starts=given.starts, drafts=given.drafts)
        counters = self._counters
        counters["query_requests"] += given.queried
        counters["query_tokens"] += given.query_tokens

    def _escalate_detached(self, call: NewStepCall) -> None:
        """Effect ``escalate_detached`` (no lock: eager writes run inline); abort too: its block hashes are public."""
        if call.escalate:
            self._controller.escalate(call.escalate)
            # Escalated since the last save (upstream's ``_join_finished_tids``, compat).
            step, earlier, sid = *self._finish_escalations, self._steps.next_id
            self._finish_escalations = (sid, (earlier if step == sid else []) + call.escalate)

    def _plan_hits(self, call: NewStepCall) -> None:
        """Effect ``plan_hits`` (state lock): drain, register the step's hits
        (dropping older pending ones of their requests), plan their reads
        (``HitReads.plan_many`` runs new_step's read moves) and start their
        prefetches in this segment, so a shutdown (same lock) cancels or
        waits for each one."""
        self._ledger.commit_drained_locked()
        if not call.candidates:
            return
        hits = self._hits
        new_hits = hits.register(call.candidates, call.given.num_scheduled)
        self._counters.update(hit_requests=len(new_hits), hit_tokens=sum(hit.num_computed for hit in new_hits))
        hits.start_prefetch(hits.plan_many(new_hits, at_save=False))

    # ------------------------------------------------------------ save

    def _take_step_input(self, call: SaveCall) -> None:
        """Effect ``take_step_input`` (state lock): the step's snapshot and
        pending hits become the save's and its step id is issued."""
        if self._pending_sched is not call.pending or self._steps.next_id != call.sid:
            # Engine thread only: only a new_step or save on another thread changes these.
            raise OmniPrefixCacheUnmatchError(f"{call.name}: another call took the step's input meanwhile")
        self._pending_sched = None
        call.hits = self._hits.take_all()
        self._steps.next_id += 1

    def _claim_page(self, call: SaveCall) -> None:
        """``step_holder.claim``: a staging page for the step, its immediate
        rows copied into it (no lock: the claim may wait for a page)."""
        split = call.split
        call.progress.claimed = self._controller.parts.staging_pool.stage_step(
            split.immediate, call.n, split.freeze_event, StagingBufferHolder.for_step(call.sid)
        )

    def _register_writes_locked(self, call: SaveCall) -> None:
        """Save's ``register`` segment, the writes' part (state lock, before
        the manager's share): drain first (a failure here leaves nothing
        registered), publish new pool keys, register the step's immediate
        write and append or open its deferred ones (per task, the ledger and
        the controller's share of the segment), then build the step context."""
        call.registering = True
        ledger, claimed, split = self._ledger, call.progress.claimed, call.split
        assert claimed is not None  # claim_page claimed it
        ledger.commit_drained_locked()
        self._layout.publish_keys(call.new_slabs, split, self._slot_status)
        registered = call.progress.registered
        call.immediate = ledger.register_immediate_locked(
            split, claimed, call.req_order, call.spans, call.slots, registered
        )
        call.deferred_tids = ledger.register_deferred_locked(split, registered)
        call.ctx = self._layout.step_context(
            call.sid,
            claimed,
            split,
            call.n,
            call.req_order,
            call.spans,
            call.snapshot,
            call.mm_event,
            self._policy,
        )

    def _couple_take_tenancy(self, call: SaveCall) -> None:
        """Coupling ``slot.take_tenancy``: the step becomes its slots' tenant (reads lock too)."""
        assert call.ctx is not None
        with self._reads.lock:
            call.ctx.record.tenancy = self._ledger.take_tenancy_locked(
                call.split, call.slots, call.ctx.record.scheduled_counts(), call.immediate, call.deferred_tids
            )

    def _replan_same_step_hits(self, call: SaveCall) -> None:
        """Effect ``replan_same_step_hits``: hits on slots this step maps are
        planned again, with every other hit's reads not planned yet, at save
        (their prefetches start in segment ``start_reads``)."""
        assert call.ctx is not None
        self._hits.replan_same_step_hits(call.hits, call.slots)
        call.jobs = self._hits.attach_to_step(call.hits, call.ctx)

    def _start_prefetch(self, call: SaveCall) -> None:
        """Effect ``start_prefetch`` (state lock, unchecked): after a shutdown
        released this step (and forgot its unstarted reads) nothing starts;
        its materialize raises the shutdown error."""
        if not self._closed:
            self._hits.start_prefetch(call.jobs)

    # ------------------------------------------------------------ abandon_save

    def _restore_step_input(self, call: AbandonCall) -> None:
        """Effect ``restore_step_input`` (state lock, also after shutdown)."""
        self._step_ctxs.pop(call.save.sid, None)
        # After shutdown nothing is put back: the hits are dropped (shutdown did not see them).
        can_retry = call.retry is not None and not self._closed and self._pending_sched is None
        if self._hits.put_back(call.hits, can_retry):
            self._pending_sched = call.retry

    def _fail_stranded(self, call: AbandonCall) -> None:
        """Effect ``fail_stranded``: before publish no committer or dispatch
        saw the save's writes, so each one not final fails with the error."""
        save = call.save
        if not save.published:
            self._controller.fail_tasks(self._ledger.stranded(save.registered), call.error)

    # ------------------------------------------------------------ materialize

    def _merge_outputs(self, call: StepCall) -> None:
        (ctx,) = call.steps
        self._check_open(call.call)  # a shutdown after the consume
        self._ledger.raise_if_failed()
        call.outputs = self._materializer.build(ctx, call.req_ids)

    def _close_facade(self, call: StepCall) -> None:
        """Effect ``close_facade`` (state lock): closed; the pending hits are
        the call's to drop; the prefetch thread stops (wait=False: nothing
        waits under the lock), cancelling what has not started."""
        self._closed = True
        self._pending_sched = None
        call.hits = list(self._hits.take_all().values())
        self._hits.prefetch.shutdown(wait=False, cancel_futures=True)
        self._tier_desk.close()  # no worker connector drains its reports any more
