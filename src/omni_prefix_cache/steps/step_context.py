"""Step contexts: what one save leaves for its materialize or discard.

The lifecycle is the ``step_context`` spec (spec/step_context.yaml):
``save`` issues the step id (UNSAVED -> SAVED); exactly one of
``materialize`` / ``discard`` consumes it (SAVED -> CONSUMED) and releases
the step's staging holder. Unknown ids read as UNSAVED, consumed (or
abandoned) ids as CONSUMED, so a second consume is an illegal move.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, StepId, TensorName
from omni_prefix_cache.specs import CompiledMove, compile_machine, load_spec
from omni_prefix_cache.specs.types.step_context import StepState as StepState  # re-exported
from omni_prefix_cache.writes.staging import StagingBufferHolder, StepD2HClaim


@dataclass(frozen=True)
class KeyLayout:
    """How one pool key's rows look: dtype, flattened width, and the
    per-token shape the caller gave (restored on the way out)."""

    dtype: torch.dtype
    width: int
    trailing: tuple[int, ...]


@dataclass(eq=False)
class StepContext:
    """Everything materialize needs from one save, snapshotted at save so a
    materialize on another thread never reads the engine's live buffers or
    its group view."""

    step_id: StepId
    controller: Any  # the OmniPrefixCacheController that holds the staging page
    state: Any = None  # StepState
    d2h: StepD2HClaim | None = None
    n: int = 0
    # req -> (first row in the step, rows this step), for every saved request.
    spans: dict[ReqId, tuple[int, int]] = field(default_factory=dict)
    order: list[ReqId] = field(default_factory=list)  # scheduled requests, in row order
    sizes: list[int] = field(default_factory=list)  # their row counts (sum: n)
    hidden_cached: bool = False
    immediate_keys: tuple[TensorName, ...] = ()  # rows in d2h.views
    deferred_keys: tuple[TensorName, ...] = ()  # rows in mm_cpu_snapshot
    layouts: dict[TensorName, KeyLayout] = field(default_factory=dict)
    mm_cpu_snapshot: dict[TensorName, Any] = field(default_factory=dict)
    mm_event: Any = None  # completes the snapshot's device-to-host copies (None on CPU)
    # req -> (num_computed_tokens, group-0 block ids of the hit prefix)
    hits: dict[ReqId, tuple[int, list[int]]] = field(default_factory=dict)
    # req -> key -> Future of the [prefix | empty tail] buffer
    hit_prefetch: dict[ReqId, dict[TensorName, Future[torch.Tensor]]] = field(default_factory=dict)
    # req -> key -> the planned read behind each future (cleanup of cancelled ones)
    hit_refs: dict[ReqId, dict[TensorName, Any]] = field(default_factory=dict)

    @property
    def holder(self) -> StagingBufferHolder:
        return StagingBufferHolder.for_step(self.step_id)


def _release_step_holder(ctx: StepContext) -> None:
    if ctx.d2h is not None:
        ctx.controller.staging_release(ctx.d2h.staging_slot, ctx.holder, trigger="consume")


STEP_MACHINE = compile_machine(
    load_spec("step_context"),
    effects={"release_step_holder": _release_step_holder},
    state_enum=StepState,
)


_MEANING = {st.name: st.meaning for st in STEP_MACHINE.spec.states}
# Where an id without a context is: never saved, or consumed already.
STEP_INITIAL = STEP_MACHINE.initial
(STEP_CONSUMED,) = STEP_MACHINE.final


def step_move(step_id: StepId, state: Any, trigger: str) -> CompiledMove:
    """The spec's move for ``trigger`` from ``state``; raises
    OmniPrefixCacheUnmatchError naming the step and its state when there is
    none (unknown id, or a second consume)."""
    move = STEP_MACHINE.move(state, trigger)
    if move is None:
        why = _MEANING[StepState(state).name]
        raise OmniPrefixCacheUnmatchError(
            f"{trigger}(step {step_id}): illegal from {StepState(state).name} ({why}); "
            "every step id is consumed exactly once by materialize or discard_step"
        )
    return move
