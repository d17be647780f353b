"""The controller's operations, compiled for an open trace (docs/trace.md).

``compile_controller_ops`` is ``operations.compile_ops`` when no trace is
open: the off path runs the same closures as before. With a trace open
(``TELEMETRY.trace``), every effect handler records itself before it runs
and every compiled segment records its begin and end, with the operation's
name in the spec and the segment's index there (the controller's share of
``save`` keeps every index ``save`` has), so the moves its machines record
between them are attributed to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from omni_prefix_cache.specs.batch import Batch, BatchRun, MaskMany
from omni_prefix_cache.specs.composition import CompiledOperation, ProtocolSpec
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.telemetry.trace import Trace
from omni_prefix_cache.writes.operations import ControllerBinding, ControllerOps, Pred, Run, compile_ops

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
    traced: dict[str, Any] = {f.name: _traced(getattr(ops, f.name), trace) for f in fields(ops)}
    return replace(ops, **{name: op for name, op in traced.items() if op is not None})


def _traced(op: Any, trace: Trace) -> CompiledOperation | None:
    """``op`` with every segment (per instance and batched) recording its
    begin and end under the operation's spec name and the segment's index
    there (a share keeps every segment of its operation)."""
    if not isinstance(op, CompiledOperation):
        return None
    name, locks = op.spec.name, [seg.lock for seg in op.spec.segments]

    def wrap(segments: tuple[Callable[[Any], None], ...], ids: Callable[[Any], Any]) -> tuple[Any, ...]:
        return tuple(trace.segment(name, i, lock, seg, ids) for i, (lock, seg) in enumerate(zip(locks, segments)))

    return replace(op, segments=wrap(op.segments, _one), batches=wrap(op.batches, _many))
