"""The manager facade: request and step identity, and the step protocol.

The engine calls, on its own thread, once per scheduler step::

    new_step_starts(step)   # adapter events (or a seed-era scheduler output), before finished requests are dropped
    sid = save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=p, write_layout=layout)
    materialize(sid, req_ids) | discard_step(sid)    # exactly once, any thread
    delivery_view / ack_delivery / commit_output     # per consumer, any thread

The controller runs the writes (staging, budget, committer); this class owns
the locks and the step ids and delegates to one component per concern:
``requests`` (tenures, lifecycle events, delivery), ``validation``,
``step_layout.StepLayout`` (spans, routing), ``step_context.StepTable``
(open steps), ``write_ledger.WriteLedger`` (writes per request, the save
barrier, tenancy, the sticky failure), ``hit_planner.HitPlanner`` and
``planned_read.HitReads`` (hits, planned reads, copy on write) and
``materializer.Materializer``.

Their tables live under ``_state_lock``. It never covers a join, a budget
flush, a copy of step rows, an eager dispatch or a staging claim: each of
those can wait on another thread that may itself need the lock. A second,
leaf lock, the reads lock (``HitReads.lock``), covers pending hit reads and
the slot versions a delayed read is checked against; writers take it inside
``_state_lock``, the prefetch thread takes only it, so a prefetch never
stalls the engine behind a gather. The committer thread only ever tries
``_state_lock``, after a pass that wrote, to drain what it wrote.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from omni_prefix_cache.adapter import PrefixCacheRequestEvent, PrefixCacheStep, PrefixCacheWriteLayout
from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.compat.manager_seams import ManagerSeams
from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.device import sync
from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.engine_types import GroupViewLike, SchedulerOutputLike
from omni_prefix_cache.interface import (
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    Tid,
)
from omni_prefix_cache.kv_layout_gate import check_view_group
from omni_prefix_cache.manager_calls import AbandonCall, NewStepCall, SaveCall, StepCall
from omni_prefix_cache.manager_ops import FacadeOps
from omni_prefix_cache.ops.components import ManagerComponents  # re-exported (__all__)
from omni_prefix_cache.ops.manager_stats import ManagerStats
from omni_prefix_cache.ops.trace_session import open_trace
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.materializer import Materializer
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.reads.tier_fill import TierDesk, TierFill
from omni_prefix_cache.requests.delivery import DeliveryDesk
from omni_prefix_cache.requests.facade import DeliveryFacade
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.requests.step_input import events_step, is_event_form, seed_step
from omni_prefix_cache.steps import validation as check
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import StepTable
from omni_prefix_cache.steps.step_layout import SchedSnapshot, StepLayout
from omni_prefix_cache.steps.step_layout import is_step_token_tensor as _is_step_token_tensor
from omni_prefix_cache.steps.step_layout import snapshot_leftover_mm_cpu as _snapshot_leftover_mm_cpu
from omni_prefix_cache.steps.write_layout import layout_token_ranges
from omni_prefix_cache.steps.write_ledger import SaveProgress, WriteLedger
from omni_prefix_cache.telemetry.locks import timed_lock
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.tier.metadata import TierStepMetadata

__all__ = [
    "PREFETCH_THREAD_PREFIX",
    "ManagerComponents",
    "OmniPrefixCacheManager",
    "_is_step_token_tensor",  # seed-suite imports, now in step_layout
    "_snapshot_leftover_mm_cpu",
]

logger = logging.getLogger(__name__)

PREFETCH_THREAD_PREFIX = "omni-prefix-cache-prefetch"


class OmniPrefixCacheManager(ManagerStats, DeliveryFacade, FacadeOps, ManagerSeams):
    """Full-prompt hidden states and token-major mm outputs for one stage.

    ``view``: the group view (``GroupViewLike``) save_outputs reads spans and
    slots from when it is given no ``write_layout`` (the seed-era form);
    engine thread only. Its ``block_size`` and ``group_index`` (when it
    declares one) must be the config's (raises otherwise). The event API (``PrefixCacheSchedulerAdapter``)
    needs none. ``eager``: None picks eager on machines without CUDA; False
    runs the threaded committer. ``committer``: "thread" in production;
    "manual" and "on_demand" let a test step the committer itself.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        view: GroupViewLike | None = None,
        *,
        eager: bool | None = None,
        committer: Literal["thread", "manual", "on_demand"] = "thread",
        engine: CopyEngine | None = None,
    ) -> None:
        view_bs = getattr(view, "block_size", None)
        if view_bs is not None and int(view_bs) != int(config.block_size):
            raise OmniPrefixCacheUnmatchError(
                f"group view block_size {view_bs} does not match PrefixCacheConfig.block_size {config.block_size}"
            )
        check_view_group(view, config.kv_cache_group_index)
        self._group_index = int(config.kv_cache_group_index)
        self._view = view
        # Process-wide (the compiled machines are): see telemetry.registry.
        if config.metrics:
            TELEMETRY.enable()
        open_trace(self, config)  # opt-in (docs/trace.md): before the controller compiles its operations
        self._pool = PrefixBlockPool(config)
        # ``engine``: where rows leave the device (default: CUDA lanes when
        # CUDA exists and eager is off, else host copies; a fake injects faults).
        self._controller = OmniPrefixCacheController(
            self._pool, config, eager=eager, committer=committer, engine=engine, after_write=self._drain_off_engine
        )
        self._policy = ModelCachePolicy()
        self._state_lock = timed_lock(sync.Lock(), "state_lock")
        self._live: set[ReqId] = set()
        self._pending_sched: SchedSnapshot | None = None
        # Operator counters (state lock); see stats().
        self._counters: Counter[str] = Counter()
        self._steps = StepTable(self._counters)
        self._step_ctxs = self._steps.open
        self._finish_escalations: tuple[StepId, list[Tid]] = (-1, [])  # (next step id, tids): see _escalate_detached
        self._closed = False
        # The components (module docstring), each handed the write parts it uses; hooks once both exist.
        occ = self._slot_status = SlotOccupancy(self._pool.num_slots)
        ctrl, writes, lock = self._controller, self._controller.parts, self._state_lock
        self._layout = StepLayout(config, view, self._pool, writes.host_rows.engine, writes.staging_pool)
        self._ledger = WriteLedger(ctrl, writes.registry, writes.budget, occ, lock, self._live, self._counters)
        self._reads = HitReads(self._pool, ctrl, writes.registry, writes.host_rows, occ, sync.Lock())  # leaf lock
        self._slot_status.on_takeover = self._ledger.on_takeover
        self._slot_status.on_reuse = self._reads.registry.preserve
        self._hits = HitPlanner(
            config,
            self._slot_status,
            self._reads,
            sync.Executor(max_workers=2, thread_name_prefix=PREFETCH_THREAD_PREFIX),
            self._layout.known,
            policy=lambda: self._policy,
            is_closed=lambda: self._closed,
        )
        self._tier_desk = TierDesk(
            TierFill(self._pool, self._slot_status, self._reads, self._hits.prefetch, self._hits.block_slots),
            block_size=config.block_size,
            group_index=config.kv_cache_group_index,
            max_bytes=config.host_tier_bytes,
            fill_timeout_s=config.staging_claim_timeout_s,
            commit_drained=self._ledger.commit_drained_locked,
            join=self._controller.join,
        )
        self._materializer = Materializer(self._ledger, self._reads, self._state_lock)
        self._requests = RequestTable(self._detach_request_locked, self._hits.hit_blocks, self._live)
        self._delivery = DeliveryDesk(self._requests, self._state_lock, self._check_open)
        # The manager's share of spec/protocol.yaml, compiled once, and the runner of its segments (manager_ops).
        self._ops, self._runner = self._compile_facade_ops()

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy (hidden or not, deferred mm keys).
        Engine thread, before or between steps; takes the state lock."""
        self._check_open("register_policy")
        if not isinstance(policy, ModelCachePolicy):
            raise OmniPrefixCacheInvalidTypeError(
                f"register_policy needs a ModelCachePolicy, got {type(policy).__name__}"
            )
        with self._state_lock:
            self._policy = policy

    def new_step_starts(
        self,
        step: PrefixCacheStep | Iterable[PrefixCacheRequestEvent] | SchedulerOutputLike,
        *,
        num_scheduled_tokens: Mapping[ReqId, int] | None = None,
        kv_tier: TierStepMetadata | None = None,
        num_draft_tokens: Mapping[ReqId, int] | None = None,
    ) -> None:
        """Start one scheduler step (engine thread, once per real step,
        before finished requests are dropped; operation new_step).

        ``step``: a ``PrefixCacheStep`` from the adapter, an iterable of
        ``PrefixCacheRequestEvent`` (with ``num_scheduled_tokens``), or a
        seed-era scheduler output (``requests.step_input``). Applies the
        lifecycle events (a replayed step sequence applies nothing), escalates
        the writes of finished, aborted and retired tenures, registers the
        hits the events installed (a RESUMED hit recovers from the slowest
        consumer's watermark) and starts gathering them on the prefetch thread.
        ``kv_tier`` (else the step's own ``tier`` or ``kv_connector_metadata``):
        the host tier's metadata; blocks a KV connector loaded get their rows
        back before the hits are read (docs/integration.md).
        ``num_draft_tokens`` (else the step's own ``draft_tokens``): the
        speculative drafts per request, its last scheduled tokens; its save
        needs a write layout and its materialize the accepted rows.

        Validate, then mutate: a bad argument (a bad id or count, a hit not
        block aligned or without block ids of the keyed KV cache group, an
        owner change without STARTED or REPLACED) raises OmniPrefixCacheInvalidArgumentError before
        anything changes; a sticky failure, the write-failed error; after
        shutdown, the shutdown error. Takes the state lock twice; escalation
        (eager writes run inline) happens between, outside it."""
        self._check_open("new_step_starts")
        self._ledger.raise_if_failed()
        if is_event_form(step):
            given = events_step(step, num_scheduled_tokens, kv_tier, num_draft_tokens)  # type: ignore[arg-type]
        else:
            # ``_live`` and the tenures' positions change only on this (the engine) thread: read unlocked.
            given = seed_step(step, self._live, self._requests.reached)
        call, run, new_step = NewStepCall(given), self._runner.run, self._ops.new_step
        run(new_step, "events", call)  # state: apply the lifecycle events
        run(new_step, "escalate", call)  # no lock: escalate what they detached (eager writes run inline)
        run(new_step, "hits", call)  # state: the host tier, then plan and start the hits' reads
        self._controller.kick()  # the committer runs the queued writes while the forward does

    def _detach_request_locked(self, rid: ReqId) -> list[Tid]:  # the request table's detach (state lock)
        self._hits.drop_request(rid)
        return self._ledger.finish_request_locked(rid)

    def save_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        write_layout: PrefixCacheWriteLayout | None = None,
    ) -> StepId:
        """Save one forward's outputs; returns the step id to materialize or
        discard exactly once. Engine thread.

        ``write_layout`` (the adapter's ``build_write_layout``) gives the
        rows' requests, token positions and slots; without it they come from
        the group view (the seed-era form) and positions continue each
        tenure's ``computed_upto``. Either way the rows advance their
        tenure's watermarks (effect ``record_saved``).

        Joins the previous step's JOIN_NEXT_STEP writes, claims a staging
        page and copies the immediate rows into it, reserves the deferred
        clone's budget, then (under the state lock) registers this step's
        writes, maps their slots and plans same-step hits; the eager writes
        run after the lock is released.

        Validate, then mutate: bad input (no new_step_starts, a non-int or
        negative token count, a tensor of the wrong type, shape, dtype or
        device, a slot mapping that does not cover the step, too few hidden
        rows, an oversized step, a key changing dtype/width) raises
        OmniPrefixCacheInvalidArgumentError before the step's scheduler
        snapshot and hits are taken, so a corrected call may follow. Later
        failures raise the write-failed error (sticky), a join timeout, or
        the staging timeout error naming the unconsumed steps; no staging
        holder or budget is left behind by a failed save.
        """
        self._check_open("save_outputs")
        self._ledger.raise_if_failed()
        call = self._route_save(hidden, mm, num_tokens_unpadded, num_tokens_padded, write_layout)
        run, save = self._runner.run, self._ops.save
        run(save, "take", call)  # state: the step's snapshot and hits, its step id
        try:
            call.snapshot, call.mm_event = self._layout.leftover_snapshot(call.split, call.n)
            run(save, "barrier", call)  # the previous step's immediate writes are in the pool
            run(save, "claim_page", call)  # a staging page, the immediate rows copied into it
            self._ledger.reserve_budget(call.split, call.progress.reserved)  # budget: the controller's share
            call.new_slabs = self._layout.new_slabs(call.split)  # paid here, published under the lock
            with self._runner.held(save, "register", call) as register:  # state
                self._register_writes_locked(call)  # the writes, per task
                register(call)  # issue the step, take the slots' tenancy, plan and start the hits
                self._ledger.previous_step_writes = [t.tid for t in call.immediate]
                counters = self._counters  # item increments: Counter.update with keywords is a Python loop
                counters["steps_saved"] += 1
                counters["tokens_saved"] += call.n
                call.progress.published = True
            # A clone no task views (a step without scheduled requests) is
            # uncharged now; a pinned ticket refunds nothing here.
            self._ledger.refund_unpinned(call.progress.reserved)
            self._controller.dispatch(call.immediate)  # dispatch: queue, or (eager) copy + pool write inline
        except BaseException as exc:
            error = self._ledger.save_error(call.progress, exc)
            self._abandon_save(call, error)
            if error is exc:
                raise
            raise error from exc
        if call.jobs:  # state: the prefetches of the hits it planned (none after a shutdown); no lock for none
            run(save, "start_reads", call)
        return call.sid

    def _route_save(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        write_layout: PrefixCacheWriteLayout | None,
    ) -> SaveCall:
        """Validate and route one save (engine thread, no lock): nothing is
        taken yet, so a refused call may be corrected and retried."""
        n = check.as_count("save_outputs: num_tokens_unpadded", num_tokens_unpadded)
        padded = check.as_count("save_outputs: num_tokens_padded", num_tokens_padded)
        # Engine thread only: nothing else takes a snapshot or a step id (take checks both again).
        pending, sid = self._pending_sched, self._steps.next_id
        if pending is None:
            raise OmniPrefixCacheUnmatchError(f"save_outputs (step {sid}) without a new_step_starts before it")
        check.drafts_need_layout(sid, pending.drafts, write_layout)
        sched = (
            pending
            if write_layout is None
            else SchedSnapshot(pending.num_scheduled, write_layout, drafts=pending.drafts)
        )
        if padded < n:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): num_tokens_padded={padded} < num_tokens_unpadded={n}"
            )
        req_order, spans, slots, split = self._layout.route_step(sid, sched, self._policy, hidden, mm, n, padded)
        token_ranges = None if write_layout is None else layout_token_ranges(write_layout)
        return SaveCall(SaveProgress(sid), n, pending, sched, req_order, spans, slots, split, token_ranges)

    def _drain_off_engine(self) -> None:
        """The committer thread, after a pass that wrote (no lock held):
        operation drain if the state lock is free, so the engine thread's
        next entry finds nothing to settle. Only a try: the committer's
        next claim never waits behind a facade's state segment."""
        lock = self._state_lock
        if not lock.acquire(False):
            return  # the engine thread's next facade entry drains
        try:
            # Writes come from saves, so the manager is whole by now.
            self._ledger.commit_drained_locked()
        finally:
            lock.release()

    def materialize(
        self, step_id: StepId, req_ids: Sequence[ReqId], *, accepted_rows: Mapping[ReqId, int] | None = None
    ) -> StageCacheOutputs:
        """Consume ``step_id`` and return each request's merged outputs:
        hit prefix rows (the prefetched buffer) followed by this step's rows
        for every pool key, plus each request's share of the leftover mm.

        ``accepted_rows`` (speculative decoding): per request,
        ``len(ModelRunnerOutput.sampled_token_ids[i])`` (``adapter.accepted_rows_of``),
        needed for every request the step scheduled drafts for: its rows
        end at its accepted end and its rejected drafts' slots are REJECTED.

        Any thread, exactly once per step id (or discard_step instead). The
        step's staging holder is released whatever happens. Raises
        OmniPrefixCacheUnmatchError for an unknown or consumed step id, ids
        outside the save snapshot, a sticky write failure, or a hit that
        cannot be served (absent hidden rows, a rejected draft's row, an
        overwritten delayed read, a failed pool read). Without consuming the
        step: the invalid-type error for a step id, ``req_ids`` or
        ``accepted_rows`` of the wrong type, ``OmniPrefixCacheAcceptedRowsError``
        for accepted rows that do not fit it (naming the requests); after
        shutdown, the shutdown error.
        """
        check.as_step_id("materialize", step_id)
        req_ids = check.as_req_ids(f"materialize(step {step_id}): req_ids", req_ids)
        name = f"materialize(step {step_id})"
        accepted = check.as_accepted_rows(name, accepted_rows)
        self._check_open(name)
        call = StepCall(name, step_id, req_ids=req_ids, accepted=accepted)
        run, materialize = self._runner.run, self._ops.materialize
        with self._runner.held(materialize, "consume", call) as consume:  # state
            consume(call)  # refuse counts that do not fit, consume, reject the rejected rows' slots
            self._requests.drafts.accept_rows("materialize", call.steps, accepted)  # request.accept?
        try:
            run(materialize, "merge", call)  # no lock: hit prefixes + the step's rows from its page
        finally:
            run(materialize, "release", call)  # the page, and the reads nobody fetched, whatever the merge raised
        assert call.outputs is not None
        return call.outputs

    def discard_step(self, step_id: StepId, *, accepted_rows: Mapping[ReqId, int] | None = None) -> None:
        """Consume ``step_id`` without building outputs (any thread, exactly
        once). Releases its staging holder and drops its hit prefetches.
        Works after a write failure. Raises for an unknown or consumed id,
        and after shutdown (which already released every open step).

        With ``accepted_rows`` (a step with speculative drafts), as
        materialize: its rejected drafts' slots are REJECTED and its accepted
        rows count; without, its drafts never count. Accepted rows that do
        not fit raise ``OmniPrefixCacheAcceptedRowsError``, consuming nothing."""
        check.as_step_id("discard_step", step_id)
        name = f"discard_step(step {step_id})"
        accepted = check.as_accepted_rows(name, accepted_rows)
        self._check_open(name)
        call = StepCall(name, step_id, accepted=accepted, discarding=True)
        # Operation discard: consume, release the page, drop the reads, reject the drafts (one state segment).
        with self._runner.held(self._ops.discard, "consume", call) as consume:
            consume(call)
            self._requests.drafts.accept_rows("discard", call.steps, accepted)

    def shutdown(self) -> None:
        """Stop the prefetch thread and the controller (queued writes land
        first; unfinished ones fail). Steps not yet consumed are released
        and their hit reads dropped. Later facade calls (stats aside) raise
        the shutdown error; a materialize racing shutdown returns exact rows
        or raises it. Idempotent."""
        try:
            # close (state): closed, every open step discarded and its page
            # released, every pending read dropped.
            self._runner.run(self._ops.shutdown, "close", StepCall("shutdown", None))
        except OmniPrefixCacheShutdownError:
            return  # an earlier shutdown closed it
        self._controller.shutdown()  # close_staging, drain: the controller's share

    # ============================================================ helpers

    def _abandon_save(self, call: SaveCall, error: BaseException) -> None:
        """Undo a failed save (operation ``abandon_save``): no step context,
        no step holder, no budget no task pinned, no stranded write. A save
        that failed before registering anything (a staging timeout, a failed
        staging copy, a join) puts its scheduler snapshot and hits back, so
        the engine may call save_outputs again (under a new step id) and no
        row behind a published block hash is lost."""
        progress = call.progress
        undo = AbandonCall(progress, call.hits, error, None if call.registering else call.sched)
        # restore (state, also after shutdown), abandon the page, fail the stranded writes;
        # then cleanup's refund (the controller's share of the same segment).
        self._runner.run_all(self._ops.abandon_save, undo)
        self._ledger.refund_unpinned(progress.reserved)

    def _check_open(self, call: str) -> None:
        """Raise the shutdown error naming ``call`` once shutdown began. Read
        under the state lock by every segment that moves a step or a read."""
        if self._closed:
            raise OmniPrefixCacheShutdownError(f"{call}: omni prefix cache manager is shut down")
