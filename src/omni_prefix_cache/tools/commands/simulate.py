"""``omni-prefix-cache simulate``: drive the manager through a synthetic
vLLM-like serving trace (or vLLM's real scheduler) and check every row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from omni_prefix_cache.tools.commands.common import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NOTHING_CHECKED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    describe,
    float_in,
    non_negative,
    positive,
    probability,
    progress_enabled,
)

# The driver's KV layouts (tools/simulate/vllm_setup.KV_LAYOUTS; named here so --help imports no torch).
KV_LAYOUT_CHOICES = ["full", "hybrid-sw-first", "hybrid-full-first", "hybrid-mamba"]


def add_parser(sub: Any) -> None:
    """Declare ``simulate`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "simulate",
        help="drive the manager through a synthetic vLLM-like serving trace and check every row",
        description=describe(
            "Synthetic engine loop (chunked prefill, decode, preemption, streaming, same-step hits, "
            "aborts, a deferred key) against the real manager; an oracle checks every materialized row. "
            "With the event API (the default) it also checks that every position of every request tenure "
            "reaches both consumers exactly once, in order, after preemptions, discards and replacements.",
            "A progress line (steps, elapsed, ETA) is drawn on stderr when it is a terminal.",
        ),
        formatter_class=HelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--threaded", dest="eager", action="store_false", help="real committer thread (the default)")
    mode.add_argument("--eager", dest="eager", action="store_true", help="copies and pool writes inline at submit")
    p.set_defaults(eager=False)
    lag = p.add_mutually_exclusive_group()
    lag.add_argument(
        "--lag",
        dest="lag",
        action="store_true",
        default=None,
        help="materialize one step behind on a thread (the default when threaded)",
    )
    lag.add_argument(
        "--no-lag", dest="lag", action="store_false", default=None, help="materialize inline after each save"
    )
    p.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="scheduler and input batch: the project's look-alikes or vLLM's real ones (needs vLLM: .ci/setup-vllm.sh)",
    )
    p.add_argument(
        "--kv-offload",
        action="store_true",
        help=(
            "--engine vllm: vLLM's OffloadingConnector (CPU offload) behind the host tier's wrapper, a fake "
            "worker completing its transfers; hits loaded from offload are served from the tier"
        ),
    )
    p.add_argument(
        "--kv-layout",
        choices=KV_LAYOUT_CHOICES,
        default="full",
        help=(
            "--engine vllm: the KV cache groups, one full-attention group, or a hybrid model's: a sliding-window "
            "group (2 blocks) before or after the full-attention one, or a Mamba group (align mode) before it; "
            "rows are keyed by the full-attention group the stage gate picks"
        ),
    )
    p.add_argument(
        "--api",
        choices=["events", "seed"],
        default="events",
        help="events: the adapter, write layouts, two delivery consumers, preempt/resume, replacements "
        "(--engine vllm through the engine helper); seed: the seed-era scheduler output",
    )
    p.add_argument(
        "--spec-tokens",
        type=non_negative,
        default=0,
        metavar="K",
        help="speculative decoding (event API): decode steps carry up to K draft tokens, some wrong, and each "
        "materialize gets the accepted rows (--engine vllm: vLLM's SpeculativeConfig(method='ngram', K)); 0: off",
    )
    p.add_argument("--seed", type=non_negative, default=0, help="seed of the trace and the discard choices")
    p.add_argument("--steps", type=positive, default=2000, help="step cap; requests still live there are aborted")
    p.add_argument("--arrival-steps", type=positive, default=500, help="requests arrive during this many steps")
    p.add_argument(
        "--arrivals-per-step",
        type=float_in(0.0, None, low_open=True),
        default=0.45,
        help="mean new requests per step while they arrive",
    )
    p.add_argument("--num-blocks", type=positive, default=96, help="KV blocks (small: preemption and recycling)")
    p.add_argument("--block-size", type=positive, default=16, help="tokens per KV block")
    p.add_argument("--token-budget", type=positive, default=256, help="max scheduled tokens per step")
    p.add_argument("--max-seqs", type=positive, default=16, help="max running requests per step")
    p.add_argument("--hidden", type=positive, default=64, help="hidden-state width")
    p.add_argument("--no-hidden", action="store_true", help="the policy opts out of hidden states (mm keys only)")
    p.add_argument("--staging-depth", type=positive, default=4, help="staging pages (unconsumed step ids)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="row dtype")
    p.add_argument(
        "--gpu-staging-bytes",
        type=non_negative,
        default=24 * 1024,
        help="budget of deferred device clones in bytes (small: more budget flushes)",
    )
    p.add_argument(
        "--discard-prob", type=probability, default=0.03, help="chance a step is discarded, not materialized"
    )
    p.add_argument("--json", action="store_true", help="print the machine-readable summary (no progress line)")
    p.add_argument(
        "--metrics-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="draw the run's metrics (time in state per machine, D2H / pool-write bytes per step); needs [plots]",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="record the run's trace to FILE and validate it after (docs/trace.md); a violation fails the run",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--torch-threads",
        type=non_negative,
        default=1,
        help="torch intra-op threads (tiny tensor ops stall on a busy OpenMP pool; 0 keeps torch's own)",
    )
    p.add_argument("--verbose", action="store_true", help="print the manager's log warnings")
    p.set_defaults(func=run, validate=lambda args: validate(p, args))


def sim_config(args: argparse.Namespace) -> Any:
    """The ``SimConfig`` the arguments describe."""
    from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig

    return SimConfig(
        seed=args.seed,
        steps=args.steps,
        workload=WorkloadConfig(arrival_steps=args.arrival_steps, arrivals_per_step=args.arrivals_per_step),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        token_budget=args.token_budget,
        max_num_seqs=args.max_seqs,
        hidden_size=args.hidden,
        cache_hidden=not args.no_hidden,
        staging_depth=args.staging_depth,
        dtype=args.dtype,
        gpu_staging_bytes=args.gpu_staging_bytes,
        discard_prob=args.discard_prob,
        eager=args.eager,
        lag=args.lag,
        trace_path=None if getattr(args, "trace", None) is None else str(args.trace),
        api=args.api,
        spec_tokens=args.spec_tokens,
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The manager's own config check, run before the simulation starts, so a
    bad combination is a usage error (argparse's exit) rather than "the manager raised"."""
    from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError

    if args.spec_tokens and args.api != "events":
        parser.error("--spec-tokens needs --api events (speculative decoding needs write layouts and accepted rows)")
    try:
        sim_config(args).prefix_cache_config()
    except (ValueError, TypeError, OmniPrefixCacheUnmatchError) as exc:
        parser.error(str(exc))
    if args.kv_layout != "full" and args.engine != "vllm":
        parser.error(f"--kv-layout {args.kv_layout} needs --engine vllm (the look-alike scheduler runs one group)")


def run(args: argparse.Namespace) -> int:
    """Run the simulation (``--engine``), print its table or JSON; the exit status."""
    import json
    import logging

    import torch

    from omni_prefix_cache.tools.simulate import run_simulation
    from omni_prefix_cache.tools.simulate.report import ProgressLine, format_table, summary

    cfg = sim_config(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    simulate = run_simulation
    if args.engine == "vllm":
        from functools import partial

        from omni_prefix_cache.tools.simulate.vllm_events import run_vllm_simulation
        from omni_prefix_cache.tools.simulate.vllm_setup import VllmOptions

        opts = VllmOptions(kv_offload=args.kv_offload, kv_layout=args.kv_layout)
        simulate = partial(run_vllm_simulation, opts=opts, api=args.api)
    progress = ProgressLine(enabled=progress_enabled(args))
    progress.arrival_steps = args.arrival_steps
    from omni_prefix_cache.telemetry.registry import TELEMETRY
    from omni_prefix_cache.tools.simulate.metrics_report import StepSampler, require_matplotlib, write_report

    if args.metrics_out is not None:
        try:
            require_matplotlib()
        except ImportError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_USAGE
    was_recording = TELEMETRY.enabled
    TELEMETRY.enable()
    TELEMETRY.reset()  # this run's series only
    sampler = StepSampler(progress)
    try:
        res = simulate(cfg, progress=sampler)
        metrics = TELEMETRY.summary()
        if args.metrics_out is not None:
            write_report(args.metrics_out, sampler)
    except ImportError as exc:
        print(f"simulate --engine {args.engine}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        progress.close()
        if not was_recording:
            TELEMETRY.disable()  # an in-process caller (a test) gets its switch back
    if args.json:
        print(json.dumps({**summary(res), "metrics": metrics}, indent=2, default=str))
    else:
        print(format_table(res))
    if args.trace is not None and res.error is None:
        from omni_prefix_cache.tools.commands.validate import validate_file

        status = validate_file(args.trace, out=sys.stderr if args.json else sys.stdout)
        if status != EXIT_OK:
            return status
    if res.error is not None:
        return EXIT_ERROR
    if res.mismatches or res.leaked:
        return EXIT_FAILED
    return EXIT_NOTHING_CHECKED if res.checked_nothing else EXIT_OK
