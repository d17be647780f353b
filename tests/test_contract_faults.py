"""Fault injection across every seam, and long-run boundedness (issue 11).

Seams: the copy engine's launch and host copy (deferred writes), the staging
page view, the pool write, the pool read (hit planning, copy on write, the
prefetch read) and the prefetch executor. One fault is injected at the n-th
call of one seam while a serving engine (``testing.serving_model``) runs
hits, a deferred key, finishes and block reuse, eagerly and with the
threaded committer. Every facade call must return exactly the rows the model
predicts or raise a documented error; a write failure is sticky; a save
that failed before registering anything is retried; shutdown returns within
5 s; nothing is held afterwards.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.serving_model import PlannedStep, SchedOut, ServingModel
from test_contract_properties import check_rows

NUM_BLOCKS, BLOCK_SIZE, CAPACITY = 10, 2, 12
WIDTHS = {HIDDEN_KEY: 4, "m": 3, "d": 2}  # hidden, an immediate mm key, a deferred mm key
PREFIXES = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
POLICY = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
MODES = [pytest.param(True, id="eager"), pytest.param(False, id="threaded")]

# seam -> (object, attribute) of the manager it patches
SEAMS: dict[str, Callable[[OmniPrefixCacheManager], tuple[Any, str]]] = {
    "copy engine launch": lambda m: (m._controller.parts.host_rows.engine, "launch"),
    "copy engine host copy": lambda m: (m._controller.parts.host_rows.engine, "copy_into"),
    "staging view": lambda m: (m._controller.parts.staging_pool, "views"),
    "pool write": lambda m: (m._pool, "write"),
    "pool read": lambda m: (m._pool, "rows"),
    "prefetch executor": lambda m: (m._hits.prefetch, "submit"),
}
INJECTED: Counter[tuple[str, str]] = Counter()  # (seam, what the facade said), printed with -s


@pytest.fixture(scope="module", autouse=True)
def _print_faults() -> Iterator[None]:
    yield
    for (seam, outcome), count in sorted(INJECTED.items()):
        print(f"{seam:22} {outcome:44} {count}")
    print(f"faults injected: {sum(c for (_, o), c in INJECTED.items() if o != 'seam not reached')}")


class Fault:
    """Raise once, at the ``nth`` call of a seam."""

    def __init__(self, target: Any, name: str, nth: int) -> None:
        self.real = getattr(target, name)
        self.nth, self.calls, self.fired = nth, 0, False
        setattr(target, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.nth:
            self.fired = True
            raise RuntimeError(f"injected fault at call {self.nth}")
        return self.real(*args, **kwargs)


def make(eager: bool) -> tuple[OmniPrefixCacheManager, ServingModel]:
    model = ServingModel(NUM_BLOCKS, BLOCK_SIZE, WIDTHS, PREFIXES)
    config = PrefixCacheConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        staging_capacity_tokens=CAPACITY,
        staging_depth=3,
        staging_claim_timeout_s=5.0,
        gpu_staging_bytes=8 * WIDTHS["d"] * 4,  # eight deferred rows: saves force budget flushes
    )
    mgr = OmniPrefixCacheManager(config, model.view, eager=eager)
    mgr.register_policy(POLICY)
    return mgr, model


def plan(model: ServingModel, rng: random.Random) -> PlannedStep | None:
    if rng.random() < 0.5:
        model.arrive(rng.randrange(3), [21, 22][: rng.randrange(3)])
    running = [r.rid for r in model.running()]
    if running and rng.random() < 0.3:
        model.end(rng.choice(running))
    return model.schedule(admit=lambda r: rng.randint(1, 5), run=lambda r: rng.randint(0, 2), capacity=CAPACITY)


def assert_nothing_held(mgr: OmniPrefixCacheManager) -> None:
    ctrl = mgr._controller
    assert not mgr._step_ctxs and not mgr._hits.pending and not mgr._reads.pending
    assert not ctrl.parts.staging_pool.holders(), ctrl.parts.staging_pool.holders()
    assert ctrl.parts.budget.staged_bytes == 0
    assert all(t.is_terminal for t in list(ctrl.parts.registry.tasks.values()))


@pytest.mark.parametrize("nth", [1, 2, 4])
@pytest.mark.parametrize("seam", sorted(SEAMS))
@pytest.mark.parametrize("eager", MODES)
def test_a_fault_at_any_seam_gives_exact_rows_or_a_documented_error(eager: bool, seam: str, nth: int) -> None:
    rng = random.Random(f"{seam}/{nth}")
    mgr, model = make(eager)
    fault = Fault(*SEAMS[seam](mgr), nth)
    outcome = "no error"
    dead = False  # a write failed: every serving entry must now raise it
    try:
        for _ in range(14):
            if dead:
                with pytest.raises(OmniPrefixCacheWriteFailedError):
                    mgr.new_step_starts(SchedOut([], set(), {}))
                break
            step = plan(model, rng)
            if step is None:
                continue
            try:
                mgr.new_step_starts(step.out)
                try:
                    sid = mgr.save_outputs(step.hidden, step.mm, num_tokens_unpadded=step.n, num_tokens_padded=step.n)
                except OmniPrefixCacheUnmatchError as exc:
                    if isinstance(exc, OmniPrefixCacheWriteFailedError) or mgr.stats()["sticky_failure"]:
                        raise
                    # Failed before registering anything: the snapshot is kept; retry.
                    outcome = f"save retried after {type(exc).__name__}"
                    sid = mgr.save_outputs(step.hidden, step.mm, num_tokens_unpadded=step.n, num_tokens_padded=step.n)
                rids = [e.rid for e in step.expects]
                try:
                    outs = mgr.materialize(sid, rids)
                except OmniPrefixCacheUnmatchError as exc:
                    if isinstance(exc, OmniPrefixCacheWriteFailedError) or mgr.stats()["sticky_failure"]:
                        raise
                    outcome = f"materialize raised {type(exc).__name__}"
                    continue
                check_rows(model, step, outs, rids)
            except OmniPrefixCacheUnmatchError as exc:
                assert mgr.stats()["sticky_failure"], f"{seam}: {exc!r} left the manager serving"
                outcome = f"sticky {type(exc).__name__}"
                dead = True
        else:
            # Finish everything: deferred writes flush and any late failure surfaces.
            for rid in list(model.requests):
                model.end(rid)
            try:
                mgr.new_step_starts(SchedOut([], model.finished_pending, {}))
                ctrl = mgr._controller
                ctrl.join([t.tid for t in list(ctrl.parts.registry.tasks.values())])
            except OmniPrefixCacheUnmatchError as exc:
                assert isinstance(exc, OmniPrefixCacheWriteFailedError), exc
                outcome = "sticky OmniPrefixCacheWriteFailedError"
    finally:
        started = time.monotonic()
        mgr.shutdown()
        took = time.monotonic() - started
    assert took < 5.0, f"shutdown took {took:.1f}s"
    mgr._hits.prefetch.shutdown(wait=True)
    assert_nothing_held(mgr)
    INJECTED[(seam, outcome if fault.fired else "seam not reached")] += 1


@pytest.mark.parametrize("eager", MODES)
def test_long_run_tables_stay_bounded_by_the_live_working_set(eager: bool) -> None:
    """Hundreds of requests through a small engine: every internal table
    stays bounded by what is live (requests, open steps, undrained writes),
    never by how many requests were ever seen."""
    rng = random.Random(11)
    mgr, model = make(eager)
    ctrl = mgr._controller
    peak: Counter[str] = Counter()
    try:
        steps = 0
        while model._next < 150:
            step = plan(model, rng)
            if step is None:
                continue
            steps += 1
            mgr.new_step_starts(step.out)
            sid = mgr.save_outputs(step.hidden, step.mm, num_tokens_unpadded=step.n, num_tokens_padded=step.n)
            rids = [e.rid for e in step.expects]
            check_rows(model, step, mgr.materialize(sid, rids), rids)
            live = len(mgr._live)
            assert live <= len(model.requests) + len(model.finished_pending)
            rt = mgr._ledger.requests
            bound = live + len(mgr._ledger.records)  # a request is live or has an undrained write
            sizes = {
                "request_tasks.opened": len(rt.opened),
                "request_tasks.tasks": len(rt.tasks),
                "request_tasks.deferred": len(rt.deferred),
                "pending_hits": len(mgr._hits.pending),
            }
            for name, size in sizes.items():
                assert size <= bound, (name, size, bound)
                peak[name] = max(peak[name], size)
            # Undrained writes: at most one deferred write per live request,
            # plus the immediate writes of the steps whose pool writes are
            # not drained yet (a few steps' worth of requests).
            assert len(mgr._ledger.records) <= live + 3 * CAPACITY
            assert len(ctrl.parts.registry.tasks) <= len(mgr._ledger.records) + 3 * CAPACITY
            assert not mgr._step_ctxs and len(mgr._reads.pending) <= 2 * live + 2
            assert len(ctrl.parts.staging_pool.holders()) <= 1 + 3 * CAPACITY
            peak["live"] = max(peak["live"], live)
            peak["records"] = max(peak["records"], len(mgr._ledger.records))
        assert steps > 100  # far more requests than ever live at once
        for rid in list(model.requests):
            model.end(rid)
        mgr.new_step_starts(SchedOut([], model.finished_pending, {}))
        ctrl.join([t.tid for t in list(ctrl.parts.registry.tasks.values())])
        mgr.new_step_starts(SchedOut([], set(), {}))
        rt = mgr._ledger.requests
        assert not mgr._live and not rt.opened and not rt.tasks and not rt.deferred and not mgr._ledger.records
        assert not ctrl.parts.registry.tasks and not mgr._reads.pending and not ctrl.parts.registry.failures()
        print(f"{'eager' if eager else 'threaded'}: {model._next} requests over {steps} steps; peaks {dict(peak)}")
    finally:
        mgr.shutdown()


def test_the_fault_seams_are_called_by_the_scenario() -> None:
    """Each seam is reached in both modes at least once (a fault that never
    fires would test nothing)."""
    for eager in (True, False):
        mgr, model = make(eager)
        counters = {seam: Fault(*SEAMS[seam](mgr), nth=10**9) for seam in SEAMS}
        rng = random.Random("seams")
        try:
            for _ in range(14):
                step = plan(model, rng)
                if step is None:
                    continue
                mgr.new_step_starts(step.out)
                sid = mgr.save_outputs(step.hidden, step.mm, num_tokens_unpadded=step.n, num_tokens_padded=step.n)
                rids = [e.rid for e in step.expects]
                check_rows(model, step, mgr.materialize(sid, rids), rids)
            for rid in list(model.requests):
                model.end(rid)
            mgr.new_step_starts(SchedOut([], model.finished_pending, {}))
            ctrl = mgr._controller
            ctrl.join([t.tid for t in list(ctrl.parts.registry.tasks.values())])
        finally:
            mgr.shutdown()
        reached = {seam: f.calls for seam, f in counters.items()}
        assert all(reached.values()), (eager, reached)
