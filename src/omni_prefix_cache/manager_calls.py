"""The contexts of the manager's operations (spec/protocol.yaml), each
filled segment by segment as its operation runs: ``NewStepCall``,
``SaveCall``, ``StepCall`` (materialize, discard, shutdown) and
``AbandonCall``. ``name`` is what an error raised in its segments names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import ReqId, StageCacheOutputs, StepId, Tid
from omni_prefix_cache.reads.hit_planner import HitJob
from omni_prefix_cache.reads.tier_fill import Restore
from omni_prefix_cache.requests.step_input import StepInput
from omni_prefix_cache.specs.compiled import CompiledMove
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_layout import SchedSnapshot, StepOutputs
from omni_prefix_cache.steps.step_record import Hit
from omni_prefix_cache.steps.write_ledger import SaveProgress
from omni_prefix_cache.writes.write_task import WriteTask

__all__ = ["AbandonCall", "NewStepCall", "SaveCall", "StepCall"]


@dataclass(eq=False, slots=True)
class NewStepCall:
    """Operation new_step's context: the step's input, what its events left
    (hit candidates, writes to escalate) and the hits it registered."""

    given: StepInput
    candidates: list[Hit] = field(default_factory=list)  # blocks validated
    escalate: list[Tid] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)  # the host tier's, for restore_tenancy

    name = "new_step_starts"

    def __repr__(self) -> str:
        return f"new_step_starts(sequence {self.given.sequence})"


@dataclass(eq=False, slots=True)
class SaveCall:
    """Operation save's context, filled segment by segment: the routed
    outputs (before ``take``), the step's input ``take`` took (its hits),
    the leftover snapshot, the page ``claim_page`` claimed and the budget
    reserved (``progress``, for an undo), then what ``register`` made: the
    step context, its writes and the prefetch jobs of its hits."""

    progress: SaveProgress
    n: int
    pending: SchedSnapshot  # new_step's snapshot, as read before routing (take checks it is still the one)
    sched: SchedSnapshot  # the snapshot the save routed with (its write layout, if given)
    req_order: list[ReqId]
    spans: dict[ReqId, tuple[int, int]]
    slots: torch.Tensor
    split: StepOutputs
    token_ranges: dict[ReqId, tuple[int, int]] | None
    hits: dict[ReqId, Hit] = field(default_factory=dict)
    snapshot: dict[str, Any] = field(default_factory=dict)
    mm_event: Any = None
    new_slabs: dict[str, torch.Tensor] = field(default_factory=dict)
    ctx: StepContext | None = None
    immediate: list[WriteTask] = field(default_factory=list)  # the step's JOIN_NEXT_STEP writes
    deferred_tids: list[Tid] = field(default_factory=list)
    jobs: list[HitJob] = field(default_factory=list)  # the prefetches start_reads starts
    registering: bool = False  # past this, a failed save cannot be retried
    sid: StepId = field(init=False)  # the step id it issues (``progress.sid``)

    def __post_init__(self) -> None:
        self.sid = self.progress.sid

    @property
    def name(self) -> str:
        return f"save_outputs (step {self.progress.sid})"

    def __repr__(self) -> str:
        return f"save_outputs(step {self.progress.sid})"


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
    # Speculative decoding: the accepted rows the call carries (None: none), and
    # whether it discards (then a drafted request needs none: its drafts are rejected).
    accepted: dict[ReqId, int] | None = None
    discarding: bool = False
    refusal: str = ""  # why guard accepted_rows_refused holds

    @property
    def name(self) -> str:
        return self.call

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

    @property
    def name(self) -> str:
        return f"save_outputs (step {self.save.sid})"

    def __repr__(self) -> str:
        return f"save_outputs(step {self.save.sid}) abandoned"
