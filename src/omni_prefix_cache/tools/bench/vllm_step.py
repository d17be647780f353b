"""vLLM's own scheduler step, the yardstick of the cache's engine-thread cost (issue 40).

A decode step of vLLM 0.33's real v1 ``Scheduler`` is ``schedule()`` plus
``update_from_output()`` with one sampled token per running request. This
module times that for N requests in decode, in the process that runs it
(vLLM must be importable: ``.venv-vllm``, built by ``.ci/setup-vllm.sh``).
The bench runs it in a subprocess of that venv's python beside its own
rows (``scheduler_step_us``), so both sides share the machine's state;
``goals`` judges the sweep's engine time per step against it.

With a gap (``--gap-us``, the bench's ``--forward-us``) the thread sleeps
that long between ``schedule()`` and ``update_from_output()``, as the
forward sits between them in a real engine and between the cache's
``new_step_starts`` and ``save_outputs`` in the bench: on these VMs a sleep
roughly doubles the next Python's cost, so only a step timed with the same
gap compares fairly. Both are timed, one after the other at each size.

Run alone: ``.venv-vllm/bin/python -m omni_prefix_cache.tools.bench.vllm_step
--sizes 16,64,256 --gap-us 5000 --json``.
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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

DEFAULT_VENV_PYTHON = ".venv-vllm/bin/python"
PROMPT_TOKENS = 32
BLOCK_SIZE = 16


def _time_decode(v: SimpleNamespace, requests: int, steps: int, warmup: int, gap_s: float = 0.0) -> list[float]:
    """Per-step wall us of ``schedule()`` + ``update_from_output()`` with
    ``requests`` requests decoding one token each; ``gap_s`` slept between
    the two (not counted)."""
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
            if gap_s > 0:
                time.sleep(gap_s)
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


def measure(sizes: Sequence[int], steps: int = 200, warmup: int = 20, gap_us: float = 0.0) -> dict[int, float]:
    """Median us of vLLM's decode scheduler step at each size, ``gap_us``
    slept between ``schedule()`` and ``update_from_output()`` (imports vLLM: seconds)."""
    return measure_both(sizes, steps, warmup, gap_us)[1 if gap_us > 0 else 0]


def measure_both(
    sizes: Sequence[int], steps: int = 200, warmup: int = 20, gap_us: float = 0.0
) -> tuple[dict[int, float], dict[int, float]]:
    """``(back to back, with the gap)``: median us at each size; the second is
    empty without a gap. The two runs of a size alternate, so they share the
    machine's state."""
    import torch

    from omni_prefix_cache.tools.simulate.vllm_setup import load_vllm

    torch.set_num_threads(1)
    # The config sizes max_model_len from the whole KV cache (no weights, no positions).
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    v = load_vllm()
    plain: dict[int, float] = {}
    gapped: dict[int, float] = {}
    for n in sizes:
        plain[n] = statistics.median(_time_decode(v, n, steps, warmup))
        if gap_us > 0:
            gapped[n] = statistics.median(_time_decode(v, n, steps, warmup, gap_us / 1e6))
    return plain, gapped


@dataclass
class VllmStep:
    """vLLM's decode scheduler step measured in a vLLM venv (``scheduler_step_us``):
    median us by requests per step, back to back and with ``gap_us`` slept between
    ``schedule()`` and ``update_from_output()`` (empty: not measured; ``note`` says why)."""

    back_to_back_us: dict[int, float] = field(default_factory=dict)
    with_gap_us: dict[int, float] = field(default_factory=dict)
    gap_us: float = 0.0
    note: str = ""


def scheduler_step_us(
    python: str | None, sizes: Sequence[int], *, gap_us: float = 0.0, timeout_s: float = 900.0
) -> VllmStep:
    """Run ``measure_both`` with ``python`` (a vLLM venv's interpreter) in a
    subprocess. Empty with a note saying why when ``python`` is None or
    missing, or the run failed."""
    if not python:
        return VllmStep(note="vLLM's scheduler step not measured (no vLLM venv)")
    if not Path(python).exists():
        missing = f"{python} not found; bash .ci/setup-vllm.sh builds it"
        return VllmStep(note=f"vLLM's scheduler step not measured ({missing})")
    cmd = [python, "-m", "omni_prefix_cache.tools.bench.vllm_step", "--json", "--sizes", ",".join(map(str, sizes))]
    cmd += ["--gap-us", f"{gap_us:g}"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return VllmStep(note=f"vLLM's scheduler step not measured ({python} took over {timeout_s:.0f} s)")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return VllmStep(note=f"vLLM's scheduler step not measured ({python} exited {done.returncode}: {tail[0]})")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return VllmStep(
        back_to_back_us={int(k): float(us) for k, us in found["step_us"].items()},
        with_gap_us={int(k): float(us) for k, us in found.get("step_gap_us", {}).items()},
        gap_us=float(found.get("gap_us", 0.0)),
        note=f"vLLM {found['vllm']} via {python}",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM's decode scheduler step (schedule + update_from_output), median us")
    p.add_argument("--sizes", default="16,64,256", help="requests decoding per step, comma separated")
    p.add_argument("--steps", type=int, default=200, help="timed steps per size")
    p.add_argument(
        "--gap-us", type=float, default=0.0, help="also time each size with this sleep between the two calls"
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON line: {vllm, step_us: {size: us}, step_gap_us, gap_us}"
    )
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    plain, gapped = measure_both(sizes, steps=args.steps, gap_us=args.gap_us)
    version = importlib.metadata.version("vllm")
    if args.json:
        print(json.dumps({"vllm": version, "step_us": plain, "step_gap_us": gapped, "gap_us": args.gap_us}))
    else:
        for n, us in plain.items():
            gap = f"; with a {args.gap_us:g} us gap {gapped[n]:.1f} us" if n in gapped else ""
            print(f"vLLM {version} scheduler decode step, {n} requests: {us:.1f} us back to back{gap} (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
