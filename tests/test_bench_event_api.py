"""The bench's event-API table: both paths over the same steps, parts timed apart, in the CLI's output."""

from __future__ import annotations

import json

import pytest

from omni_prefix_cache.tools.bench.event_api import format_event_api, run_api_pair, vllm_shaped
from omni_prefix_cache.tools.bench.scenarios import decode_scenario, plan_steps


def test_vllm_shaped_output_lists_every_running_request_as_cached() -> None:
    sc = decode_scenario(8, warmup=1, iters=3)
    steps = plan_steps(sc, 4)
    first, later = vllm_shaped(steps[0]), vllm_shaped(steps[-1])
    assert first.scheduled_cached_reqs.req_ids == [] and len(first.scheduled_new_reqs) == 8
    assert later.scheduled_cached_reqs.req_ids == steps[-1].order
    assert later.scheduled_cached_reqs.num_computed_tokens == [steps[-1].computed[r] for r in steps[-1].order]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_api_pair_times_both_paths_and_each_event_part(eager: bool) -> None:
    pair = run_api_pair(decode_scenario(8, warmup=1, iters=3), eager=eager, index=1)
    assert pair.steps == 3 and pair.mode == ("eager" if eager else "threaded")
    parts = [pair.seed_engine_us, pair.seed_materialize_us, pair.event_adapter_us]
    parts += [pair.event_engine_us, pair.event_materialize_us, pair.event_delivery_us]
    assert all(us > 0 for us in parts), pair
    assert pair.engine_ratio == pytest.approx((pair.event_adapter_us + pair.event_engine_us) / pair.seed_engine_us)
    (row,) = [line for line in format_event_api([pair]).splitlines() if line.startswith("decode_8 ")]
    assert f"{pair.engine_ratio:.2f}" in row.split() and f"{pair.output_ratio:.2f}" in row.split()


def test_bench_cli_reports_the_event_api_beside_its_report(capsys: pytest.CaptureFixture[str]) -> None:
    from omni_prefix_cache.tools.cli import main

    args = ["bench", "--scenario", "decode", "--mode", "eager", "--no-sweep", "--iters", "2", "--warmup", "1"]
    args += ["--metrics", "off", "--baseline", ""]
    assert main([*args, "--json"]) == 0
    (pair,) = json.loads(capsys.readouterr().out)["event_api"]
    assert (pair["name"], pair["mode"], pair["steps"]) == ("decode", "eager", 2)
    assert main([*args, "--no-event-api", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["event_api"] == []
    assert main(args) == 0
    assert "event API vs seed-era" in capsys.readouterr().out


@pytest.mark.parametrize("k", [2, 4])
def test_spec_scenarios_plan_drafts_and_their_accepted_rows(k: int) -> None:
    from omni_prefix_cache.tools.bench.scenarios import SCENARIOS

    sc = SCENARIOS[f"decode_spec{k}"](warmup=1, iters=6)
    assert (sc.name, sc.spec_tokens, sc.targets) == (f"decode_spec{k}", k, ())
    steps = plan_steps(sc, 7)
    drafted = [st for st in steps if st.accepted]
    assert drafted and steps[0].accepted is None  # the prompts' step drafts nothing
    for st, nxt in zip(steps, steps[1:]):
        drafts = st.output.scheduled_spec_decode_tokens
        shaped = vllm_shaped(st)
        assert shaped.scheduled_spec_decode_tokens == drafts
        assert st.seed_era_output().scheduled_spec_decode_tokens == {}
        for rid, sampled in (st.accepted or {}).items():
            assert 1 <= sampled <= len(drafts[rid]) + 1 <= k + 1
            # vLLM's rollback: the next step starts at the accepted end.
            assert (
                nxt.computed[rid]
                == st.computed[rid] + st.output.num_scheduled_tokens[rid] - len(drafts[rid]) + sampled - 1
            )


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "threaded"])
def test_api_pair_of_a_spec_scenario_materializes_the_accepted_rows(eager: bool) -> None:
    pair = run_api_pair(decode_scenario(8, warmup=1, iters=4, spec_tokens=2), eager=eager, index=0)
    assert (pair.name, pair.steps) == ("decode_8_spec2", 4)
    assert pair.event_engine_us > 0 and pair.event_materialize_us > 0


def test_spec_scenarios_run_in_the_event_api_table_only(capsys: pytest.CaptureFixture[str]) -> None:
    from omni_prefix_cache.tools.bench.measure import run_scenario
    from omni_prefix_cache.tools.cli import main

    with pytest.raises(ValueError, match="event API only"):
        run_scenario(decode_scenario(8, warmup=1, iters=2, spec_tokens=4))
    args = ["bench", "--scenario", "decode", "--scenario", "decode_spec4", "--mode", "eager", "--no-sweep"]
    args += ["--iters", "2", "--warmup", "1", "--metrics", "off", "--baseline", "", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["results"]] == ["decode"]
    assert [p["name"] for p in report["event_api"]] == ["decode", "decode_spec4"]
    with pytest.raises(SystemExit):
        main(["bench", "--profile", "decode_spec2"])
    assert "event-API table only" in capsys.readouterr().err


def test_decode_spec2_is_held_to_its_limit_of_plain_decoding_per_mode() -> None:
    from omni_prefix_cache.tools.bench.event_api import EVENT_SCENARIOS, ApiPair, spec_verdicts

    assert "decode_spec2" in EVENT_SCENARIOS  # make bench judges it by default

    def pair(name: str, mode: str, adapter: float, engine: float) -> ApiPair:
        return ApiPair(name, mode, 10, 100.0, 50.0, adapter, engine, 40.0, 10.0)

    pairs = [
        pair("decode", "eager", 100.0, 300.0),
        pair("decode_spec2", "eager", 120.0, 400.0),  # 520 / 400 = 1.3: met
        pair("decode", "threaded", 100.0, 200.0),
        pair("decode_spec2", "threaded", 120.0, 300.0),  # 420 / 300 = 1.4: missed
        pair("prefill_hits", "eager", 1.0, 1.0),
    ]
    got = {v.name: (v.value, v.met) for v in spec_verdicts(pairs)}
    assert got == {
        "spec K=2 / plain eager": (pytest.approx(1.3), True),
        "spec K=2 / plain threaded": (pytest.approx(1.4), False),
    }
    text = format_event_api(pairs)
    assert "spec K=2 / plain threaded" in text and "MISSED" in text
    assert spec_verdicts(pairs[:1]) == []  # no spec row: nothing judged
