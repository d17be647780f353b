"""vLLM's own scheduler step, the yardstick of the cache's engine-thread cost (issue 40).

A decode step of vLLM 0.33's real v1 ``Scheduler`` is ``schedule()`` plus
``update_from_output()`` with one sampled token per running request. This
module times that for N requests in decode, in the process that runs it
(vLLM must be importable: ``.venv-vllm``, built by ``.ci/setup-vllm.sh``).
The bench runs it in a subprocess of that venv's python beside its own
rows (``scheduler_step_us``), so both sides share the machine's state;
``goals`` judges the sweep's engine time per step against it.

Run alone: ``.venv-vllm/bin/python -m omni_prefix_cache.tools.bench.vllm_step
--sizes 16,64,256 --json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

DEFAULT_VENV_PYTHON = ".venv-vllm/bin/python"
PROMPT_TOKENS = 32
BLOCK_SIZE = 16


def _time_decode(v: SimpleNamespace, requests: int, steps: int, warmup: int) -> list[float]:
    """Per-step wall us of ``schedule()`` + ``update_from_output()`` with
    ``requests`` requests decoding one token each."""
    from omni_prefix_cache.tools.simulate import vllm_setup as setup
    from omni_prefix_cache.tools.simulate.engine import SimConfig
    from omni_prefix_cache.tools.simulate.vllm_setup import VllmOptions

    total = warmup + steps + 4  # decode steps each request lives through
    per_request_blocks = -(-(PROMPT_TOKENS + total) // BLOCK_SIZE)
    cfg = SimConfig(
        num_blocks=requests * per_request_blocks + 2,
        block_size=BLOCK_SIZE,
        token_budget=max(requests * PROMPT_TOKENS, 256),
        max_num_seqs=requests,
    )
    opts = VllmOptions()
    with tempfile.TemporaryDirectory(prefix="omni-vllm-step-") as model_dir:
        config = setup.vllm_config(v, cfg, opts, model_dir)
        sched = setup.scheduler(v, cfg, opts, config, setup.kv_cache_config(v, cfg))
        hasher = setup.block_hasher(v, cfg, config)
        params = v.SamplingParams(max_tokens=total + 8, ignore_eos=True, temperature=0.0)
        for i in range(requests):
            prompt = [(i * PROMPT_TOKENS + j) % (opts.vocab - 1) + 1 for j in range(PROMPT_TOKENS)]
            sched.add_request(v.Request(f"r{i}", prompt, params, None, block_hasher=hasher))
        times: list[float] = []
        for step in range(total):
            t0 = time.perf_counter()
            so = sched.schedule()
            t1 = time.perf_counter()
            ids = list(so.num_scheduled_tokens)
            out = v.ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: k for k, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
            )
            t2 = time.perf_counter()
            sched.update_from_output(so, out)
            t3 = time.perf_counter()
            decoding = len(ids) == requests and all(n == 1 for n in so.num_scheduled_tokens.values())
            if decoding and step >= warmup:
                times.append(((t1 - t0) + (t3 - t2)) * 1e6)
            if len(times) == steps:
                break
    if len(times) < steps:
        raise RuntimeError(f"vLLM scheduler: {requests} requests never all decoded for {steps} steps")
    return times


def measure(sizes: Sequence[int], steps: int = 200, warmup: int = 20) -> dict[int, float]:
    """Median us of vLLM's decode scheduler step at each size (imports vLLM: seconds)."""
    import torch

    from omni_prefix_cache.tools.simulate.vllm_setup import load_vllm

    torch.set_num_threads(1)
    # The config sizes max_model_len from the whole KV cache (no weights, no positions).
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    v = load_vllm()
    return {n: statistics.median(_time_decode(v, n, steps, warmup)) for n in sizes}


def scheduler_step_us(
    python: str | None, sizes: Sequence[int], *, timeout_s: float = 600.0
) -> tuple[dict[int, float], str]:
    """Run ``measure`` with ``python`` (a vLLM venv's interpreter) in a
    subprocess: ``({size: median us}, note)``. Empty with a note saying why
    when ``python`` is None or missing, or the run failed."""
    if not python:
        return {}, "vLLM's scheduler step not measured (no vLLM venv)"
    if not Path(python).exists():
        return {}, f"vLLM's scheduler step not measured ({python} not found; bash .ci/setup-vllm.sh builds it)"
    cmd = [python, "-m", "omni_prefix_cache.tools.bench.vllm_step", "--json", "--sizes", ",".join(map(str, sizes))]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {}, f"vLLM's scheduler step not measured ({python} took over {timeout_s:.0f} s)"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {}, f"vLLM's scheduler step not measured ({python} exited {done.returncode}: {tail[0]})"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(k): float(us) for k, us in found["step_us"].items()}, f"vLLM {found['vllm']} via {python}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM's decode scheduler step (schedule + update_from_output), median us")
    p.add_argument("--sizes", default="16,64,256", help="requests decoding per step, comma separated")
    p.add_argument("--steps", type=int, default=200, help="timed steps per size")
    p.add_argument("--json", action="store_true", help="one JSON line: {vllm, step_us: {size: us}}")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    step_us = measure(sizes, steps=args.steps)
    version = importlib.metadata.version("vllm")
    if args.json:
        print(json.dumps({"vllm": version, "step_us": step_us}))
    else:
        for n, us in step_us.items():
            print(f"vLLM {version} scheduler decode step, {n} requests: {us:.1f} us (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
