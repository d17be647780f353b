"""The serving simulation: allocator and prefix-hash rules, scheduler behaviour
(both scheduler-output forms), the oracles (including that they can fail),
runs of both APIs against the real manager in eager and threaded mode, and a
bench smoke test."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
)
from omni_prefix_cache.interface import HIDDEN_KEY, StageCacheOutputs
from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig, run_simulation
from omni_prefix_cache.tools.simulate.batch import PersistentBatch, SimGroupView
from omni_prefix_cache.tools.simulate.blocks import BlockAllocator
from omni_prefix_cache.tools.simulate.delivery_oracle import DeliveryOracle
from omni_prefix_cache.tools.simulate.oracle import Oracle, RowExpectation
from omni_prefix_cache.tools.simulate.reference import ReferenceManager
from omni_prefix_cache.tools.simulate.report import format_table, percentile, summary
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, block_hash, rows_from_hashes
from omni_prefix_cache.tools.simulate.scheduler import Scheduler, Status
from omni_prefix_cache.tools.simulate.workload import FollowupSpec, RequestSpec, generate_trace

HAS_MANAGER = importlib.util.find_spec("omni_prefix_cache.manager") is not None
needs_manager = pytest.mark.skipif(not HAS_MANAGER, reason="omni_prefix_cache.manager not available")

SMALL = SimConfig(steps=400, workload=WorkloadConfig(arrival_steps=40))
SEED = replace(SMALL, api="seed")
APIS = pytest.mark.parametrize("api", ["events", "seed"])


def _event_counts_all_nonzero(res: Any) -> None:
    """The event API's run exercised what it is for: resumes both ways, recoveries
    after a discard, replacements, id reuse and both consumers."""
    d, st = res.delivery, res.scheduler
    assert d["resumes_growing"] > 0 and d["resumes_shrinking"] > 0, d
    assert d["recovered_discards"] > 0 and st["rollbacks"] > 0, (d, st)
    assert st["replacements"] > 0 and st["reused_ids"] > 0, st
    assert d["delivered"]["builder"] > 0 and d["delivered"]["local"] > 0 and d["views_dropped"] > 0, d
    assert d["finished_checked"] == st["finished"], (d, st)


def _reference(config: Any, view: Any, eager: bool) -> ReferenceManager:
    return ReferenceManager(config, view, eager=eager)


# ------------------------------------------------------------ rows and hashes


def test_rows_are_a_function_of_the_token_prefix() -> None:
    a, b = PrefixHashes(), PrefixHashes()
    a.extend([1, 2, 3, 4])
    b.extend([1, 2])
    b.extend([3, 9])
    assert torch.equal(a.span(0, 3), b.span(0, 3))
    assert int(a.span(3, 4)) != int(b.span(3, 4))
    ra = rows_from_hashes(a.span(0, 4), HIDDEN_KEY, 8, torch.float32)
    rb = rows_from_hashes(b.span(0, 4), HIDDEN_KEY, 8, torch.float32)
    assert torch.equal(ra[:3], rb[:3]) and not torch.equal(ra[3], rb[3])
    # Different keys, different rows; bf16 holds the values exactly.
    assert not torch.equal(ra, rows_from_hashes(a.span(0, 4), "k", 8, torch.float32))
    bf = rows_from_hashes(a.span(0, 4), "k", 8, torch.bfloat16)
    assert torch.equal(bf.float().to(torch.bfloat16), bf)


def test_block_hash_chains_parent() -> None:
    h0 = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == h0
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])


# ------------------------------------------------------------ allocator


def test_allocator_lru_free_list_keeps_hashes_until_reallocated() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    blocks = alloc.allocate(2)
    assert blocks == [0, 1]
    alloc.cache(0, 111, step=0)
    alloc.cache(1, 222, step=0)
    alloc.free(blocks)  # tail first: block 1, then block 0
    assert alloc.num_free == 4
    assert alloc.lookup_prefix([111, 222], num_tokens=9) == [0, 1]
    got = alloc.allocate(3)  # 2, 3 were free before; then block 1 (freed first) is evicted
    assert got == [2, 3, 1]
    assert alloc.block_hash(1) is None and alloc.block_hash(0) == 111
    assert alloc.lookup_prefix([111, 222], num_tokens=9) == [0]
    assert alloc.stats.evicted_hashes == 1
    alloc.check_invariants()


def test_allocator_hit_revives_free_block_and_never_covers_whole_prompt() -> None:
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    b = alloc.allocate(2)
    alloc.cache(b[0], 1, step=0)
    alloc.cache(b[1], 2, step=0)
    alloc.free(b)
    # An 8-token prompt made of exactly these blocks hits only the first: one token is recomputed.
    assert alloc.lookup_prefix([1, 2], num_tokens=8) == [b[0]]
    assert alloc.lookup_prefix([1, 2], num_tokens=9) == b
    alloc.touch([b[0]])
    assert not alloc.is_free(b[0]) and alloc.ref_count(b[0]) == 1
    assert alloc.stats.revived_from_free == 1
    # The hit stops at the first uncached block even if later ones are cached.
    assert alloc.lookup_prefix([9, 2], num_tokens=100) == []
    alloc.check_invariants()


def test_allocator_shared_block_freed_only_by_last_reference() -> None:
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    (b,) = alloc.allocate(1)
    alloc.touch([b])
    alloc.free([b])
    assert not alloc.is_free(b)
    alloc.free([b])
    assert alloc.is_free(b)
    with pytest.raises(ValueError):
        alloc.free([b])


# ------------------------------------------------------------ scheduler


def _spec(rid: str, step: int, prompt: tuple[int, ...], out: int = 2, **kw: Any) -> RequestSpec:
    return RequestSpec(rid, step, (prompt,), max_output=out, **kw)


def test_same_step_identical_prompts_hit_blocks_computed_this_step() -> None:
    prompt = tuple(range(100, 110))  # 10 tokens, block size 4: 2 full blocks
    sched = Scheduler([_spec("a", 0, prompt), _spec("b", 0, prompt)], 16, 4, token_budget=64, max_num_seqs=4)
    plan = sched.schedule(0)
    by = {e.req.req_id: e for e in plan.entries}
    assert by["a"].manager_hit == 0 and by["a"].n == 10
    assert by["b"].manager_hit == 8 and by["b"].n == 2 and by["b"].start == 8
    assert by["b"].req.blocks[:2] == by["a"].req.blocks[:2]
    assert {n.req_id: n.num_computed_tokens for n in plan.output.scheduled_new_reqs} == {"a": 0, "b": 8}
    assert sched.stats.same_step_hits == 1


def test_full_prompt_cached_still_recomputes_last_block() -> None:
    prompt = tuple(range(8))  # exactly two blocks
    sched = Scheduler([_spec("a", 0, prompt, out=1), _spec("b", 2, prompt)], 16, 4, token_budget=64, max_num_seqs=4)
    sched.update(sched.schedule(0))  # a: prefill, samples its only token, finishes
    sched.update(sched.schedule(1))
    plan = sched.schedule(2)
    (e,) = plan.entries
    assert e.req.req_id == "b" and e.manager_hit == 4 and e.n == 4


def test_chunked_prefill_and_decode_under_budget() -> None:
    sched = Scheduler([_spec("a", 0, tuple(range(10)), out=3)], 16, 4, token_budget=4, max_num_seqs=4)
    sizes = []
    for step in range(8):
        plan = sched.schedule(step)
        sizes.append([e.n for e in plan.entries])
        sched.update(plan)
    assert sizes[:5] == [[4], [4], [2], [1], [1]]
    assert sched.requests["a"].status is Status.DONE and sched.stats.finished == 1
    assert sizes[5:] == [[], [], []]


def test_preempted_request_resumes_as_live_new_entry() -> None:
    # Two requests, 4 blocks of 4: b's growth preempts b itself first, then a resumes later.
    specs = [_spec("a", 0, tuple(range(8)), out=6), _spec("b", 0, tuple(range(50, 58)), out=6)]
    sched = Scheduler(specs, 5, 4, token_budget=64, max_num_seqs=4)  # the seed-era form
    seen_preempt = False
    for step in range(40):
        plan = sched.schedule(step)
        for e in plan.entries:
            if e.new_entry is not None and e.req.preempted:
                seen_preempt = True
                assert e.manager_hit == 0  # the manager still knows it: never a hit
                assert e.new_entry.num_computed_tokens == e.start
        sched.update(plan)
        sched.alloc.check_invariants()
        if sched.idle:
            break
    assert seen_preempt and sched.stats.preemptions >= 1 and sched.idle


def test_event_form_resumes_through_cached_requests_with_every_block() -> None:
    specs = [_spec("a", 0, tuple(range(8)), out=6), _spec("b", 0, tuple(range(50, 58)), out=6)]
    sched = Scheduler(specs, 5, 4, token_budget=64, max_num_seqs=4, events=True)
    adapter = PrefixCacheSchedulerAdapter()
    resumed = 0
    for step in range(40):
        plan = sched.schedule(step)
        out = plan.output
        assert out.prefix_cache_step_sequence == step
        assert out.prefix_cache_owners == {e.req.req_id: e.req.owner for e in plan.entries}
        cached = out.scheduled_cached_reqs
        assert cached is not None
        events = {e.req_id: e for e in adapter.translate_step(out)}
        for e in plan.entries:
            if e.resumed:
                resumed += 1
                i = cached.req_ids.index(e.req.req_id)
                assert e.req.req_id in cached.resumed_req_ids and e.new_entry is None
                assert cached.num_computed_tokens[i] == e.start and cached.new_block_ids[i] == (e.req.blocks,)
                ev = events[e.req.req_id]
                assert ev.kind is PrefixCacheEventKind.RESUMED and ev.hit_end == e.start
                assert ev.block_ids == (tuple(e.req.blocks),)
        sched.update(plan)
        sched.alloc.check_invariants()
        if sched.idle:
            break
    assert resumed >= 1 and sched.idle


def test_event_form_owners_reuse_and_replacement() -> None:
    first = _spec("a", 0, tuple(range(12)), out=2, followup=FollowupSpec(0, (7, 8), 2, reuse_id=True))
    sched = Scheduler([first], 32, 4, token_budget=8, max_num_seqs=4, events=True)
    adapter = PrefixCacheSchedulerAdapter()
    owners, kinds = [], []
    for step in range(30):
        sched.replace_prob = 1.0 if step == 1 else 0.0  # replaced once, mid-prefill
        plan = sched.schedule(step)
        for ev in adapter.translate_step(plan.output):
            kinds.append(ev.kind)
            owners.append(ev.owner)
        sched.update(plan)
        if sched.idle:
            break
    assert sched.stats.replacements == 1 and sched.stats.reused_ids == 1
    replaced = [o for o, k in zip(owners, kinds) if k is PrefixCacheEventKind.REPLACED]
    assert replaced and all(o is not None and o.generation >= 1 for o in replaced)
    # The second turn under the same id is a new admission: a larger admission id, STARTED.
    admissions = sorted({o.admission_id for o in owners if o is not None})
    assert admissions == [1, 2]
    assert kinds.count(PrefixCacheEventKind.STARTED) >= 2


def test_streaming_continuation_reenters_with_its_own_count() -> None:
    spec = RequestSpec("s", 0, (tuple(range(6)), tuple(range(6, 11))), max_output=1, segment_gap=1)
    sched = Scheduler([spec], 16, 4, token_budget=64, max_num_seqs=4)
    p0 = sched.schedule(0)
    sched.update(p0)
    assert sched.requests["s"].status is Status.AWAITING_INPUT
    p1 = sched.schedule(1)
    assert not p1.entries
    sched.update(p1)
    p2 = sched.schedule(2)
    (e,) = p2.entries
    assert e.new_entry is not None and e.new_entry.num_computed_tokens == 6 and e.manager_hit == 0
    assert e.start == 6 and e.n == 5


def test_followup_turn_hits_first_turn_prompt_and_answer() -> None:
    first = tuple(range(200, 220))
    spec = RequestSpec("c", 0, (first,), max_output=6, followup=FollowupSpec(delay=0, extra=(1, 2, 3), max_output=1))
    sched = Scheduler([spec], 32, 4, token_budget=64, max_num_seqs=4)
    hit = None
    for step in range(20):
        plan = sched.schedule(step)
        for e in plan.entries:
            if e.req.req_id == "c.2":
                hit = e.manager_hit
        sched.update(plan)
    # 20 prompt + 6 sampled tokens (the last never computed): 25 computed -> 6 full blocks cached.
    assert hit == 24


def test_trace_is_deterministic() -> None:
    assert generate_trace(WorkloadConfig(arrival_steps=30), 7) == generate_trace(WorkloadConfig(arrival_steps=30), 7)


def test_persistent_batch_condenses_from_the_tail() -> None:
    pb = PersistentBatch()
    assert pb.update(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    assert pb.update(["a", "c", "d"]) == ["a", "d", "c"]
    assert pb.update(["a", "d", "c", "e"]) == ["a", "d", "c", "e"]


def test_group_view_maps_positions_through_block_table() -> None:
    view = SimGroupView(block_size=4)
    view.set_step(["x", "y"], {"x": [7, 2], "y": [5]}, {"x": 3, "y": 0})
    assert view.batch_req_ids() == ["x", "y"]
    got = view.step_slots_cpu(["x", "y"], {"x": 2, "y": 2})
    assert got.tolist() == [7 * 4 + 3, 2 * 4 + 0, 20, 21]


# ------------------------------------------------------------ oracle + reference


@APIS
@pytest.mark.parametrize("lag", [False, True])
def test_simulation_against_reference_manager_is_clean(api: str, lag: bool) -> None:
    res = run_simulation(replace(SMALL, api=api, eager=not lag, lag=lag), manager_factory=_reference)
    assert res.error is None, res.error
    assert res.mismatches == 0, res.mismatch_details
    st = res.scheduler
    assert st["hits"] > 0 and st["preemptions"] > 0 and st["stream_reentries"] > 0 and st["reused_ids"] > 0
    assert res.rows_from_cache > 0 and res.rows_checked > res.tokens
    if api == "events":
        _event_counts_all_nonzero(res)
    else:
        assert res.delivery == {} and st["replacements"] == 0


class _Corrupting:
    """Delegates to a manager; corrupts one cached-prefix row of the first hit it returns."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.corrupted: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def materialize(self, step_id: int, req_ids: list[str]) -> StageCacheOutputs:
        outs = self._inner.materialize(step_id, req_ids)
        if self.corrupted is None and outs.hidden_states:
            for rid, t in outs.hidden_states.items():
                if t.shape[0] > 16:
                    t = t.clone()
                    t[0, 0] += 1.0
                    outs.hidden_states[rid] = t
                    self.corrupted = rid
                    break
        return outs


def _base(inner: str, config: Any, view: Any, eager: bool) -> Any:
    if inner == "reference":
        return ReferenceManager(config, view, eager=eager)
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    return OmniPrefixCacheManager(config, view, eager=eager)


INNERS = pytest.mark.parametrize("inner", ["reference", pytest.param("manager", marks=needs_manager)])


@INNERS
@APIS
def test_oracle_reports_a_corrupted_row(inner: str, api: str) -> None:
    made: list[_Corrupting] = []

    def factory(config: Any, view: Any, eager: bool) -> Any:
        made.append(_Corrupting(_base(inner, config, view, eager)))
        return made[0]

    res = run_simulation(replace(SMALL, api=api), manager_factory=factory)
    assert made[0].corrupted is not None and not res.ok
    # The seed oracle checks the output once; the event oracle also checks each consumer's view of it.
    assert res.mismatches == 1 if api == "seed" else 1 <= res.mismatches <= 3
    assert made[0].corrupted in res.mismatch_details[0] and "position 0" in res.mismatch_details[0]
    assert "FAILED" in format_table(res)


@APIS
@pytest.mark.parametrize("lag", [False, True])
def test_static_forward_buffers_catch_a_manager_that_keeps_views(api: str, lag: bool) -> None:
    def factory(config: Any, view: Any, eager: bool) -> ReferenceManager:
        return ReferenceManager(config, view, eager=eager, alias_live=True)

    res = run_simulation(replace(SMALL, api=api, eager=not lag, lag=lag), manager_factory=factory)
    # Inline materialize reads before the next forward: views are still right. Lagged: they are not.
    # The event API's local consumer reads its outputs steps later: it catches them even inline.
    assert (res.mismatches > 0) is (lag or api == "events"), res.mismatch_details


class _NoRecovery:
    """Delegates to a manager; turns every RESUMED event into EXTENDED, so a
    resumed request's hit recovers nothing (rows lost after a preemption)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def new_step_starts(self, step: Any) -> None:
        assert isinstance(step, PrefixCacheStep)
        events = tuple(
            replace(e, kind=PrefixCacheEventKind.EXTENDED) if e.kind is PrefixCacheEventKind.RESUMED else e
            for e in step.events
        )
        self._inner.new_step_starts(replace(step, events=events))


@INNERS
def test_rows_lost_after_a_preemption_or_discard_fail_the_run(inner: str) -> None:
    res = run_simulation(SMALL, manager_factory=lambda c, v, e: _NoRecovery(_base(inner, c, v, e)))
    assert res.error is not None and "delivery gap" in res.error and not res.ok, res.error


class _Unclipped:
    """Delegates to a manager; its delivery views are the whole output (a
    consumer gets positions it already received again). The manager only
    acknowledges views it issued, so the acknowledgements get the issued one."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._issued: dict[int, tuple[StageCacheOutputs, StageCacheOutputs]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def delivery_view(self, outputs: StageCacheOutputs, req_ids: list[str], *, consumer: str) -> StageCacheOutputs:
        view = self._inner.delivery_view(outputs, req_ids, consumer=consumer)
        whole = replace(
            view,
            hidden_states=None if outputs.hidden_states is None else {r: outputs.hidden_states[r] for r in req_ids},
            mm_outputs={k: {r: v[r] for r in req_ids} for k, v in outputs.mm_outputs.items()},
            token_ranges={r: outputs.token_ranges[r] for r in req_ids},
        )
        self._issued[id(whole)] = (whole, view)
        return whole

    def _issued_view(self, view: StageCacheOutputs) -> StageCacheOutputs:
        return self._issued.pop(id(view), (view, view))[1]

    def ack_delivery(self, view: StageCacheOutputs) -> None:
        self._inner.ack_delivery(self._issued_view(view))

    def commit_output(self, outputs: StageCacheOutputs, handoff: Any, *, delivery: Any = None) -> frozenset[str]:
        return self._inner.commit_output(
            outputs, handoff, delivery=None if delivery is None else self._issued_view(delivery)
        )


@INNERS
def test_a_position_delivered_twice_is_a_mismatch(inner: str) -> None:
    res = run_simulation(SMALL, manager_factory=lambda c, v, e: _Unclipped(_base(inner, c, v, e)))
    assert res.mismatches > 0 and not res.ok
    assert any("delivery" in d and "which received" in d for d in res.mismatch_details), res.mismatch_details


def test_a_scheduler_without_the_event_form_runs_the_seed_api() -> None:
    from omni_prefix_cache.tools.simulate import Simulation

    sim = Simulation(replace(SMALL, steps=60), manager_factory=_reference)
    sim.sched.events = False  # type: ignore[misc]  # as vLLM's driver, which emits the seed-era form only
    res = sim.run()
    assert res.ok and res.config["api"] == "seed" and res.delivery == {}, res.error


def test_delivery_oracle_flags_a_finished_tenure_not_fully_delivered() -> None:
    from types import SimpleNamespace

    h = PrefixHashes()
    h.extend(range(6))
    oracle = DeliveryOracle({HIDDEN_KEY: 4}, torch.float32)
    req = SimpleNamespace(req_id="a", hashes=h, computed=6, generation=0)
    exps = [oracle.expect(req, 0, 6, False)]
    rows = rows_from_hashes(h.span(0, 6), HIDDEN_KEY, 4, torch.float32)
    out = StageCacheOutputs({"a": rows}, {}, token_ranges={"a": (0, 6)}, scheduled_token_ranges={"a": (0, 6)})
    oracle.check_output(0, 0, exps, out, {})
    oracle.finished(req)
    for consumer in ("builder", "local"):
        oracle.check_view(0, 0, consumer, exps, out, out)
    oracle.delivered("builder", exps, out, frozenset({"a"}))
    part = replace(out, hidden_states={"a": rows[:4]}, token_ranges={"a": (0, 4)})
    oracle.delivered("local", exps, part, None)
    assert oracle.mismatches == 0
    oracle.finish()
    assert oracle.mismatches == 1 and "'local' received [0, 4) of a finished [0, 6)" in str(oracle.details[0])
    # A view that skips a position the consumer never received is flagged too.
    late = replace(out, hidden_states={"a": rows[5:]}, token_ranges={"a": (5, 6)})
    oracle.check_view(1, 1, "local", exps, late, late)
    assert oracle.mismatches == 2 and "which received [0, 4)" in str(oracle.details[1])


def test_oracle_flags_shape_and_missing_request() -> None:
    h = PrefixHashes()
    h.extend(range(6))
    oracle = Oracle({HIDDEN_KEY: 4}, torch.float32)
    exp = [RowExpectation("a", 0, 6, 4, h.span(0, 6)), RowExpectation("b", 2, 4, 0, h.span(2, 4))]
    rows = oracle.expected(exp)[HIDDEN_KEY]
    assert oracle.check(0, 0, exp, StageCacheOutputs({"a": rows[0], "b": rows[1]}, {})) == 0
    assert oracle.check(1, 1, exp, StageCacheOutputs({"a": rows[0][2:]}, {})) == 2
    assert "shape" in str(oracle.details[0]) and "missing" in str(oracle.details[1])
    tag = [torch.tensor([1.0, 2.0])]
    good = StageCacheOutputs({"a": rows[0], "b": rows[1]}, {"ref": {"a": [tag[0].clone()], "b": [tag[0].clone()]}})
    assert oracle.check(2, 2, exp, good, {"ref": tag}) == 0
    bad = StageCacheOutputs({"a": rows[0], "b": rows[1]}, {"ref": {"a": [tag[0] + 1], "b": tag[0]}})
    assert oracle.check(3, 3, exp, bad, {"ref": tag}) == 2


def test_report_summary_is_json_and_percentiles() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    res = run_simulation(replace(SMALL, steps=30), manager_factory=_reference)
    s = summary(res)
    json.dumps(s, default=str)
    for key in ("steps", "tokens", "hit_rate", "engine_us_p50", "materialize_us_p99", "mismatches", "leaks"):
        assert key in s


# ------------------------------------------------------------ real manager


@needs_manager
@APIS
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_short_simulation_has_no_mismatch_or_leak(eager: bool, api: str) -> None:
    res = run_simulation(replace(SMALL, eager=eager, api=api))
    assert res.error is None, res.error
    assert res.mismatches == 0, res.mismatch_details
    assert res.leaks and not res.leaked, res.leaks
    assert None not in res.leaks.values(), f"a leak probe found no such table: {res.leaks}"
    assert res.view_off_thread_calls == 0
    assert res.scheduler["hits"] > 0 and res.rows_from_cache > 0
    assert res.config["lag"] is (not eager)
    if api == "events":
        _event_counts_all_nonzero(res)
        table = format_table(res)
        assert "resumes (growing / shrinking hit)" in table and "positions delivered (builder / local)" in table


@needs_manager
def test_cli_simulate_json_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from omni_prefix_cache.tools.cli import main

    for api in ("events", "seed"):
        argv = ["simulate", "--eager", "--arrival-steps", "15", "--json", "--quiet", "--torch-threads", "0"]
        rc = main([*argv, "--api", api])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["ok"] and out["mismatches"] == 0
        assert out["api"] == api and bool(out["delivery"]) is (api == "events")


@needs_manager
def test_bench_smoke_report_has_fields() -> None:
    from omni_prefix_cache.tools.bench import format_report, run_bench

    rep = run_bench(["decode"], iters=3, warmup=1, sweep=False, modes=("eager",))
    d = rep.to_dict()
    (r,) = d["results"]
    for key in (
        "engine_us_p50",
        "engine_us_p90",
        "materialize_us_p50",
        "materialize_us_p90",
        "engine_floor_us",
        "engine_ratio",
        "materialize_ratio",
        "tokens_per_s",
        "materialize_us_per_request",
        "staging_copy_us",
        "move_floor_us",
        "verdicts",
        "met",
    ):
        assert key in r
    assert r["steps"] == 3 and d["mode"] == "eager"
    assert {v["name"] for v in r["verdicts"]} == {"engine us/request", "materialize / floor"}
    assert r["move_floor_us"] >= r["staging_copy_us"] > 0
    # Every step's sum exceeds each of its parts, so the sums' median exceeds each part's median.
    assert r["step_us_p50"] > max(r["engine_us_p50"], r["materialize_us_p50"])
    assert r["step_cpu_us_p50"] > max(r["engine_cpu_us_p50"], r["materialize_cpu_us_p50"])
    report = format_report(rep)
    assert "decode" in report
    # The per-request target shows the same run's data-movement floor per request beside it.
    (line,) = [x for x in report.splitlines() if "engine us/request" in x and "target" in x and "not judged" not in x]
    floor = r["move_floor_us"] / r["requests_per_step"]
    assert line.endswith(f"staging copy + pool index_copy_ alone {floor:.2f} us"), line


@needs_manager
def test_bench_counts_the_engine_threads_page_faults_per_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page faults are read just outside each timed side: the engine calls'
    count is the delta across new_step_starts + save_outputs, materialize's
    the delta across materialize (a fake counter that jumps inside each)."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.tools import bench
    from omni_prefix_cache.tools.bench import measure

    faults = [0]
    real_save, real_mat = OmniPrefixCacheManager.save_outputs, OmniPrefixCacheManager.materialize

    def save(self: Any, *a: Any, **k: Any) -> Any:
        faults[0] += 5
        return real_save(self, *a, **k)

    def materialize(self: Any, *a: Any, **k: Any) -> Any:
        faults[0] += 3
        return real_mat(self, *a, **k)

    monkeypatch.setattr(measure, "RUSAGE_THREAD", 1)
    monkeypatch.setattr(measure, "thread_faults", lambda: faults[0])
    monkeypatch.setattr(OmniPrefixCacheManager, "save_outputs", save)
    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", materialize)
    rep = bench.run_bench(["decode"], iters=3, warmup=1, sweep=False, modes=("eager",))
    (r,) = rep.results
    assert (r.engine_faults_p50, r.materialize_faults_p50) == (5, 3)
    assert "page faults per step: engine 5, materialize 3" in bench.format_report(rep)


def test_bench_sweep_fit_splits_fixed_and_per_request_cost() -> None:
    """The sweep's least-squares fit recovers a known fixed + per-request
    cost, and the fixed cost it allows is exactly the one at which the
    spread equals the target."""
    from omni_prefix_cache.tools.bench import BenchReport, ScenarioResult, fixed_cost_allowed, format_report, linear_fit

    assert linear_fit([(16, 1000.0), (64, 1000.0)]) == pytest.approx((1000.0, 0.0))
    assert linear_fit([(16, 1.0), (16, 2.0)]) is None
    a, b = linear_fit([(16, 900 + 16 * 57.0), (64, 900 + 64 * 57.0), (256, 900 + 256 * 57.0)]) or (0, 0)
    assert (a, b) == (pytest.approx(900.0), pytest.approx(57.0))
    allowed = fixed_cost_allowed(57.0, 16, 256, 1.3)
    assert allowed is not None
    spread = (allowed / 16 + 57.0) / (allowed / 256 + 57.0)
    assert spread == pytest.approx(1.3)
    assert fixed_cost_allowed(57.0, 16, 256, 1.0) == pytest.approx(0.0)
    assert fixed_cost_allowed(0.0, 16, 256, 1.3) is None
    assert fixed_cost_allowed(57.0, 16, 32, 3.0) == float("inf")  # 32/16 < 3: any fixed cost is within

    def row(n: int) -> ScenarioResult:
        return ScenarioResult(
            name=f"decode_{n}", mode="eager", steps=1, requests_per_step=float(n), tokens_per_step=float(n),
            engine_us_p50=900 + 57.0 * n, engine_us_p90=0.0, materialize_us_p50=0.0, materialize_us_p90=0.0,
            engine_floor_us=1.0, materialize_floor_us=1.0, engine_ratio=1.0, materialize_ratio=1.0,
            tokens_per_s=1.0, engine_us_per_request=(900 + 57.0 * n) / n, materialize_us_per_request=0.0,
        )  # fmt: skip

    rep = BenchReport(("eager",), 1, [], [row(16), row(64), row(256)], sweep_spread=1.9, sweep_cpu_spread=1.9)
    assert rep.sweep_fit == (pytest.approx(900.0), pytest.approx(57.0))
    assert rep.to_dict()["sweep_fixed_allowed_us"] == pytest.approx(allowed)
    report = format_report(rep)
    assert "fit (least squares of engine p50): 900 us fixed per step + 57.00 us per request" in report
    assert f"it would need fixed <= {allowed:.0f} us at that per-request cost" in report


@needs_manager
def test_bench_forward_is_slept_between_the_engine_calls_and_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``forward_us``: the engine thread sleeps that long after each
    new_step_starts, before its save_outputs; the engine time leaves it out
    (a 60 ms forward against a decode step of a few ms)."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.tools import bench
    from omni_prefix_cache.tools.bench import measure

    calls: list[str] = []
    real_sleep, real_new, real_save = (
        measure.time.sleep,
        OmniPrefixCacheManager.new_step_starts,
        OmniPrefixCacheManager.save_outputs,
    )
    monkeypatch.setattr(measure.time, "sleep", lambda s: (calls.append(f"sleep {s}"), real_sleep(s))[1])
    monkeypatch.setattr(
        OmniPrefixCacheManager, "new_step_starts", lambda self, *a: (calls.append("new"), real_new(self, *a))[1]
    )
    monkeypatch.setattr(
        OmniPrefixCacheManager,
        "save_outputs",
        lambda self, *a, **k: (calls.append("save"), real_save(self, *a, **k))[1],
    )
    rep = bench.run_bench(["decode"], iters=2, warmup=1, sweep=False, modes=("eager",), forward_us=60_000)
    (r,) = rep.results
    assert calls == ["new", "sleep 0.06", "save"] * 3
    assert r.forward_us == 60_000 and r.engine_us_p50 < 60_000 and r.step_us_p50 < 60_000
    assert "forward: 60000 us slept by the engine thread" in bench.format_report(rep)


@needs_manager
def test_bench_runs_both_modes_and_compares_with_a_baseline(tmp_path: Any) -> None:
    from omni_prefix_cache.tools.bench import format_report, run_bench

    first = run_bench(["decode_mm4"], iters=2, warmup=1, sweep=False)
    assert [(r.name, r.mode) for r in first.results] == [("decode_mm4", "eager"), ("decode_mm4", "threaded")]
    path = tmp_path / "base.json"
    path.write_text(json.dumps(first.to_dict()))
    again = run_bench(["decode_mm4"], iters=2, warmup=1, sweep=False, baseline=str(path))
    for r, b in zip(again.results, first.results):
        assert r.engine_vs_baseline is not None and r.engine_vs_baseline > 0
        # Only a threaded run has a committer thread whose CPU clock the bench reads.
        assert (r.committer_cpu_materialize_us_p50 is None) == (r.mode == "eager"), r
        # The step total is compared as raw wall time with the sum of the baseline's two medians.
        assert r.step_vs_baseline == pytest.approx(r.step_us_p50 / (b.engine_us_p50 + b.materialize_us_p50))
        assert r.materialize_wall_vs_baseline == pytest.approx(r.materialize_us_p50 / b.materialize_us_p50)
        assert r.baseline_materialize_floor_us == pytest.approx(b.materialize_floor_us)
    report = format_report(again)
    assert "against the baseline" in report
    step_verdicts = [line for line in report.splitlines() if line.split()[2:3] == ["engine+materialize"]]
    assert len(step_verdicts) == 2, report  # one per mode
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a bench --json report"):
        run_bench(["decode_mm4"], iters=1, warmup=0, sweep=False, baseline=str(path))


def _side_rows(report: str) -> list[list[str]]:
    """The rows of the ``--metrics both`` table (split on whitespace)."""
    lines = report.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("metrics off vs on")) + 3
    rows = []
    for line in lines[start:]:
        fields = line.split()
        if len(fields) != 11:  # scenario, mode, 3 + 3 engine and materialize, 2 ratios, first
            break
        rows.append(fields)
    return rows


def _check_printed_ratios(rows: list[list[str]]) -> None:
    """Each printed on/off equals on / off of the two p50s printed beside it."""
    for name, mode, eng_off, eng_on, eng_x, mat_off, mat_on, mat_x, *_ in rows:
        for off, on, x in ((eng_off, eng_on, eng_x), (mat_off, mat_on, mat_x)):
            assert x.endswith("x"), (name, mode, x)
            # The p50s are printed to 0.1 us, the ratio to 0.01.
            assert float(x[:-1]) == pytest.approx(float(on) / float(off), abs=0.006), (name, mode, off, on, x)


def test_bench_metrics_both_table_prints_on_over_off_of_its_rows() -> None:
    """The side-by-side table: one row per pair, off and on p50s as measured,
    each ratio on / off of them (not off / on, not of another row)."""
    from omni_prefix_cache.tools.bench import BenchReport, MetricsPair, ScenarioResult, format_report

    def row(name: str, mode: str, engine: float, mat: float) -> ScenarioResult:
        return ScenarioResult(
            name=name, mode=mode, steps=4, requests_per_step=64.0, tokens_per_step=64.0,
            engine_us_p50=engine, engine_us_p90=engine, materialize_us_p50=mat, materialize_us_p90=mat,
            engine_floor_us=10.0, materialize_floor_us=10.0, engine_ratio=engine / 10, materialize_ratio=mat / 10,
            tokens_per_s=1.0, engine_us_per_request=engine / 64, step_us_p50=engine + mat,
            engine_cpu_us_p50=engine * 0.9,
        )  # fmt: skip

    pairs = [
        MetricsPair(row("decode", "eager", 900.0, 200.0), row("decode", "eager", 1350.0, 230.0), ("off", "on")),
        MetricsPair(row("decode", "threaded", 800.0, 460.0), row("decode", "threaded", 880.0, 690.0), ("on", "off")),
    ]
    rep = BenchReport(
        ("eager", "threaded"), 1, [p.off for p in pairs], [], metrics_sides=("off", "on"), metrics_pairs=pairs
    )
    report = format_report(rep)
    rows = _side_rows(report)
    assert [r[:2] for r in rows] == [["decode", "eager"], ["decode", "threaded"]]
    assert [r[2:8] for r in rows] == [
        ["900.0", "1350.0", "1.50x", "200.0", "230.0", "1.15x"],
        ["800.0", "880.0", "1.10x", "460.0", "690.0", "1.50x"],
    ]
    assert [r[8] for r in rows] == ["1.44x", "1.25x"]  # step total: 1580 / 1100, 1570 / 1260
    assert [r[-1] for r in rows] == ["off", "on"]  # which side ran first
    _check_printed_ratios(rows)
    side = rep.to_dict()["metrics_side_by_side"]
    assert side[1]["ratios"]["engine_us_p50"] == pytest.approx(1.1)
    assert side[1]["ratios"]["materialize_us_p50"] == pytest.approx(1.5)
    assert side[1]["order"] == ["on", "off"]
    assert side[0]["off"]["engine_us_p50"] == 900.0 and side[0]["on"]["engine_us_p50"] == 1350.0


@needs_manager
def test_bench_metrics_both_runs_every_scenario_and_mode_off_and_on_back_to_back() -> None:
    """``metrics="both"``: each (scenario, mode) is run off then on (the
    next pair on then off), the off side's managers built with the process
    switch off, the on side's with ``metrics=True``; the report's results are
    the off side, both sides ran the same steps, the on run recorded spec
    moves, and the switch is off again after."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.telemetry.registry import TELEMETRY
    from omni_prefix_cache.tools.bench import format_report, run_bench

    assert not TELEMETRY.enabled
    built: list[tuple[bool, bool, bool]] = []

    def factory(cfg: Any, view: Any, eager: bool) -> Any:
        built.append((cfg.metrics, TELEMETRY.enabled, eager))
        return OmniPrefixCacheManager(cfg, view, eager=eager)

    rep = run_bench(["decode"], iters=3, warmup=1, sweep=False, manager_factory=factory, metrics="both")
    assert built == [(False, False, True), (True, False, True), (True, False, False), (False, False, False)]
    assert not TELEMETRY.enabled
    assert [(p.name, p.mode, p.order) for p in rep.metrics_pairs] == [
        ("decode", "eager", ("off", "on")),
        ("decode", "threaded", ("on", "off")),
    ]
    assert rep.results == [p.off for p in rep.metrics_pairs]
    for p in rep.metrics_pairs:
        assert (p.on.name, p.on.mode, p.on.steps, p.on.requests_per_step) == (
            p.off.name,
            p.off.mode,
            p.off.steps,
            p.off.requests_per_step,
        )
        assert p.on_metrics["enabled"] and sum(m["count"] for m in p.on_metrics["moves"]) > 0
    d = rep.to_dict()
    assert d["metrics_sides"] == ["off", "on"] and [r["mode"] for r in d["results"]] == ["eager", "threaded"]
    assert [s["ratios"]["engine_us_p50"] for s in d["metrics_side_by_side"]] == pytest.approx(
        [p.on.engine_us_p50 / p.off.engine_us_p50 for p in rep.metrics_pairs]
    )
    report = format_report(rep)
    rows = _side_rows(report)
    assert [r[:2] for r in rows] == [["decode", "eager"], ["decode", "threaded"]]
    _check_printed_ratios(rows)
    # The main table shows the off side only: one engine row per mode.
    table = [x.split() for x in report[: report.index("metrics off vs on")].splitlines() if x.startswith("decode ")]
    assert [(f[1], f[3]) for f in table if f[2] == "engine"] == [
        (p.mode, f"{p.off.engine_us_p50:.1f}") for p in rep.metrics_pairs
    ]


@needs_manager
def test_bench_cli_json_keeps_its_keys_and_adds_the_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --json``: the default (``--metrics both``) keeps every key of a
    one-sided run, its results and ``metrics`` being the off side's, and adds
    the pairs; ``--metrics off`` has no pairs; ``on`` carries the summary."""
    from omni_prefix_cache.telemetry.registry import TELEMETRY
    from omni_prefix_cache.tools.cli import main

    args = ["bench", "--scenario", "decode", "--mode", "eager", "--no-sweep", "--iters", "2", "--warmup", "1"]
    args += ["--json", "--baseline", ""]
    outs = {}
    for metrics in ("both", "off", "on"):
        assert main(args if metrics == "both" else [*args, "--metrics", metrics]) == 0
        outs[metrics] = json.loads(capsys.readouterr().out)
    TELEMETRY.disable()  # --metrics on leaves the process switch on, as a manager built with metrics does
    both, off, on = outs["both"], outs["off"], outs["on"]
    assert set(off) <= set(both) and set(off) == set(on)
    assert both["metrics_sides"] == ["off", "on"] and off["metrics_sides"] == ["off"] and on["metrics_sides"] == ["on"]
    assert off["metrics_side_by_side"] == [] and on["metrics_side_by_side"] == []
    assert off["metrics"] == {"enabled": False} and both["metrics"] == {"enabled": False}
    assert on["metrics"]["enabled"] and on["metrics"]["moves"]
    (pair,) = both["metrics_side_by_side"]
    assert (pair["name"], pair["mode"]) == ("decode", "eager")
    assert pair["off"] == both["results"][0]
    assert pair["on"]["steps"] == pair["off"]["steps"] == 2
    assert pair["ratios"]["materialize_us_p50"] == pytest.approx(
        pair["on"]["materialize_us_p50"] / pair["off"]["materialize_us_p50"]
    )


# ------------------------------------------------------------ bench --scrape


def _scrape_rows(report: str) -> list[list[str]]:
    """The rows of the ``--scrape`` table (split on whitespace)."""
    lines = report.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("scraping the collector at")) + 3
    rows = []
    for line in lines[start:]:
        fields = line.split()
        if len(fields) != 12:  # scenario, mode, 3 engine, 3 step, scrapes, of, scrape us, first
            break
        rows.append(fields)
    return rows


def _check_scrape_ratios(rows: list[list[str]]) -> None:
    """Each printed with/without equals with / without of the p50s printed beside it."""
    for name, mode, eng_wo, eng_w, eng_x, step_wo, step_w, step_x, *_ in rows:
        for without, scraped, x in ((eng_wo, eng_w, eng_x), (step_wo, step_w, step_x)):
            assert x.endswith("x"), (name, mode, x)
            assert float(x[:-1]) == pytest.approx(float(scraped) / float(without), abs=0.006), (name, mode, x)


def test_bench_scrape_table_prints_with_over_without_and_the_scrapes() -> None:
    """The scrape table: one row per pair, the p50s without and with as
    measured, each ratio with / without of them, the scrapes done out of the
    schedule's slots, their p50, and which side ran first; ``--json`` carries
    the pairs under ``scrape_side_by_side``."""
    from omni_prefix_cache.tools.bench import BenchReport, ScenarioResult, ScrapePair, ScrapeStats, format_report

    def row(mode: str, engine: float, step: float) -> ScenarioResult:
        return ScenarioResult(
            name="decode", mode=mode, steps=4, requests_per_step=64.0, tokens_per_step=64.0,
            engine_us_p50=engine, engine_us_p90=engine, materialize_us_p50=step - engine,
            materialize_us_p90=step - engine, engine_floor_us=10.0, materialize_floor_us=10.0,
            engine_ratio=engine / 10, materialize_ratio=1.0, tokens_per_s=1.0, engine_us_per_request=engine / 64,
            step_us_p50=step,
        )  # fmt: skip

    pairs = [
        ScrapePair(row("eager", 900.0, 1100.0), row("eager", 990.0, 1320.0), ("without", "with"),
                   ScrapeStats(hz=10.0, scrapes=4, window_s=0.45, us_p50=2104.4, us_max=2900.0)),
        ScrapePair(row("threaded", 800.0, 1250.0), row("threaded", 760.0, 1500.0), ("with", "without"),
                   ScrapeStats(hz=10.0, scrapes=0, window_s=0.05, us_p50=None, us_max=None)),
    ]  # fmt: skip
    rep = BenchReport(("eager", "threaded"), 1, [p.without for p in pairs], [], scrape_pairs=pairs)
    report = format_report(rep)
    assert "scraping the collector at 10 Hz" in report
    rows = _scrape_rows(report)
    assert [r[:8] for r in rows] == [
        ["decode", "eager", "900.0", "990.0", "1.10x", "1100.0", "1320.0", "1.20x"],
        ["decode", "threaded", "800.0", "760.0", "0.95x", "1250.0", "1500.0", "1.20x"],
    ]
    assert [r[8:] for r in rows] == [["4", "5", "2104", "without"], ["0", "1", "-", "with"]]
    _check_scrape_ratios(rows)
    side = rep.to_dict()["scrape_side_by_side"]
    assert side[0]["ratios"]["engine_us_p50"] == pytest.approx(1.1)
    assert side[1]["ratios"]["engine_us_p50"] == pytest.approx(0.95)
    assert side[1]["order"] == ["with", "without"]
    assert side[0]["scrape"] == {
        "hz": 10.0, "scrapes": 4, "window_s": 0.45, "us_p50": 2104.4, "us_max": 2900.0, "scheduled": 5
    }  # fmt: skip
    assert side[0]["without"]["engine_us_p50"] == 900.0 and side[0]["with"]["engine_us_p50"] == 990.0
    assert "scraping the collector" not in format_report(replace(rep, scrape_pairs=[]))


@needs_manager
def test_bench_scrape_runs_the_collector_at_its_rate_across_the_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scrape_hz``: after the main runs, each (scenario, mode) without and
    with scraping, the first side alternating, every manager of those pairs
    built with metrics on; the scraped side's thread called the real
    collector's ``collect()`` as many times as it reports, about ``hz`` times
    a second of its window (never more than the schedule's slots: it does not
    scrape back to back), and the window spans the timed steps."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.ops.metrics import OmniPrefixCacheCollector
    from omni_prefix_cache.telemetry.registry import TELEMETRY
    from omni_prefix_cache.tools.bench import format_report, run_bench

    collected: list[bool] = []
    real_collect = OmniPrefixCacheCollector.collect

    def counting_collect(self: OmniPrefixCacheCollector) -> Any:
        collected.append(TELEMETRY.enabled)
        return real_collect(self)

    monkeypatch.setattr(OmniPrefixCacheCollector, "collect", counting_collect)
    built: list[tuple[bool, bool]] = []

    def factory(cfg: Any, view: Any, eager: bool) -> Any:
        built.append((cfg.metrics, eager))
        return OmniPrefixCacheManager(cfg, view, eager=eager)

    hz, iters, forward_us = 50.0, 8, 30_000  # the forward sleeps make a window of >= 0.24 s
    assert not TELEMETRY.enabled
    rep = run_bench(
        ["decode"], iters=iters, warmup=1, sweep=False, manager_factory=factory, forward_us=forward_us, scrape_hz=hz
    )
    assert not TELEMETRY.enabled
    # Main runs (metrics off, as asked), then the two scrape pairs, metrics on in all four.
    assert built == [(False, True), (False, False), (True, True), (True, True), (True, False), (True, False)]
    assert [(p.name, p.mode, p.order) for p in rep.scrape_pairs] == [
        ("decode", "eager", ("without", "with")),
        ("decode", "threaded", ("with", "without")),
    ]
    assert len(collected) == sum(p.stats.scrapes for p in rep.scrape_pairs) and all(collected)
    for p in rep.scrape_pairs:
        st = p.stats
        assert st.hz == hz and st.window_s >= iters * forward_us / 1e6, (p.mode, st)
        assert hz * st.window_s / 2 - 1 <= st.scrapes <= st.scheduled == int(hz * st.window_s) + 1, (p.mode, st)
        assert st.us_p50 is not None and st.us_max is not None and 0 < st.us_p50 <= st.us_max
        assert p.without.steps == p.scraped.steps == iters
    rows = _scrape_rows(format_report(rep))
    assert [(r[1], int(r[8]), r[-1]) for r in rows] == [
        ("eager", rep.scrape_pairs[0].stats.scrapes, "without"),
        ("threaded", rep.scrape_pairs[1].stats.scrapes, "with"),
    ]
    _check_scrape_ratios(rows)


@pytest.mark.parametrize("value", ["-1", "-0.5", "x", "nan", "inf"])
def test_bench_scrape_rate_must_be_a_non_negative_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_prefix_cache.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--scrape", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --scrape" in err and "Traceback" not in err


def test_bench_scrape_rate_is_checked_before_anything_runs() -> None:
    from omni_prefix_cache.tools.bench import run_bench

    for hz in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scrape rate must be a finite number of Hz >= 0"):
            run_bench(["decode"], iters=1, warmup=0, sweep=False, scrape_hz=hz)


@needs_manager
def test_bench_cli_json_carries_the_scrape_pairs_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --json``: no ``--scrape`` (the default) runs no scrape pair;
    ``--scrape 20`` adds one per (scenario, mode) and leaves the rest alone."""
    from omni_prefix_cache.tools.cli import main

    args = ["bench", "--scenario", "decode", "--mode", "eager", "--no-sweep", "--iters", "2", "--warmup", "1"]
    args += ["--json", "--baseline", "", "--metrics", "off"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--scrape", "20"]) == 0
    scraped = json.loads(capsys.readouterr().out)
    assert plain["scrape_side_by_side"] == [] and set(plain) == set(scraped)
    (pair,) = scraped["scrape_side_by_side"]
    assert (pair["name"], pair["mode"], pair["order"]) == ("decode", "eager", ["without", "with"])
    assert pair["scrape"]["hz"] == 20.0 and 0 <= pair["scrape"]["scrapes"] <= pair["scrape"]["scheduled"]
    assert pair["with"]["steps"] == pair["without"]["steps"] == 2
    assert scraped["metrics"] == {"enabled": False} and scraped["metrics_sides"] == ["off"]


# ------------------------------------------------------------ speculative decoding (issue 47)


@needs_manager
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("lag", [False, True])
def test_speculative_decoding_delivers_accepted_rows_only(k: int, lag: bool) -> None:
    res = run_simulation(replace(SMALL, spec_tokens=k, eager=not lag, lag=lag))
    assert res.error is None, res.error
    assert res.mismatches == 0 and not res.leaked, res.mismatch_details
    st = res.scheduler
    # Steps drafted, some drafts were rejected, and hits landed on blocks a rejected draft's row held.
    assert st["draft_steps"] > 0 and 0 < st["drafts_accepted"] < st["drafts"]
    assert st["hits_over_rejected"] > 0
    assert "speculative steps / drafts" in format_table(res)


class _DraftsDelivered:
    """Delegates to a manager; drops the accepted rows a drafted step's materialize gets."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def materialize(self, step_id: int, req_ids: list[str], **kw: Any) -> StageCacheOutputs:
        return self._inner.materialize(step_id, req_ids)


@needs_manager
def test_a_drafted_step_materialized_without_accepted_rows_fails_the_run() -> None:
    res = run_simulation(
        replace(SMALL, spec_tokens=2), manager_factory=lambda c, v, e: _DraftsDelivered(_base("manager", c, v, e))
    )
    assert not res.ok and res.error is not None and "have speculative drafts" in res.error


def test_spec_tokens_needs_the_event_api() -> None:
    with pytest.raises(ValueError, match="spec_tokens needs the event API"):
        run_simulation(replace(SMALL, spec_tokens=2, api="seed"))
