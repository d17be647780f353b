"""The manager's side of the composition (spec/protocol.yaml), compiled.

``ManagerBinding`` resolves the roles the manager moves: ``step`` (the step
table), ``step_holder`` (a step's staging page), ``read`` (planned reads,
dropped where their prefetch has not started) and the couplings
``slot.take_tenancy`` and ``slot.restore_tenancy`` (the host tier's,
``reads.tier_fill``). ``FacadeOps`` (a mixin of the manager) compiles once
per manager: new_step, save's state segment projected on the manager's roles
and effects (the controller runs its own projection first, in the same lock
hold), abandon_save's manager segments, materialize, discard and shutdown's
state segment. ``_run_op`` runs segment by segment under each one's lock; a
``state`` segment first raises the shutdown error once shutdown began.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import OmniPrefixCacheShutdownError, ReqId, StageCacheOutputs, StepId, Tid
from omni_prefix_cache.reads.hit_planner import HitJob, HitPlanner
from omni_prefix_cache.reads.materializer import Materializer
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.reads.tier_fill import Restore, TierDesk
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.requests.step_input import StepInput
from omni_prefix_cache.specs.compiled import CompiledMove
from omni_prefix_cache.specs.composition import CompiledOperation, OperationSpec, ProtocolSpec, compile_operation
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.specs.types.step_context import StepContextTrigger
from omni_prefix_cache.steps.step_context import StepContext, StepTable
from omni_prefix_cache.steps.step_layout import SchedSnapshot, StepLayout, StepOutputs
from omni_prefix_cache.steps.step_record import Hit
from omni_prefix_cache.steps.write_ledger import SaveProgress, WriteLedger
from omni_prefix_cache.telemetry.registry import dropped
from omni_prefix_cache.writes.operations import active_protocol
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool

__all__ = ["AbandonCall", "FacadeOps", "ManagerBinding", "NewStepCall", "SaveCall", "StepCall"]

logger = logging.getLogger(__name__)

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]

# The manager's roles and effects: the projections it compiles keep only these.
MANAGER_ROLES = frozenset({"step", "step_holder", "read", "slot"})
MANAGER_EFFECTS = frozenset(
    {
        "validate_events",
        "apply_events",
        "escalate_detached",
        "plan_hits",
        "replan_same_step_hits",
        "apply_tier",
        "join_for_tier",
        "fill_reused_blocks",
        "record_saved",
        "merge_outputs",
        "restore_step_input",
        "fail_stranded",
        "close_facade",
    }
)


@dataclass(eq=False, slots=True)
class NewStepCall:
    """Operation new_step's context: the step's input, what its events left
    (hit candidates, writes to escalate) and the hits it registered."""

    given: StepInput
    candidates: list[Hit] = field(default_factory=list)  # blocks validated
    escalate: list[Tid] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)  # the host tier's, for restore_tenancy

    def __repr__(self) -> str:
        return f"new_step_starts(sequence {self.given.sequence})"


@dataclass(eq=False, slots=True)
class SaveCall:
    """The manager's part of save's state segment: the step to issue and what tenancy and hits need."""

    ctx: StepContext
    split: StepOutputs
    slots: torch.Tensor
    immediate: list[Any]  # the step's JOIN_NEXT_STEP writes
    deferred_tids: list[Tid]
    hits: dict[ReqId, Hit]
    token_ranges: dict[ReqId, tuple[int, int]] | None
    jobs: list[HitJob] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"save_outputs(step {self.ctx.step_id})"


@dataclass(eq=False, slots=True)
class StepCall:
    """materialize, discard or shutdown: the step id asked for (None: every
    open step, shutdown), the steps the operation moved and, for shutdown,
    the pending hits it dropped."""

    call: str
    sid: StepId | None
    steps: list[StepContext] = field(default_factory=list)
    # Each step's consume move (None: the spec has none from its state).
    moves: list[CompiledMove | None] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    req_ids: Sequence[ReqId] = ()
    outputs: StageCacheOutputs | None = None

    def __repr__(self) -> str:
        return self.call


@dataclass(eq=False, slots=True)
class AbandonCall:
    """abandon_save's context: the failed save, its hits, the error and the
    snapshot to put back (None: it registered something, no retry)."""

    save: SaveProgress
    hits: dict[ReqId, Hit]
    error: BaseException
    retry: SchedSnapshot | None

    def __repr__(self) -> str:
        return f"save_outputs(step {self.save.sid}) abandoned"


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
    the model's binding."""

    def __init__(
        self,
        steps: StepTable,
        staging: StagingBufferPool,
        hits: HitPlanner,
        reads: HitReads,
        couplings: Mapping[str, Run],
    ) -> None:
        self._steps = steps
        self._staging = staging
        self._hits = hits
        self._reads = reads
        self._couplings = couplings  # slot couplings by name

    def try_move(self, role: str, trigger: TriggerName) -> Pred:
        steps, staging = self._steps, self._staging
        if role == "step" and trigger == "save":

            def attempt_save(call: SaveCall) -> bool:
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
        if role == "read" and trigger == "drop":
            hits, reads = self._hits, self._reads

            def attempt_drop(call: StepCall) -> bool:
                for ctx in call.steps:
                    drop_step_reads(ctx, reads)
                for hit in call.hits:
                    hits.drop(hit)
                return True

            return attempt_drop
        raise SpecError(f"protocol.yaml: the manager fires no {role}.{trigger} (roles {sorted(MANAGER_ROLES)})")

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
class FacadeOp:
    """A compiled manager operation (or part) with each segment's lock."""

    op: CompiledOperation
    locks: tuple[str, ...]


@dataclass(frozen=True, eq=False, slots=True)
class ManagerOps:
    new_step: FacadeOp
    save: FacadeOp
    abandon_save: FacadeOp
    materialize: FacadeOp
    discard: FacadeOp
    shutdown: FacadeOp


def _part(spec: ProtocolSpec, name: str, lock: str | None = None) -> OperationSpec:
    """Operation ``name`` (its first ``lock`` segment alone when given),
    projected on the manager's roles and effects."""
    op = spec.ops[name]
    if lock is not None:
        index = next(i for i, seg in enumerate(op.segments) if seg.lock == lock and not seg.wait)
        op = op.segment(index, f"{name} ({lock} segment)")
    roles = MANAGER_ROLES - {"read"} if name == "new_step" else MANAGER_ROLES  # new_step's reads: HitReads
    return op.projected(roles, MANAGER_EFFECTS, name=op.name)


class FacadeOps:
    """The manager's compiled operations and their effect and guard handlers
    (a mixin of ``OmniPrefixCacheManager``: the handlers are its own)."""

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

    def _compile_facade_ops(self) -> ManagerOps:
        """Compile, once per manager, every manager operation of the active
        composition (``writes.operations.use_protocol`` swaps it in tests)."""
        spec = active_protocol()
        tier = self._tier_desk
        couplings = {"take_tenancy": self._couple_take_tenancy, "restore_tenancy": lambda c: tier.restore(c.restores)}
        binding = ManagerBinding(self._steps, self._controller.parts.staging_pool, self._hits, self._reads, couplings)
        effects: dict[str, Run] = {
            "validate_events": lambda call: self._requests.validate(call.given.events),
            "apply_events": self._apply_events,
            "escalate_detached": self._escalate_detached,
            "plan_hits": self._plan_hits,
            "replan_same_step_hits": self._replan_same_step_hits,
            "apply_tier": lambda c: setattr(c, "restores", tier.apply(c.given.tier, c.candidates, c.given.events)),
            "join_for_tier": lambda c: tier.join_for_loads(c.given.tier, self._ledger.previous_step_writes, c.escalate),
            "fill_reused_blocks": lambda c: tier.fill_reused(c.slots),
            "record_saved": self._record_saved,
            "merge_outputs": self._merge_outputs,
            "restore_step_input": self._restore_step_input,
            "fail_stranded": self._fail_stranded,
            "close_facade": self._close_facade,
        }
        guards: dict[str, Pred] = {"replayed_step": lambda call: self._requests.replayed(call.given.sequence)}
        guards["tier_loads"] = lambda call: call.given.tier is not None and bool(call.given.tier.loads)
        guards["tier_joins"] = lambda call: guards["tier_loads"](call) or (tier.active and bool(call.escalate))

        def make(op: OperationSpec) -> FacadeOp:
            return FacadeOp(compile_operation(op, binding, effects, guards), tuple(s.lock for s in op.segments))

        return ManagerOps(
            new_step=make(_part(spec, "new_step")),
            save=make(_part(spec, "save", lock="state")),
            abandon_save=make(_part(spec, "abandon_save")),
            materialize=make(_part(spec, "materialize")),
            discard=make(_part(spec, "discard")),
            shutdown=make(_part(spec, "shutdown", lock="state")),
        )

    def _run_op(self, op: FacadeOp, call: Any, name: str, *, start: int = 0, until: int | None = None) -> None:
        """Segments ``[start, until)`` of ``op`` for ``call``, each under its
        lock; a state segment first raises the shutdown error naming
        ``name`` once shutdown began."""
        stop = len(op.locks) if until is None else until
        segments, locks = op.op.segments, op.locks
        for index in range(start, stop):
            if locks[index] == "state":
                with self._state_lock:
                    if self._closed:
                        raise OmniPrefixCacheShutdownError(f"{name}: omni prefix cache manager is shut down")
                    segments[index](call)
            else:
                segments[index](call)

    # ------------------------------------------------------------ new_step

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
        self._pending_sched = SchedSnapshot(given.num_scheduled)
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

    def _couple_take_tenancy(self, call: SaveCall) -> None:
        """Coupling ``slot.take_tenancy``: the step becomes its slots' tenant (reads lock too)."""
        ctx = call.ctx
        with self._reads.lock:
            self._ledger.take_tenancy_locked(
                call.split, call.slots, ctx.record.scheduled_counts(), call.immediate, call.deferred_tids
            )

    def _replan_same_step_hits(self, call: SaveCall) -> None:
        """Effect ``replan_same_step_hits``: hits on slots this step maps are
        planned again, with every other hit's reads not planned yet, at save."""
        self._hits.replan_same_step_hits(call.hits, call.slots)
        call.jobs = self._hits.attach_to_step(call.hits, call.ctx)

    def _record_saved(self, call: SaveCall) -> None:
        split = call.split
        self._requests.record_saved(call.ctx, call.token_ranges, bool(split.immediate or split.deferred_clone))

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
        if self._closed:
            raise OmniPrefixCacheShutdownError(f"{call.call}: omni prefix cache manager is shut down")
        self._ledger.raise_if_failed()
        call.outputs = self._materializer.build(ctx, call.req_ids)

    # ------------------------------------------------------------ shutdown

    def _close_facade(self, call: StepCall) -> None:
        """Effect ``close_facade`` (state lock): closed; the pending hits are
        the call's to drop; the prefetch thread stops (wait=False: nothing
        waits under the lock), cancelling what has not started."""
        self._closed = True
        self._pending_sched = None
        call.hits = list(self._hits.take_all().values())
        self._hits.prefetch.shutdown(wait=False, cancel_futures=True)
