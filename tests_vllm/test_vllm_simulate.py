"""The simulation's workload on vLLM's real v1 scheduler and InputBatch, every row checked by the oracle."""

from __future__ import annotations

import dataclasses
import random

import pytest

from omni_prefix_cache.tools.simulate import SimConfig
from omni_prefix_cache.tools.simulate.vllm_engine import VllmOptions, VllmSimResult
from omni_prefix_cache.tools.simulate.vllm_events import run_vllm_simulation
from omni_prefix_cache.tools.simulate.workload import FollowupSpec, RequestSpec

V1 = VllmOptions()  # 0.33 default runner: a resumed request is a cached one, in resumed_req_ids
V2 = VllmOptions(resumed_as_new=True)  # Model Runner V2: a resumed request is among the new ones


def _replay(mode: str, seed: int, opts: VllmOptions, api: str = "events") -> str:
    if opts.resumed_as_new:  # no CLI flag for the V2 reporting: replay from Python
        return (
            "replay: .venv-vllm/bin/python -c 'from omni_prefix_cache.tools.simulate.vllm_events import *; "
            "from omni_prefix_cache.tools.simulate.vllm_engine import VllmOptions; "
            f"from omni_prefix_cache.tools.simulate import SimConfig; print(run_vllm_simulation(SimConfig(seed={seed}, "
            f"eager={mode == 'eager'}), VllmOptions(resumed_as_new=True), api={api!r}).mismatch_details)'"
        )
    return f"replay: .venv-vllm/bin/omni-prefix-cache simulate --engine vllm --api {api} --{mode} --seed {seed}"


def _check(res: VllmSimResult, replay: str) -> None:
    """The verdicts every run must pass: no error, no mismatch, nothing leaked, view read on the engine thread."""
    details = "\n".join(res.mismatch_details)
    assert res.error is None, f"{res.error}\n{replay}"
    assert res.mismatches == 0, f"{res.mismatches} mismatches:\n{details}\n{replay}"
    assert res.rows_checked > 0, replay
    assert all(v == 0 for v in res.leaks.values()), f"leaks {res.leaks} (None: probe found no such table)\n{replay}"
    assert res.view_off_thread_calls == 0, f"group view read off the engine thread\n{replay}"


def _line(res: VllmSimResult, seed: int) -> str:
    st, blocks = res.scheduler, res.allocator
    leaks = sum(v or 0 for v in res.leaks.values())
    return (
        f"{res.mode:8} seed {seed} runner {res.runner[:2]}: steps {res.steps}, hits {st['hits']} "
        f"({st['same_step_hits']} same-step), preemptions {st['preemptions']} "
        f"(resumed via cached {st['resumed_in_cached']} / via new {st['resumed_in_new']}), "
        f"same-step id reuse {st['same_step_id_reuse']}, blocks recycled {blocks['recycled']}, "
        f"batch reorders {st['reordered_steps']}, rows checked {res.rows_checked}, "
        f"mismatches {res.mismatches}, leaks {leaks}, {res.wall_s:.1f} s{_event_line(res)}"
    )


def _event_line(res: VllmSimResult) -> str:
    ev = res.events
    if not ev:
        return " [seed API]"
    return (
        f" [events: RESUMED {ev['resumed']} (unaligned {ev['resumed_unaligned']}), recovering "
        f"{ev['recovered']} ({ev['recovered_positions']} positions, {ev['recovered_after_discard']} after a discard), "
        f"shrinking {ev['shrinking']}, discard preemptions {ev['discard_preemptions']}, fenced {ev['fenced']}, "
        f"delivered output {ev['delivered']['output']} / talker {ev['delivered']['talker']}]"
    )


MATRIX = [(mode, seed, V1, "events") for seed in (0, 1, 2) for mode in ("eager", "threaded")]
MATRIX += [("eager", 3, V2, "events"), ("threaded", 4, V2, "events")]
# The seed-era loop stays verified on the same real scheduler.
MATRIX += [("eager", 0, V1, "seed"), ("threaded", 1, V1, "seed"), ("threaded", 4, V2, "seed")]
IDS = [f"{a}-{m}-seed{s}-{'v2' if o.resumed_as_new else 'v1'}" for m, s, o, a in MATRIX]


@pytest.mark.parametrize(("mode", "seed", "opts", "api"), MATRIX, ids=IDS)
def test_workload_on_real_scheduler(mode: str, seed: int, opts: VllmOptions, api: str, v, run_lines: list[str]) -> None:
    """Default simulate config (96 KV blocks): preemption, block recycling and id reuse must all occur;
    on the event API, every real preemption resumes as a RESUMED event and both consumers get every
    position of every incarnation exactly once, in order (the delivery oracle, in ``mismatches``)."""
    res = run_vllm_simulation(SimConfig(seed=seed, eager=mode == "eager"), opts, api=api)
    run_lines.append(_line(res, seed))
    replay = _replay(mode, seed, opts, api)
    _check(res, replay)
    st = res.scheduler
    assert st["hits"] > 0 and st["same_step_hits"] > 0, f"no prefix hits {st}\n{replay}"
    assert st["preemptions"] > 0 and st["resumes"] > 0, f"no preemption with the small KV pool {st}\n{replay}"
    assert res.allocator["recycled"] > 0 and res.allocator["evicted_hashes"] > 0, f"{res.allocator}\n{replay}"
    assert res.allocator["null_block_in_table"] == 0, f"vLLM's null block 0 reached a request {res.allocator}"
    if opts.resumed_as_new:
        assert st["resumed_in_new"] == st["resumes"] and st["resumed_in_cached"] == 0, f"{st}\n{replay}"
    else:
        assert st["resumed_in_cached"] == st["resumes"] and st["resumed_in_new"] == 0, f"{st}\n{replay}"
    assert st["same_step_id_reuse"] > 0 and st["abort_resubmits"] > 0, f"{st}\n{replay}"
    assert st["reordered_steps"] > 0, f"the decode-first reorder never moved a row {st}\n{replay}"
    if api == "events":
        _check_events(res, replay)


OFFLOAD = [("eager", 0), ("threaded", 0), ("threaded", 1)]


@pytest.mark.parametrize(("mode", "seed"), OFFLOAD, ids=[f"{m}-seed{s}" for m, s in OFFLOAD])
def test_workload_behind_kv_offload(mode: str, seed: int, v, run_lines: list[str]) -> None:
    """The workload behind vLLM's OffloadingConnector and the host tier's wrapper: hits loaded
    from offload into new blocks (and later local hits on those blocks) get exactly their own rows.
    (Seed 0 threaded once lost a load vLLM allocated in the step that preempted its request.)"""
    res = run_vllm_simulation(SimConfig(seed=seed, eager=mode == "eager"), VllmOptions(kv_offload=True))
    run_lines.append(_line(res, seed) + " (kv offload)")
    replay = f"replay: .venv-vllm/bin/omni-prefix-cache simulate --engine vllm --kv-offload --{mode} --seed {seed}"
    _check(res, replay)
    tier = {k: v for k, v in res.manager_stats.items() if k.startswith("host_tier_")}
    assert tier["host_tier_restored"] > 0 and tier["host_tier_filled"] > 0, (
        f"no load served from the tier {tier}\n{replay}"
    )
    assert tier["host_tier_lost"] == 0, f"{tier}\n{replay}"


# ------------------------------------------------------------ hybrid KV cache layouts

HYBRID = [
    ("hybrid-sw-first", "eager", 0, V1, "events"),
    ("hybrid-sw-first", "threaded", 1, V1, "events"),
    ("hybrid-full-first", "eager", 2, V1, "events"),
    ("hybrid-full-first", "threaded", 0, V1, "events"),
    ("hybrid-mamba", "eager", 1, V1, "events"),
    ("hybrid-mamba", "threaded", 2, V1, "events"),
    ("hybrid-sw-first", "threaded", 3, V2, "events"),
    ("hybrid-full-first", "threaded", 4, V1, "seed"),
]
HYBRID_IDS = [f"{a}-{lay}-{m}-seed{s}-{'v2' if o.resumed_as_new else 'v1'}" for lay, m, s, o, a in HYBRID]


def _hybrid_replay(layout: str, mode: str, seed: int, offload: bool = False, api: str = "events") -> str:
    flags = " --kv-offload" if offload else ""
    return (
        f"replay: .venv-vllm/bin/omni-prefix-cache simulate --engine vllm --kv-layout {layout}{flags} "
        f"--api {api} --{mode} --seed {seed}"
    )


@pytest.mark.parametrize(("layout", "mode", "seed", "opts", "api"), HYBRID, ids=HYBRID_IDS)
def test_hybrid_layout_on_real_scheduler(
    layout: str, mode: str, seed: int, opts: VllmOptions, api: str, v, run_lines: list[str]
) -> None:
    """A hybrid model's KV cache groups (a sliding-window group of 2 blocks before or after the
    full-attention one, or a Mamba group in align mode before it) in vLLM's real scheduler and
    InputBatch: the gate keys the rows by the full-attention group, hits longer than the window
    (vLLM's null block in the other group) serve exactly their own rows, through preemption."""
    opts = dataclasses.replace(opts, kv_layout=layout)
    res = run_vllm_simulation(SimConfig(seed=seed, eager=mode == "eager"), opts, api=api)
    run_lines.append(_line(res, seed) + f" ({layout})")
    replay = _hybrid_replay(layout, mode, seed, api=api)
    if opts.resumed_as_new:
        replay += " (Model Runner V2 reporting: VllmOptions(resumed_as_new=True), from Python)"
    _check(res, replay)
    st = res.scheduler
    assert st["hits"] > 0 and st["hits_past_window"] > 0, f"no hit past the other group's window {st}\n{replay}"
    assert st["preemptions"] > 0 and st["resumes"] > 0, f"{st}\n{replay}"
    assert res.allocator["null_block_in_table"] == 0, f"vLLM's null block in the keyed group {res.allocator}"
    if api == "events":
        assert res.events["resumed"] == st["resumes"] and res.events["resumed_unaligned"] == 0, res.events


HYBRID_OFFLOAD = [
    ("hybrid-sw-first", "threaded", 0),
    ("hybrid-full-first", "eager", 1),
    ("hybrid-mamba", "threaded", 0),
]


@pytest.mark.parametrize(
    ("layout", "mode", "seed"), HYBRID_OFFLOAD, ids=[f"{lay}-{m}-seed{s}" for lay, m, s in HYBRID_OFFLOAD]
)
def test_hybrid_layout_behind_kv_offload(layout: str, mode: str, seed: int, v, run_lines: list[str]) -> None:
    """The hybrid layouts behind the tier wrapper around vLLM's OffloadingConnector: the tier keys
    its hashes by the full-attention group's blocks and restores them into the blocks a load fills."""
    opts = VllmOptions(kv_offload=True, kv_layout=layout)
    res = run_vllm_simulation(SimConfig(seed=seed, eager=mode == "eager"), opts)
    run_lines.append(_line(res, seed) + f" (kv offload, {layout})")
    replay = _hybrid_replay(layout, mode, seed, offload=True)
    _check(res, replay)
    tier = {k: v for k, v in res.manager_stats.items() if k.startswith("host_tier_")}
    assert tier["host_tier_restored"] > 0 and tier["host_tier_lost"] == 0, f"{tier}\n{replay}"
    assert res.scheduler["hits_past_window"] > 0, f"{res.scheduler}\n{replay}"


def test_rows_keyed_by_the_sliding_window_group_fail_loudly(v, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the gate picks the full-attention group: keyed by the sliding-window group (gate
    bypassed), a hit longer than the window reads vLLM's null block and materialize fails
    loudly; the driver's own check of the keyed group's rows catches it first."""
    import omni_prefix_cache.tools.simulate.vllm_setup as setup
    from omni_prefix_cache.tools.simulate.vllm_engine import VllmSimulation

    gate = setup.stage_config
    monkeypatch.setattr(setup, "stage_config", lambda c, k: dataclasses.replace(gate(c, k), kv_cache_group_index=0))
    opts = VllmOptions(kv_layout="hybrid-sw-first")
    checked = run_vllm_simulation(SimConfig(seed=0, eager=True), opts)
    assert checked.error is not None and "group 0 blocks=" in checked.error, checked.error
    monkeypatch.setattr(VllmSimulation, "_check_rows", lambda self, plan, order: None)
    res = run_vllm_simulation(SimConfig(seed=0, eager=True), opts)
    assert res.error is not None and "were never written (ABSENT)" in res.error, res.error


def _check_events(res: VllmSimResult, replay: str) -> None:
    """What the event API must have exercised on the real scheduler."""
    ev, st = res.events, res.scheduler
    assert ev["resumed"] == st["resumes"] > 0, f"every resume is a RESUMED event {ev} {st}\n{replay}"
    assert ev["resumed_unaligned"] == 0, f"vLLM resumed a request at a hit that is not block aligned {ev}\n{replay}"
    assert ev["recovered"] > 0 and ev["recovered_after_discard"] > 0, f"no cache recovery {ev}\n{replay}"
    assert ev["shrinking"] > 0 and ev["replayed_positions"] > 0, f"no shrinking resume {ev}\n{replay}"
    assert ev["discard_preemptions"] > 0 and res.discarded_steps > 0, f"{ev}\n{replay}"
    delivered = ev["delivered"]
    assert delivered["output"] > 0 and delivered["talker"] >= delivered["output"], f"{ev}\n{replay}"
    assert ev["max_consumer_lag"] > 1, f"the talker never lagged {ev}\n{replay}"


# ------------------------------------------------------------ directed traces


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(32000) for _ in range(n))


def _run(trace: list[RequestSpec], opts: VllmOptions = V1, *, eager: bool = True, **cfg: int) -> VllmSimResult:
    res = run_vllm_simulation(SimConfig(seed=7, eager=eager, discard_prob=0.0, **cfg), opts, trace=trace)
    _check(res, f"directed trace {trace}")
    return res


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_finished_id_reused_in_the_same_step_after_finish(eager: bool, v) -> None:
    """A second turn under the finished turn's id: in one step the id is finished and new, and it hits."""
    rng = random.Random(1)
    turn2 = FollowupSpec(delay=0, extra=_prompt(rng, 20), max_output=3, reuse_id=True)
    res = _run([RequestSpec("a", 0, (_prompt(rng, 40),), max_output=2, followup=turn2)], eager=eager)
    st = res.scheduler
    assert st["same_step_id_reuse"] == 1 and st["reused_ids"] == 1, st
    assert st["hits"] == 1 and st["hit_tokens"] == 32, st  # 42 tokens known, 2 full blocks cached


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_aborted_id_resubmitted_in_the_same_step(eager: bool, v) -> None:
    """vLLM's NOTE in _update_states: an aborted request resubmitted under its id is a new request."""
    rng = random.Random(2)
    res = _run([RequestSpec("a", 0, (_prompt(rng, 40),), max_output=8, abort_after=2)], eager=eager)
    st = res.scheduler
    assert st["abort_resubmits"] == 1 and st["same_step_id_reuse"] == 1, st
    assert st["hits"] == 1 and st["hit_tokens"] == 32, st  # the retry hits the blocks the abort freed


@pytest.mark.parametrize("opts", [V1, V2], ids=["resumed-in-cached", "resumed-in-new"])
def test_preempted_request_resumes_either_way(opts: VllmOptions, v) -> None:
    """Two requests outgrow an 8-block pool: one is preempted and resumes; it is live, so never a hit."""
    rng = random.Random(3)
    trace = [RequestSpec(r, 0, (_prompt(rng, 40),), max_output=30) for r in ("a", "b")]
    res = _run(trace, opts, num_blocks=8)
    st = res.scheduler
    assert st["preemptions"] >= 1 and st["resumes"] >= 1, st
    assert st["resumed_in_new" if opts.resumed_as_new else "resumed_in_cached"] == st["resumes"], st
    assert st["hits"] == 0, st
    assert st["finished"] == 2, st
    assert res.events["resumed"] == st["resumes"], (res.events, st)  # each one a RESUMED event
    assert res.events["delivered"]["output"] == res.events["delivered"]["talker"] == 2 * (40 + 29), res.events


def test_row_check_catches_a_stale_block_table(v, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step check of the mirrored InputBatch against vLLM's KV cache manager can fail:
    a runner that drops a running request's newly allocated blocks is reported, naming the row."""
    monkeypatch.setattr(v.MultiGroupBlockTable, "append_row", lambda self, block_ids, row_idx: None)
    rng = random.Random(4)
    res = run_vllm_simulation(
        SimConfig(seed=7, eager=True), V1, trace=[RequestSpec("a", 0, (_prompt(rng, 300),), max_output=2)]
    )
    assert res.error is not None and "vLLM has computed=256 blocks=" in res.error, res.error


# ------------------------------------------------------------ speculative decoding (issue 47)

SPEC = [(k, mode, seed) for k in (2, 4) for mode, seed in (("eager", 0), ("threaded", 1))]


@pytest.mark.parametrize(("k", "mode", "seed"), SPEC, ids=[f"K{k}-{m}-seed{s}" for k, m, s in SPEC])
def test_speculative_decoding_on_real_scheduler(k: int, mode: str, seed: int, v, run_lines: list[str]) -> None:
    """vLLM's real Scheduler with SpeculativeConfig(method="ngram", num_speculative_tokens=K): a fake
    runner proposes drafts (update_draft_token_ids, some wrong on purpose), verifies them greedily and
    returns sampled_token_ids; vLLM rolls back the rejected ones. Every delivered position of every
    incarnation reaches both consumers once, in order, with its row (0 wrong, 0 skipped, none past the
    accepted end: the oracle and the range check), nothing leaks; lagged output builders (threaded: the
    accepted rows given when the builder runs), preemptions, discards, and hits on blocks whose slots
    held a rejected draft's row all occur."""
    res = run_vllm_simulation(SimConfig(seed=seed, eager=mode == "eager", spec_tokens=k), V1)
    st, ev = res.scheduler, res.events
    run_lines.append(
        _line(res, seed) + f" [spec K={k}: steps {st['draft_steps']}, drafts {st['drafts']} "
        f"(accepted {st['drafts_accepted']}), hits over rejected-draft blocks {st['hits_over_rejected']}]"
    )
    replay = f"replay: .venv-vllm/bin/omni-prefix-cache simulate --engine vllm --spec-tokens {k} --{mode} --seed {seed}"
    _check(res, replay)
    assert st["draft_steps"] > 0 and 0 < st["drafts_accepted"] < st["drafts"], f"{st}\n{replay}"
    assert st["hits_over_rejected"] > 0, f"no hit on a block that held a rejected draft {st}\n{replay}"
    assert st["preemptions"] > 0 and ev["resumed"] == st["resumes"] > 0, f"{st} {ev}\n{replay}"
    assert res.discarded_steps > 0 and ev["discard_preemptions"] > 0, f"{ev}\n{replay}"
    assert ev["delivered"]["talker"] >= ev["delivered"]["output"] > 0, f"{ev}\n{replay}"


def test_speculative_decoding_directed(v) -> None:
    """One request decoding with K=4 on an otherwise idle scheduler: every drafted step's output ends
    at its accepted end, and both consumers get the whole stream exactly once."""
    rng = random.Random(5)
    res = run_vllm_simulation(
        SimConfig(seed=7, eager=True, discard_prob=0.0, spec_tokens=4),
        V1,
        trace=[RequestSpec("a", 0, (_prompt(rng, 40),), max_output=60)],
    )
    _check(res, "directed speculative trace")
    st = res.scheduler
    assert st["finished"] == 1 and st["draft_steps"] > 5 and st["drafts_accepted"] < st["drafts"], st
    assert res.events["delivered"]["output"] == res.events["delivered"]["talker"] == 40 + 59, res.events


def test_the_gate_takes_vllms_speculative_config(v) -> None:
    """stage_prefix_cache_config accepts vLLM 0.33's real SpeculativeConfig(method="ngram") and refuses
    the same config with adaptive verification (the verifier's rows are trimmed on the device)."""
    import dataclasses as dc

    from omni_prefix_cache.group_view import stage_prefix_cache_config
    from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
    from omni_prefix_cache.tools.simulate.vllm_scheduler import VllmScheduler

    sched = VllmScheduler(SimConfig(seed=0, spec_tokens=2), V1, v, [])
    try:
        vc = sched.vllm_config
        spec = vc.speculative_config
        assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 2
        args = dict(
            kv_cache_config=sched.kv_cache_config,
            cache_config=vc.cache_config,
            kv_transfer_config=vc.kv_transfer_config,
            scheduler_config=vc.scheduler_config,
            model_config=vc.model_config,
            is_pooling_model=False,
        )
        assert stage_prefix_cache_config(speculative_config=spec, **args) is not None
        adaptive = dc.replace(spec) if dc.is_dataclass(spec) else spec
        object.__setattr__(adaptive, "enable_adaptive_verification", True)
        with pytest.raises(OmniPrefixCacheUnmatchError, match="adaptive verification"):
            stage_prefix_cache_config(speculative_config=adaptive, **args)
    finally:
        sched.close()
