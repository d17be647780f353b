"""The protocol tests' speculative-decoding drivers, a mixin of ``ProtocolMachine``.

A drafted request's step (``ServingModel.schedule``'s ``drafts``) is
materialized with the runner's accepted rows; this driver covers the
rollback skipped on resume (``drive_optimistic_resume``: a runner whose
optimistic count claims positions past the accepted end; the manager must
refuse the hit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import event
from hypothesis import strategies as st

from omni_prefix_cache.adapter import PrefixCacheSchedulerAdapter, PrefixCacheStep
from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.protocol_tests.lifecycle import EventEngine, OracleTenure, TenureOracle
from omni_prefix_cache.testing.protocol_tests.workload import BLOCK_SIZE, LEFTOVER, WIDTHS, leftover_rows
from omni_prefix_cache.testing.serving_model import ServingModel


class DraftDrivers:
    """Speculative-decoding drivers over ``ProtocolMachine``'s runtime."""

    mgr: OmniPrefixCacheManager
    model: ServingModel
    engine: EventEngine
    oracle: TenureOracle
    adapter: PrefixCacheSchedulerAdapter
    dead: bool
    violations: dict[str, list[str]]
    previous_immediate: list[int]
    step_tenures: dict[int, dict[str, OracleTenure]]
    drafted: dict[str, tuple[int, int, int, list[int]]]
    last_sched: dict[str, int]
    _facade: Callable[..., Any]
    announce: Callable[[PrefixCacheStep], dict[str, int]]

    def optimistic_candidates(self) -> list[tuple[str, int, int]]:
        """``(rid, accepted end, hit end)`` of each running request whose
        last step rejected drafts that a block boundary cuts, untouched
        since (its blocks held, no later step computed past its accepted
        end): a hit up to that boundary would cover rejected rows."""
        out = []
        for rid, (sid, verified, draft_end, blocks) in sorted(self.drafted.items()):
            req = self.model.requests.get(rid)
            if req is None or not req.running or req.blocks[: len(blocks)] != blocks or self.last_sched.get(rid) != sid:
                continue
            hit = draft_end // BLOCK_SIZE * BLOCK_SIZE
            if verified <= req.computed < hit and req.computed == len(req.tokens) - 1:
                out.append((rid, req.computed, hit))
        return out

    def drive_optimistic_resume(self, data: Any) -> None:
        """The rollback skipped on resume: a runner whose computed count
        skipped vLLM's rollback of rejected drafts (an optimistic count, as
        async scheduling keeps one) resumes a request with a hit over the
        block holding its rejected drafts' rows, and schedules the position
        after it (its row lands in a spare block). The manager must refuse
        the hit (those slots are REJECTED), never serve the rejected rows.
        The request then goes on from its real accepted end."""
        rid, accepted_end, hit = data.draw(st.sampled_from(self.optimistic_candidates()), label="optimistic resume")
        fresh = self.model.alloc.allocate(1)
        if fresh is None:
            return
        blocks = self.drafted[rid][3][: hit // BLOCK_SIZE] + fresh
        hostile = rid
        step = self.engine.optimistic_resume(rid, hit, blocks[: hit // BLOCK_SIZE], 1)
        self.announce(step)
        if self.dead:
            self.model.alloc.free(fresh)
            return
        self.model.view.set_step([hostile], {hostile: blocks}, {hostile: hit})
        layout = self.adapter.build_write_layout(self.model.view, num_scheduled_tokens={hostile: 1})
        mm = {key: torch.zeros((1, WIDTHS[key])) for key in WIDTHS if key != HIDDEN_KEY}
        mm[LEFTOVER] = leftover_rows(1)
        sid = self._facade(
            lambda: self.mgr.save_outputs(
                torch.zeros((1, WIDTHS[HIDDEN_KEY])),
                mm,
                num_tokens_unpadded=1,
                num_tokens_padded=1,
                write_layout=layout,
            )
        )
        if sid is not None:
            self.previous_immediate = list(self.mgr.components.ledger.previous_step_writes)
            tenure = self.oracle.current.get(hostile)
            if tenure is not None:
                tenure.saved = max(tenure.saved, hit + 1)  # the oracle's record_saved: its one row
            try:
                outs = self._facade(lambda: self.mgr.materialize(sid, [hostile]))
            except OmniPrefixCacheUnmatchError as exc:
                assert "rejected speculative drafts" in str(exc), exc
                event("an optimistic resume over rejected drafts' rows was refused")
            else:
                if outs is not None:
                    self.violations["accepted_rows_only"].append(
                        f"step {sid}: {rid} resumed with a hit up to {hit} over its rejected drafts (accepted end "
                        f"{accepted_end}) and was served them instead of refused"
                    )
        self.model.alloc.free(fresh)
        self.drafted.pop(rid, None)
