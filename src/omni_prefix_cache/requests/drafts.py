"""Speculative decoding in the request layer: a step's accepted drafts count.

``DraftAccounting`` runs the requests executor's share of materialize's and
discard's consume segment (spec/protocol.yaml: ``request.accept?``, the
request_lifecycle ``accept`` move whose ``count_accepted`` effect advances a
tenure's watermarks to its step's accepted end), in the same state hold as
the manager's share. A save counts only the rows before a request's drafts
(``RequestTable.record_saved``).

Threading: under the manager's state lock (the caller holds it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omni_prefix_cache.interface import ReqId
from omni_prefix_cache.requests.tenure import LifecycleHost, TenureMove
from omni_prefix_cache.specs.composition import ProtocolSpec, compile_operation
from omni_prefix_cache.specs.runner import CALLER_HOLDS
from omni_prefix_cache.steps.step_context import StepContext

__all__ = ["DraftAccounting"]


class DraftAccounting:
    """The compiled ``request.accept?`` of materialize and discard, over the
    request binding ``binding`` of ``table`` (the tenures' lifecycle host)."""

    def __init__(self, protocol: ProtocolSpec, binding: Any, table: LifecycleHost) -> None:
        self._table = table
        self._ops = {
            name: compile_operation(protocol.share("requests", name, "consume"), binding, {}, {})
            for name in ("materialize", "discard")
        }

    def accept_rows(self, operation: str, steps: Sequence[StepContext], counts: Mapping[ReqId, int] | None) -> None:
        """The requests executor's share of materialize's (or discard's)
        consume segment, in the same state hold as the manager's:
        ``request.accept?`` for each drafted request of the consumed
        ``steps``, to its accepted end under ``counts`` (a discard without
        counts accepts nothing)."""
        if counts is None or not any(ctx.record.drafts for ctx in steps):
            return
        op = self._ops[operation]
        for ctx in steps:
            record = ctx.record
            for verdict in record.accepted(counts):
                if verdict.index < len(record.tenures):
                    move = TenureMove(record.tenures[verdict.index], self._table, end=verdict.accepted_end)
                    move.saves = record.saves
                    CALLER_HOLDS.run(op, "consume", move)
