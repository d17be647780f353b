"""The bench's yardstick: vLLM's own decode scheduler step, timed on the real Scheduler."""

from __future__ import annotations

import sys

from omni_prefix_cache.tools.bench.vllm_step import measure, scheduler_step_us


def test_the_decode_step_is_timed_with_every_request_decoding() -> None:
    got = measure((4, 8), steps=5, warmup=2)
    assert set(got) == {4, 8} and all(us > 0 for us in got.values())


def test_the_bench_reads_it_from_this_venvs_python_in_a_subprocess() -> None:
    got, note = scheduler_step_us(sys.executable, (4,), timeout_s=300)
    assert set(got) == {4} and got[4] > 0
    assert note.startswith("vLLM 0.33.0 via ")
