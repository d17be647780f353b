"""Timing one scenario: replay its planned steps against a fresh manager and
time the engine thread's calls (``new_step_starts`` + ``save_outputs``) and
the output builder's (``materialize``), each beside its floors (``floors``).

Per step the loop reads the wall clock, the calling thread's CPU clock, its
minor page faults and (threaded) the committer thread's CPU clock just
outside each timed span; the garbage collector is off while it runs.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import resource
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.tools.bench.floors import Rig, StepFloors, returned_rows
from omni_prefix_cache.tools.bench.results import ScenarioResult
from omni_prefix_cache.tools.bench.scenarios import DEFERRED_KEY, Scenario, StepInput, plan_steps
from omni_prefix_cache.tools.simulate.batch import SimGroupView

ManagerFactory = Callable[[PrefixCacheConfig, Any, bool], Any]
Clock = Callable[[], int]
# Entered with the run's manager just before its first timed step, left after
# its last (e.g. ``bench --scrape``'s scrape thread).
TimedHook = Callable[[Any], AbstractContextManager[object]]

# Minor page faults of the calling thread (Linux); None where the OS has no
# per-thread usage.
RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def thread_faults() -> int:
    """Minor page faults the calling thread has taken so far (0 without
    per-thread usage): a first write to a page of a fresh pool slab or
    output buffer costs one, and the floors' warm buffers take none."""
    return 0 if RUSAGE_THREAD is None else resource.getrusage(RUSAGE_THREAD).ru_minflt


def committer_clock(before: set[threading.Thread]) -> Clock | None:
    """The CPU clock (ns) of the committer thread started since ``before``
    was taken, or None (eager, another manager, no ``pthread_getcpuclockid``)."""
    started = [t.ident for t in threading.enumerate() if t not in before and "committer" in t.name]
    ident = started[0] if len(started) == 1 else None
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    clock = time.pthread_getcpuclockid(ident)
    return lambda: time.clock_gettime_ns(clock)


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100.0 * (len(s) - 1))))]


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One step's timed spans: microseconds (wall, calling-thread CPU,
    committer-thread CPU) and minor page faults of the calling thread."""

    engine_us: float
    materialize_us: float
    engine_cpu_us: float
    materialize_cpu_us: float
    committer_engine_us: float
    committer_materialize_us: float
    engine_faults: float
    materialize_faults: float


def time_step(
    mgr: Any,
    st: StepInput,
    hidden: torch.Tensor,
    mm: dict[str, torch.Tensor],
    committer_cpu: Clock | None,
    forward_us: float,
    profiler: cProfile.Profile | None,
    materialize_profiler: cProfile.Profile | None = None,
) -> tuple[StepTiming, Any]:
    """Run one step's engine calls and its materialize, timed; its timing and
    what materialize returned. ``hidden`` is the static hidden buffer (its
    first ``st.n`` rows are saved); ``forward_us`` is slept between the two
    engine calls and left out of the engine span; ``profiler`` (when given)
    runs across the step's spans only, ``materialize_profiler`` (when given)
    takes over materialize's span from it (and the forward is in neither),
    so each profile shows one span's calls."""
    n = st.n
    k0 = k1 = k2 = 0
    split = materialize_profiler is not None
    # Split: the engine profile pauses for the forward and hands over to materialize's.
    engine_prof = profiler if split else None
    mat_prof = materialize_profiler if split else None
    if profiler is not None:
        profiler.enable()
    if committer_cpu is not None:
        k0 = committer_cpu()
    f0 = thread_faults()
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    mgr.new_step_starts(st.output)
    if forward_us > 0:
        if engine_prof is not None:
            engine_prof.disable()
        fa, ca = time.perf_counter_ns(), time.thread_time_ns()
        ka = committer_cpu() if committer_cpu is not None else 0
        time.sleep(forward_us / 1e6)
        kb = committer_cpu() if committer_cpu is not None else 0
        # The forward is not engine time: shift the span's start by its length.
        cb, fb = time.thread_time_ns(), time.perf_counter_ns()
        t0, c0, k0 = t0 + (fb - fa), c0 + (cb - ca), k0 + (kb - ka)
        if engine_prof is not None:
            engine_prof.enable()
    sid = mgr.save_outputs(hidden[:n], mm, num_tokens_unpadded=n, num_tokens_padded=n)
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    if engine_prof is not None:
        engine_prof.disable()
    if mat_prof is not None:
        mat_prof.enable()
    if committer_cpu is not None:
        # Read between the two timed calls: materialize's span starts after it.
        k1 = committer_cpu()
        c1, t1m = time.thread_time_ns(), time.perf_counter_ns()
    else:
        t1m = t1
    f1 = thread_faults()
    outs = mgr.materialize(sid, st.order)
    t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
    f2 = thread_faults()
    if committer_cpu is not None:
        k2 = committer_cpu()
    if mat_prof is not None:
        mat_prof.disable()
    elif profiler is not None and not split:
        profiler.disable()
    timing = StepTiming(
        engine_us=(t1 - t0) / 1000.0,
        materialize_us=(t2 - t1m) / 1000.0,
        engine_cpu_us=(c1 - c0) / 1000.0,
        materialize_cpu_us=(c2 - c1) / 1000.0,
        committer_engine_us=(k1 - k0) / 1000.0,
        committer_materialize_us=(k2 - k1) / 1000.0,
        engine_faults=float(f1 - f0),
        materialize_faults=float(f2 - f1),
    )
    return timing, outs


@dataclass
class Samples:
    """The timed steps of one run: their timings and floors, and what they moved."""

    timings: list[StepTiming] = field(default_factory=list)
    floors: list[StepFloors] = field(default_factory=list)
    reqs: int = 0
    tokens: int = 0
    hit_rows: int = 0

    def add(self, timing: StepTiming, floors: StepFloors, st: StepInput, returned: dict[str, int]) -> None:
        """Record a timed step, its floors, and the rows materialize ``returned`` per key."""
        self.timings.append(timing)
        self.floors.append(floors)
        self.reqs += len(st.order)
        self.tokens += st.n
        self.hit_rows += returned.get(HIDDEN_KEY, st.n) - st.n

    def result(self, name: str, mode: str, *, committer_clocked: bool, forward_us: float) -> ScenarioResult:
        """The row: medians and p90s of the timed steps, their ratios to the floors."""
        ts, fl, steps = self.timings, self.floors, len(self.timings)
        eng, mat = [t.engine_us for t in ts], [t.materialize_us for t in ts]
        eng_cpu, mat_cpu = [t.engine_cpu_us for t in ts], [t.materialize_cpu_us for t in ts]
        e50, m50 = pct(eng, 50), pct(mat, 50)
        ef, mf = pct([f.engine_us for f in fl], 50), pct([f.materialize_us for f in fl], 50)
        ec, mc = pct(eng_cpu, 50), pct(mat_cpu, 50)
        # Off-CPU time per step; a clock read's jitter can make CPU exceed wall by a hair.
        waits = [max(0.0, t.engine_us - t.engine_cpu_us) for t in ts]
        efc, mfc = pct([f.engine_cpu_us for f in fl], 50), pct([f.materialize_cpu_us for f in fl], 50)
        total_s = (sum(eng) + sum(mat)) / 1e6
        per_step = self.reqs / steps
        faults = RUSAGE_THREAD is not None
        return ScenarioResult(
            name=name,
            mode=mode,
            steps=steps,
            requests_per_step=self.reqs / steps,
            tokens_per_step=self.tokens / steps,
            engine_us_p50=e50,
            engine_us_p90=pct(eng, 90),
            materialize_us_p50=m50,
            materialize_us_p90=pct(mat, 90),
            engine_floor_us=ef,
            materialize_floor_us=mf,
            engine_ratio=e50 / ef if ef > 0 else float("inf"),
            materialize_ratio=m50 / mf if mf > 0 else float("inf"),
            tokens_per_s=self.tokens / total_s if total_s > 0 else 0.0,
            engine_us_per_request=e50 / per_step,
            materialize_us_per_request=m50 / per_step,
            staging_copy_us=pct([f.staging_copy_us for f in fl], 50),
            move_floor_us=pct([f.move_us for f in fl], 50),
            memcpy_bound_us=2.0 * pct([f.staging_copy_us for f in fl], 50),
            staging_copy_cpu_us=pct([f.staging_copy_cpu_us for f in fl], 50),
            hit_rows_per_step=self.hit_rows / steps,
            engine_cpu_us_p50=ec,
            materialize_cpu_us_p50=mc,
            engine_cpu_ratio=ec / efc if efc > 0 else float("inf"),
            materialize_cpu_ratio=mc / mfc if mfc > 0 else float("inf"),
            step_us_p50=pct([e + m for e, m in zip(eng, mat)], 50),
            step_cpu_us_p50=pct([e + m for e, m in zip(eng_cpu, mat_cpu)], 50),
            committer_cpu_engine_us_p50=pct([t.committer_engine_us for t in ts], 50) if committer_clocked else None,
            committer_cpu_materialize_us_p50=(
                pct([t.committer_materialize_us for t in ts], 50) if committer_clocked else None
            ),
            forward_us=float(forward_us),
            engine_wait_us_p50=pct(waits, 50),
            engine_wait_us_p90=pct(waits, 90),
            engine_faults_p50=pct([t.engine_faults for t in ts], 50) if faults else None,
            materialize_faults_p50=pct([t.materialize_faults for t in ts], 50) if faults else None,
        )


def warm_pool(mgr: Any) -> bool:
    """Make every pool slab ``mgr`` opens from now on come with each page
    written once (zeros, what a fresh slab holds): the steady state of a
    server whose pool was filled once, where no pool write takes a
    first-touch page fault. A slab opens in the first save that has its
    key, a warmup step, so the writing is never timed. False (nothing
    done) when the manager exposes no pool (a test's stand-in)."""
    pool = getattr(getattr(mgr, "components", None), "pool", None)
    if pool is None:
        return False
    new_slab: Callable[[torch.dtype, int], torch.Tensor] = pool.new_slab

    def touched(dtype: torch.dtype, width: int) -> torch.Tensor:
        return new_slab(dtype, width).zero_()

    # On this pool instance only: the manager opens slabs through it.
    setattr(pool, "new_slab", touched)  # noqa: B010
    return True


def start_manager(
    sc: Scenario, max_n: int, view: SimGroupView, eager: bool, manager_factory: ManagerFactory | None
) -> tuple[Any, Clock | None]:
    """A fresh manager for ``sc`` (its policy registered) and its committer
    thread's CPU clock (None: eager, or no per-thread clock)."""
    cfg = PrefixCacheConfig(
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        staging_capacity_tokens=max(sc.token_budget, max_n),
    )
    threads_before = set(threading.enumerate())
    if manager_factory is None:
        from omni_prefix_cache.manager import OmniPrefixCacheManager

        mgr = OmniPrefixCacheManager(cfg, view, eager=eager)
    else:
        mgr = manager_factory(cfg, view, eager)
    clock = committer_clock(threads_before)
    keys = frozenset({DEFERRED_KEY}) if sc.deferred else frozenset()
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=keys))
    return mgr, clock


def run_scenario(
    sc: Scenario,
    *,
    eager: bool = True,
    iters: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    profiler: cProfile.Profile | None = None,
    materialize_profiler: cProfile.Profile | None = None,
    manager_factory: ManagerFactory | None = None,
    on_step: Callable[[], None] | None = None,
    forward_us: float = 0.0,
    during_timed: TimedHook | None = None,
    warm: bool = False,
) -> ScenarioResult:
    """Replay ``sc`` against a fresh manager; time the facade calls and the memcpy floors.
    ``on_step`` is called after every step (warmup included), outside the timed spans.
    ``forward_us``: the engine thread sleeps that long between ``new_step_starts`` and
    ``save_outputs`` (a forward pass), not counted in the engine time.
    ``during_timed(manager)``: a context entered before the first timed step
    and left after the last (also on an error), before the manager shuts down.
    ``warm``: the pool's slabs are opened and written once first (``warm_pool``).
    ``profiler`` profiles the timed steps' spans; with ``materialize_profiler``
    too, the engine calls' and materialize's spans each in their own."""
    if sc.spec_tokens:
        raise ValueError(f"scenario {sc.name}: speculative drafts run on the event API only (bench.event_api)")
    iters = sc.iters if iters is None else iters
    warmup = sc.warmup if warmup is None else warmup
    steps = plan_steps(sc, warmup + iters, seed)
    max_n = max(s.n for s in steps)
    view = SimGroupView(sc.block_size)
    mgr, committer_cpu = start_manager(sc, max_n, view, eager, manager_factory)
    warmed = warm and warm_pool(mgr)
    rig = Rig(sc, max_n, seed)
    samples = Samples()
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    hook = contextlib.ExitStack()
    try:
        for i, st in enumerate(steps):
            view.set_step(st.order, st.blocks, st.computed)
            mm = rig.mm_outputs(st.n)
            timed = i >= warmup
            if i == warmup and during_timed is not None:
                hook.enter_context(during_timed(mgr))
            timing, outs = time_step(
                mgr,
                st,
                rig.hidden,
                mm,
                committer_cpu,
                forward_us,
                profiler if timed else None,
                materialize_profiler if timed else None,
            )
            if on_step is not None:
                on_step()
            if timed:
                returned = returned_rows(outs)
                samples.add(timing, rig.floors(st.n, mm, returned), st, returned)
    finally:
        try:
            hook.close()
        finally:
            if gc_was:
                gc.enable()
            mgr.shutdown()
    mode = "eager" if eager else "threaded"
    result = samples.result(sc.name, mode, committer_clocked=committer_cpu is not None, forward_us=forward_us)
    result.warm_pool = warmed
    result.judge(sc.targets)
    return result
