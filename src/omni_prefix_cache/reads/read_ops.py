"""The planned reads' side of the composition (spec/protocol.yaml), compiled.

``ReadBinding`` resolves the ``read`` role (the planned_read machine) to
moves of a ``PlannedReads`` registry. ``compile_read_ops`` compiles, once
per ``HitReads``:

- operation ``prefetch`` (per read: fetch, the rows, then serve or fail),
  run by ``HitReads.fetch`` on the prefetch thread;
- ``new_step``'s read moves (its last state segment projected on the
  ``read`` role: ``register`` where ``rows_planned``, else ``refuse``), for
  a batch of reads planned together, run by ``HitReads.plan_many`` (at
  new_step, and for the hits a save plans).

Threading: every read move runs under the reads lock, which the executor
holds for the segments that declare it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omni_prefix_cache.specs.batch import Batch
from omni_prefix_cache.specs.compiled import CompiledMachine
from omni_prefix_cache.specs.composition import CompiledOperation, Fire, ProtocolSpec, compile_operation
from omni_prefix_cache.specs.loader import SpecError, TriggerName
from omni_prefix_cache.specs.runner import LockRule, SegmentRunner
from omni_prefix_cache.specs.types.planned_read import PlannedReadTrigger

__all__ = ["Fetch", "ReadBinding", "ReadOps", "compile_read_ops"]

Pred = Callable[[Any], bool]
Run = Callable[[Any], None]


class _Registry(Protocol):
    def move(self, ref: Any, trigger: PlannedReadTrigger, reused: set[int] | None = None) -> None: ...


@dataclass(eq=False, slots=True)
class Fetch:
    """Operation ``prefetch``'s context: the read, where its rows go, and
    what the fetch gave (``rows``) or raised (``error``)."""

    ref: Any  # a PlannedRead
    out: torch.Tensor | None
    rows: torch.Tensor | None = None
    error: BaseException | None = None


class ReadBinding:
    """``Binding`` of the ``read`` role over a registry; ``get(ctx)`` is the
    context's read (a ``Fetch``'s ``ref``, or the read itself in a batch).
    A move the machine refuses raises the registry's error naming the read
    and its state, so a required move never fails silently."""

    def __init__(self, machine: CompiledMachine, registry: _Registry, get: Callable[[Any], Any]) -> None:
        self._machine = machine
        self._registry = registry
        self._get = get

    def _trigger(self, role: str, trigger: TriggerName) -> PlannedReadTrigger:
        if role != "read":
            raise SpecError(f"protocol.yaml: the planned reads fire no {role}.{trigger}")
        try:
            return PlannedReadTrigger(trigger)
        except ValueError:
            raise SpecError(f"protocol.yaml: read has no trigger {trigger!r}") from None

    def move(self, role: str, trigger: TriggerName) -> tuple[Pred, Run]:
        move, get, registry = self._trigger(role, trigger), self._get, self._registry
        row = self._machine.by_state(move)
        return (lambda ctx: row[get(ctx).state] is not None), (lambda ctx: registry.move(get(ctx), move))

    def try_move(self, role: str, trigger: TriggerName) -> Pred:
        move, get, registry = self._trigger(role, trigger), self._get, self._registry

        def attempt(ctx: Any) -> bool:
            registry.move(get(ctx), move)  # raises naming the read when refused
            return True

        return attempt

    def coupling(self, role: str, name: str) -> Run:
        raise SpecError(f"protocol.yaml: the planned reads run no coupling {role}.{name}")


@dataclass(frozen=True, eq=False, slots=True)
class ReadOps:
    """The compiled read operations (executor ``reads``) and their runner
    (the reads lock where a prefetch segment declares it)."""

    prefetch: CompiledOperation
    settle: CompiledOperation  # new_step's ``hits`` segment, projected on the read moves
    runner: SegmentRunner

    def fetch(self, call: Fetch) -> None:
        """Operation ``prefetch`` for one read: ``fetch`` (reads lock), the
        rows (no lock), then ``serve`` or ``fail`` (reads lock). Raises what
        a refused move raises (the registry names the read)."""
        run, op = self.runner.run, self.prefetch
        run(op, "fetch", call)
        run(op, "rows", call)
        run(op, "serve", call)

    def settle_planned(self, refs: list[Any]) -> None:
        """``register`` every read whose plan is complete, ``refuse`` the
        others (state and reads locks held by the caller). Raises the first
        refused move."""
        if not refs:
            return
        batch = Batch(list(refs))
        self.runner.run_segment_batch(self.settle, "hits", batch)
        if batch.errors:
            raise batch.errors[0][1]


def compile_read_ops(
    spec: ProtocolSpec, machine: CompiledMachine, registry: _Registry, fetch_rows: Run, reads_lock: Any
) -> ReadOps:
    """Compile ``prefetch`` (with ``fetch_rows`` as its effect) and
    ``new_step``'s read moves against ``registry``; ``reads_lock`` is the
    lock a prefetch segment under ``reads`` takes."""
    prefetch = spec.share("reads", "prefetch")
    for seg in prefetch.segments:
        if seg.wait or seg.lock not in ("reads", "none"):
            raise SpecError(f"{spec.origin}: operation prefetch runs under the reads lock or none, not {seg.label}")
    fetched: Pred = lambda ctx: ctx.error is None  # noqa: E731 - the guard rows_fetched
    compiled = compile_operation(
        prefetch,
        ReadBinding(machine, registry, lambda ctx: ctx.ref),
        {"fetch_rows": fetch_rows},
        {"rows_fetched": fetched},
    )
    new_step = spec.share("reads", "new_step", "hits")
    if not any(isinstance(s, Fire) for s in new_step.walk()):
        raise SpecError(f"{spec.origin}: new_step's hits segment moves no planned read")
    planned: Pred = lambda ref: ref.refusal is None  # noqa: E731 - the guard rows_planned
    settle = compile_operation(
        new_step,
        ReadBinding(machine, registry, lambda ref: ref),
        {},
        {"rows_planned": planned},
        batch_guards={"rows_planned": lambda refs: [ref.refusal is None for ref in refs]},
    )
    return ReadOps(compiled, settle, SegmentRunner({"reads": LockRule(lock=reads_lock)}))
