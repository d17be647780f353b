"""The memcpy floors every timed call is compared with, and the static
buffers a scenario's steps and floors read.

Next to every timed call the bench times a floor in the same loop: a torch
clone of the same bytes (the step's saved rows for the engine; the rows
materialize returned, as one contiguous tensor per key, for the builder),
and the data movement the engine must do (a copy of the step's rows into a
staging buffer, then ``index_copy_`` of them into a pool of the same shape
at the step's slots). Targets are ratios to these floors, so they travel
between machines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY
from omni_prefix_cache.tools.bench.scenarios import DEFERRED_KEY, DEFERRED_WIDTH, Scenario, mm_key


def floor_us(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """Wall and thread-CPU microseconds of cloning ``tensors``."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for t in tensors:
        t.clone()
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return (t1 - t0) / 1000.0, (c1 - c0) / 1000.0


def move_floor_us(
    srcs: list[torch.Tensor], staging: list[torch.Tensor], pools: list[torch.Tensor], slots: torch.Tensor
) -> tuple[float, float, float]:
    """Wall microseconds of (copying ``srcs`` into ``staging``; that copy plus
    ``index_copy_`` of the staged rows into ``pools`` at ``slots``), and the
    thread-CPU microseconds of the staging copy."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for src, stage in zip(srcs, staging):
        stage[: src.shape[0]].copy_(src)
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    for src, stage, pool in zip(srcs, staging, pools):
        n = src.shape[0]
        pool.index_copy_(0, slots[:n], stage[:n])
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1000.0, (t2 - t0) / 1000.0, (c1 - c0) / 1000.0


def returned_rows(outs: Any) -> dict[str, int]:
    """Rows per key that ``materialize`` returned (its hidden states and mm outputs)."""
    rows: dict[str, int] = {}
    if outs.hidden_states is not None:
        rows[HIDDEN_KEY] = sum(int(t.shape[0]) for t in outs.hidden_states.values())
    for key, per_req in outs.mm_outputs.items():
        rows[key] = sum(int(t.shape[0]) for t in per_req.values() if isinstance(t, torch.Tensor))
    return rows


@dataclass(frozen=True, slots=True)
class StepFloors:
    """One timed step's floors, in microseconds."""

    engine_us: float
    engine_cpu_us: float
    staging_copy_us: float
    move_us: float
    staging_copy_cpu_us: float
    materialize_us: float
    materialize_cpu_us: float


class Rig:
    """A scenario's static buffers, built before timing starts (seeded).

    The forward's outputs are views of static buffers, as with CUDA graphs;
    the floors clone from their own sources and move into their own staging
    buffers and pools, so they never touch what the manager holds.
    """

    def __init__(self, sc: Scenario, max_n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn((max_n, sc.hidden), generator=gen).to(sc.dtype)
        self.mm = {mm_key(i): torch.randn((max_n, sc.mm_width), generator=gen).to(sc.dtype) for i in range(sc.mm_keys)}
        widths = {HIDDEN_KEY: sc.hidden, **{k: sc.mm_width for k in self.mm}}
        self.deferred: torch.Tensor | None = None
        if sc.deferred:
            widths[DEFERRED_KEY] = DEFERRED_WIDTH
            self.deferred = torch.randn((max_n, DEFERRED_WIDTH), generator=gen).to(sc.dtype)
        self.floor_src = {
            k: torch.randn((max(4 * max_n, 8192), w), generator=gen).to(sc.dtype) for k, w in widths.items()
        }
        pool_rows = sc.num_blocks * sc.block_size
        self.move_keys = list(widths)
        self.staging = [torch.empty((max_n, widths[k]), dtype=sc.dtype) for k in self.move_keys]
        self.pools = [torch.zeros((pool_rows, widths[k]), dtype=sc.dtype) for k in self.move_keys]
        self.move_slots = torch.randperm(pool_rows, generator=gen)[:max_n]

    def mm_outputs(self, n: int) -> dict[str, torch.Tensor]:
        """The step's mm outputs: the first ``n`` rows of every mm buffer."""
        mm = {k: b[:n] for k, b in self.mm.items()}
        if self.deferred is not None:
            mm[DEFERRED_KEY] = self.deferred[:n]
        return mm

    def floors(self, n: int, mm: dict[str, torch.Tensor], returned: dict[str, int]) -> StepFloors:
        """Time the floors of a step of ``n`` rows whose materialize returned ``returned``."""
        engine, engine_cpu = floor_us([self.hidden[:n], *mm.values()])
        srcs = [self.hidden[:n], *(mm[k] for k in self.move_keys[1:])]
        staged, moved, staged_cpu = move_floor_us(srcs, self.staging, self.pools, self.move_slots)
        mat, mat_cpu = floor_us([self.floor_src[k][:r] for k, r in returned.items() if k in self.floor_src])
        return StepFloors(engine, engine_cpu, staged, moved, staged_cpu, mat, mat_cpu)
