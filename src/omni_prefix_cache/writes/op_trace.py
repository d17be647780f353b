"""The controller's operations, compiled for an open trace (docs/trace.md).

``compile_controller_ops`` is ``operations.compile_ops`` when no trace is
open: the off path runs the same closures as before. With a trace open
(``TELEMETRY.trace``), every effect handler records itself before it runs
and every compiled segment records its begin and end, with the operation's
name in the spec and the segment's index there (a part such as ``save``'s
``state`` segment keeps the index it has in ``save``), so the moves its
machines record between them are attributed to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from omni_prefix_cache.specs.batch import Batch, BatchRun, MaskMany
from omni_prefix_cache.specs.composition import OperationSpec, ProtocolSpec
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.telemetry.trace import Trace
from omni_prefix_cache.writes.operations import ControllerBinding, ControllerOps, Pred, Run, RuntimeOp, compile_ops

Tables = tuple[Mapping[str, Run], Mapping[str, Pred], Mapping[str, BatchRun], Mapping[str, MaskMany]]


def _one(ctx: Any) -> Any:
    return ctx  # the writer names it (``trace_id``), off the recording thread


def _many(batch: Batch) -> list[Any]:
    return list(batch.items)  # a copy: the batch loses items as it goes


def compile_controller_ops(spec: ProtocolSpec, binding: ControllerBinding, tables: Tables) -> ControllerOps:
    """``compile_ops(spec, binding, *tables)``, traced while a trace is open.
    Controller construction only."""
    trace = TELEMETRY.trace
    if trace is None:
        return compile_ops(spec, binding, *tables)
    effects, guards, batch_effects, batch_guards = tables
    ops = compile_ops(
        spec,
        binding,
        {name: trace.effect(name, run, _one) for name, run in effects.items()},
        guards,
        {name: trace.effect(name, run, _many) for name, run in batch_effects.items()},
        batch_guards,
    )
    traced: dict[str, Any] = {f.name: _traced(spec, getattr(ops, f.name), trace) for f in fields(ops)}
    return replace(ops, **{name: op for name, op in traced.items() if op is not None})


def _origin(spec: ProtocolSpec, part: OperationSpec) -> tuple[str, int]:
    """The spec operation ``part`` was cut from and the index its first
    segment has there (``compile_ops`` names a part ``"NAME (LOCK segment)"``)."""
    name = part.name.split(" (")[0]
    whole = spec.ops[name]
    if len(part.segments) == len(whole.segments):
        return name, 0
    first = part.segments[0]
    for index, seg in enumerate(whole.segments):
        if seg is first or (not seg.wait and seg.lock == first.lock):
            return name, index
    return name, 0  # pragma: no cover - compile_ops cuts parts by lock


def _traced(spec: ProtocolSpec, op: Any, trace: Trace) -> RuntimeOp | None:
    if not isinstance(op, RuntimeOp):
        return None
    name, first = _origin(spec, op.op.spec)

    def wrap(segments: tuple[Callable[[Any], None], ...], ids: Callable[[Any], Any]) -> tuple[Any, ...]:
        return tuple(
            trace.segment(name, first + i, lock, seg, ids) for i, (lock, seg) in enumerate(zip(op.locks, segments))
        )

    return replace(
        op,
        op=replace(op.op, segments=wrap(op.op.segments, _one)),
        batch=replace(op.batch, segments=wrap(op.batch.segments, _many)),
    )
