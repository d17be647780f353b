"""The manager's speculative-decoding handlers (a mixin of ``FacadeOps``).

Save's ``record_saved`` keeps each drafted request's draft rows and their
slots with the step; materialize's (and discard's) consume segment refuses
accepted rows that do not fit the step (guard ``accepted_rows_refused``,
effect ``refuse_accepted_rows``) and moves the rejected rows' slots
(``slot.reject?``); its merge segment cuts each output at its accepted end
(``cut_rejected``). The tenures' accepted rows are the request layer's
(``requests.drafts``). Every handler runs where its segment's lock says.
"""

from __future__ import annotations

import torch

from omni_prefix_cache.interface import OmniPrefixCacheAcceptedRowsError, StepId
from omni_prefix_cache.manager_calls import SaveCall, StepCall
from omni_prefix_cache.reads.materializer import cut_rejected
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.requests.lifecycle import RequestTable
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import StepContext

__all__ = ["DraftOps"]


class DraftOps:
    """The handlers; ``OmniPrefixCacheManager`` provides the components."""

    _step_ctxs: dict[StepId, StepContext]
    _reads: HitReads
    _slot_status: SlotOccupancy
    _requests: RequestTable

    def _record_saved(self, call: SaveCall) -> None:
        """Effect ``record_saved`` (state lock): the tenures advance over each
        request's verified rows; a drafted request's draft rows and their
        slots are kept for its materialize (or discard)."""
        split = call.split
        assert call.ctx is not None
        record, drafts = call.ctx.record, call.sched.drafts
        if drafts:
            spans, slots = call.spans, call.slots
            for rid, count in drafts.items():
                span = spans.get(rid)
                if span is None:
                    continue  # not scheduled rows in this layout (new_step checked the counts)
                first, rows = span
                record.drafts[rid] = count
                record.draft_slots[rid] = slots[first + rows - count : first + rows]
        record.saves = bool(split.immediate or split.deferred_clone)
        self._requests.record_saved(call.ctx, call.token_ranges, record.saves, call.sched.starts)

    def _accepted_rows_refused(self, call: StepCall) -> bool:
        """Guard ``accepted_rows_refused`` (state lock): the call's accepted
        rows do not fit its step (an unknown step is the consume move's to
        refuse); the reason is kept for ``refuse_accepted_rows``."""
        ctx = self._step_ctxs.get(call.sid) if call.sid is not None else None
        if ctx is None or (call.accepted is None and (call.discarding or not ctx.record.drafts)):
            return False
        call.refusal = ctx.record.refused_counts(call.accepted, need_drafts=not call.discarding)
        return bool(call.refusal)

    def _refuse_accepted_rows(self, call: StepCall) -> None:
        """Effect ``refuse_accepted_rows``: nothing moved; the step stays saved."""
        raise OmniPrefixCacheAcceptedRowsError(f"{call.call}: accepted_rows do not fit the step: {call.refusal}")

    def _reject_rows(self, call: StepCall) -> None:
        """``slot.reject?`` (state lock; takes the reads lock, where version
        bumps and planned reads change together): the slots of each consumed
        step's rows past its requests' accepted ends, where its save was the
        last to map them."""
        if call.accepted is None:
            return  # a discard without accepted rows: nothing is known of its drafts (they never counted)
        for ctx in call.steps:
            record = ctx.record
            if not record.drafts:
                continue
            verdicts = record.accepted(call.accepted)
            slots = [v.rejected_slots for v in verdicts if int(v.rejected_slots.numel())]
            if slots:
                with self._reads.lock:
                    self._slot_status.reject(slots[0] if len(slots) == 1 else torch.cat(slots), record.tenancy)

    def _cut_rejected(self, call: StepCall) -> None:
        """Effect ``cut_rejected`` (no lock): each drafted request's output
        ends at its accepted end."""
        (ctx,) = call.steps
        if ctx.record.drafts and call.outputs is not None:
            cut_rejected(call.outputs, ctx.record.accepted(call.accepted))
