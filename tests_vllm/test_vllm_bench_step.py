"""The bench's yardstick: vLLM's own decode scheduler step, timed on the real Scheduler."""

from __future__ import annotations

import sys

from omni_prefix_cache.tools.bench.vllm_step import measure, measure_both, scheduler_step_us


def test_the_decode_step_is_timed_with_every_request_decoding() -> None:
    got = measure((4, 8), steps=5, warmup=2)
    assert set(got) == {4, 8} and all(us > 0 for us in got.values())


def test_the_step_is_also_timed_with_a_gap_between_its_two_calls() -> None:
    plain, gapped = measure_both((4,), steps=5, warmup=2, gap_us=2000.0)
    assert set(plain) == set(gapped) == {4} and plain[4] > 0 and gapped[4] > 0
    # The sleep itself is not counted: a 2 ms gap adds far less than 2 ms to the step.
    assert gapped[4] < 2000.0
    assert measure_both((4,), steps=5, warmup=2)[1] == {}


def test_the_bench_reads_it_from_this_venvs_python_in_a_subprocess() -> None:
    got = scheduler_step_us(sys.executable, (4,), gap_us=1000.0, timeout_s=300)
    assert set(got.back_to_back_us) == set(got.with_gap_us) == {4} and got.back_to_back_us[4] > 0
    assert got.gap_us == 1000.0 and got.note.startswith("vLLM 0.33.0 via ")
