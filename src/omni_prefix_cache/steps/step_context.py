"""Step contexts: what one save leaves for its materialize or discard.

The lifecycle is the ``step_context`` spec (spec/step_context.yaml):
``save`` issues the step id (UNSAVED -> SAVED); exactly one of
``materialize`` / ``discard`` consumes it (SAVED -> CONSUMED) and releases
the step's staging holder. Unknown ids read as UNSAVED, consumed (or
abandoned) ids as CONSUMED, so a second consume is an illegal move.
``StepTable`` holds one manager's open steps and runs those moves.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.device.copy_engine import DeviceEvent
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, StepId, TensorName
from omni_prefix_cache.specs import CompiledMove, SpecState, compile_machine, load_spec
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger
from omni_prefix_cache.specs.types.step_context import INITIAL, StepContextTrigger
from omni_prefix_cache.specs.types.step_context import StepState as StepState  # re-exported
from omni_prefix_cache.steps.step_record import StepRecord
from omni_prefix_cache.writes.staging import StagingBufferHolder, StagingBufferPool, StepD2HClaim


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
    staging: StagingBufferPool  # the pool of the step's page
    state: SpecState = INITIAL  # a StepState
    d2h: StepD2HClaim | None = None
    n: int = 0
    # The step's requests: rows, hits, token ranges, tenures (a struct of arrays).
    record: StepRecord = field(default_factory=lambda: StepRecord.of_rows([], {}))
    hidden_cached: bool = False
    immediate_keys: tuple[TensorName, ...] = ()  # rows in d2h.views
    deferred_keys: tuple[TensorName, ...] = ()  # rows in mm_cpu_snapshot
    layouts: dict[TensorName, KeyLayout] = field(default_factory=dict)
    mm_cpu_snapshot: dict[TensorName, Any] = field(default_factory=dict)
    mm_event: DeviceEvent | None = None  # completes the snapshot's device-to-host copies (None on CPU)

    @property
    def holder(self) -> StagingBufferHolder:
        return StagingBufferHolder.for_step(self.step_id)

    # Upstream's step-context tables, as its tests read them (compat; built on read).
    @property
    def hits(self) -> dict[ReqId, tuple[int, list[int]]]:
        """Each served hit as ``(cached rows, keyed-group block ids)``."""
        return {h.req_id: (h.num_computed, list(h.block_ids)) for h in self.record.hits if h is not None}

    @property
    def hit_prefetch(self) -> dict[ReqId, dict[TensorName, Future[torch.Tensor]]]:
        """Each served hit's prefetches, per key (the hit's own dict)."""
        return {h.req_id: h.futures for h in self.record.hits if h is not None}


def _release_step_holder(ctx: StepContext) -> None:
    if ctx.d2h is not None:
        ctx.staging.release(ctx.d2h.page, ctx.holder, StagingHolderTrigger.CONSUME)


STEP_MACHINE = compile_machine(
    load_spec("step_context"),
    effects={"release_step_holder": _release_step_holder},
    state_enum=StepState,
)


_MEANING = {st.name: st.meaning for st in STEP_MACHINE.spec.states}
# Where an id without a context is: never saved, or consumed already.
STEP_INITIAL = STEP_MACHINE.initial
(STEP_CONSUMED,) = STEP_MACHINE.final


def step_move(step_id: StepId, state: SpecState, trigger: StepContextTrigger) -> CompiledMove:
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


def _record(move: CompiledMove, ctx: StepContext) -> None:
    recorder = STEP_MACHINE.recorder
    if recorder is not None:
        recorder.moved(move, ctx)


# The operator counter of each consuming trigger.
_CONSUMED_COUNTERS = {
    StepContextTrigger.MATERIALIZE: "steps_materialized",
    StepContextTrigger.DISCARD: "steps_discarded",
}


class StepTable:
    """One manager's open steps (``open``: saved, not yet consumed) and the
    next step id to issue (``next_id``; ids count from 1, so an id below it
    without a context was consumed or its save abandoned).

    Every method runs under the manager's state lock; ``counters`` are the
    facade's operator counters (``steps_materialized``, ``steps_discarded``).
    """

    def __init__(self, counters: Counter[str]) -> None:
        self.open: dict[StepId, StepContext] = {}
        self.next_id: StepId = 1
        self._counters = counters

    def publish_locked(self, ctx: StepContext) -> None:
        """``save``: the step is SAVED and open until consumed."""
        move = step_move(ctx.step_id, STEP_INITIAL, StepContextTrigger.SAVE)
        ctx.state = move.dest
        self.open[ctx.step_id] = ctx
        _record(move, ctx)

    def consume_locked(self, step_id: StepId, trigger: StepContextTrigger) -> tuple[StepContext, CompiledMove]:
        """``materialize`` or ``discard``: pop the step's context, move it to
        CONSUMED and return it with the move (whose effects release its
        staging holder). Raises OmniPrefixCacheUnmatchError naming the step
        for an id never issued or already consumed."""
        ctx = self.open.get(step_id)
        if ctx is None:
            issued = isinstance(step_id, int) and 0 < step_id < self.next_id
            step_move(step_id, STEP_CONSUMED if issued else STEP_INITIAL, trigger)
            raise AssertionError("unreachable: step_move raises for a step without a context")
        move = step_move(step_id, ctx.state, trigger)
        del self.open[step_id]
        self._counters[_CONSUMED_COUNTERS[trigger]] += 1
        ctx.state = move.dest
        _record(move, ctx)
        return ctx, move

    def close_locked(self) -> list[StepContext]:
        """Every open step, no longer open (``discard_all_locked`` moves them)."""
        steps = list(self.open.values())
        self.open.clear()
        return steps

    def discard_all_locked(self) -> list[tuple[StepContext, CompiledMove | None]]:
        """Shutdown's ``step.discard?``: every open step leaves the table and
        moves to CONSUMED where the spec lets it (not counted as discarded by
        the engine); returned with its move (None where there is none), whose
        effects the caller runs (``step_holder.consume?``)."""
        out: list[tuple[StepContext, CompiledMove | None]] = []
        for ctx in self.close_locked():
            move = STEP_MACHINE.move(ctx.state, StepContextTrigger.DISCARD)
            if move is not None:
                ctx.state = move.dest
                _record(move, ctx)
            out.append((ctx, move))
        return out
