"""Speculative decoding's mutants (issue 47), registered into the mutant
catalogue by ``register`` (the catalogue passes its own
``_register`` and ``_set``, so this module imports nothing of it). Each one
re-injects a bug of accepted-rows handling; the generated protocol tests
kill each by the row oracle or invariant ``accepted_rows_only``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

Register = Callable[..., Callable[[Callable[[contextlib.ExitStack], None]], Callable[..., None]]]
SetAttr = Callable[[contextlib.ExitStack, Any, str, Any], None]


def register(register: Register, set_attr: SetAttr) -> None:
    """Register each mutant below with the catalogue."""

    @register(
        "rejected_draft_delivered",
        "materialize keeps the rows past a drafted request's accepted end: rejected drafts are returned and delivered",
    )
    def _rejected_draft_delivered(stack: contextlib.ExitStack) -> None:
        from omni_prefix_cache.manager_drafts import DraftOps

        set_attr(stack, DraftOps, "_cut_rejected", lambda self, call: None)

    @register(
        "draft_watermark_past_accepted",
        "record_saved counts a step's speculative drafts: a tenure's watermarks reach the draft end, past its "
        "accepted end",
    )
    def _draft_watermark_past_accepted(stack: contextlib.ExitStack) -> None:
        from omni_prefix_cache.requests.lifecycle import RequestTable

        original = RequestTable.record_saved

        def record_saved(self: RequestTable, ctx: Any, token_ranges: Any, cached: bool, starts: Any = None) -> None:
            drafts, ctx.record.drafts = ctx.record.drafts, {}  # the verified end is the token end again
            try:
                original(self, ctx, token_ranges, cached, starts)
            finally:
                ctx.record.drafts = drafts

        set_attr(stack, RequestTable, "record_saved", record_saved)

    @register(
        "draft_rollback_skipped_on_resume",
        "the slots of a step's rejected drafts are not rolled back (REJECTED): a request resumed with an optimistic "
        "hit over them is served the rejected rows",
    )
    def _draft_rollback_skipped_on_resume(stack: contextlib.ExitStack) -> None:
        from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy

        set_attr(stack, SlotOccupancy, "reject", lambda self, slots, tenancy: 0)
