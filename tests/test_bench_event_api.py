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
