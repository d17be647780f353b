"""``omni-prefix-cache`` command line: diagrams, check, simulate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_diagrams(args: argparse.Namespace) -> int:
    from omni_prefix_cache.specs.diagrams import stale_diagrams, write_diagrams

    out = Path(args.out)
    if args.check:
        stale = stale_diagrams(out)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)} (run: make diagrams)", file=sys.stderr)
            return 1
        print(f"diagrams in {out} match the specs")
        return 0
    for path in write_diagrams(out, svg=not args.no_svg):
        print(f"wrote {path}")
    return 0


# --------------------------------------------------------------- simulate


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="drive the manager through a synthetic vLLM-like serving trace and check every row",
        description="Synthetic engine loop (chunked prefill, decode, preemption, streaming, same-step hits, "
        "aborts, a deferred key) against the real manager; an oracle checks every materialized row. "
        "Exit status: 0 ok, 1 mismatches or leaks, 2 the manager raised.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--threaded", dest="eager", action="store_false", help="real committer thread (default)")
    mode.add_argument("--eager", dest="eager", action="store_true", help="copies and pool writes inline at submit")
    p.set_defaults(eager=False)
    lag = p.add_mutually_exclusive_group()
    lag.add_argument(
        "--lag",
        dest="lag",
        action="store_true",
        default=None,
        help="materialize one step behind on a thread (default when threaded)",
    )
    lag.add_argument("--no-lag", dest="lag", action="store_false", help="materialize inline after each save")
    p.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="scheduler and input batch: the project's look-alikes (default) or vLLM's real ones (needs vLLM, "
        "see .ci/setup-vllm.sh)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000, help="step cap; live requests are aborted there (default 2000)")
    p.add_argument("--arrival-steps", type=int, default=500, help="requests arrive during this many steps")
    p.add_argument("--arrivals-per-step", type=float, default=0.45)
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks (small = preemption and recycling)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=256, help="max scheduled tokens per step")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64, help="hidden width")
    p.add_argument("--no-hidden", action="store_true", help="policy opts out of hidden states (mm keys only)")
    p.add_argument("--staging-depth", type=int, default=4, help="staging pages (unconsumed step ids)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--gpu-staging-bytes", type=int, default=24 * 1024, help="deferred-clone budget (small = flushes)")
    p.add_argument("--discard-prob", type=float, default=0.03, help="chance a step is discarded, not materialized")
    p.add_argument("--json", action="store_true", help="print the machine-readable summary")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: tiny tensor ops stall on a busy OpenMP pool; 0 keeps torch's own)",
    )
    p.add_argument("--verbose", action="store_true", help="print the manager's log warnings (budget flushes etc.)")
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    import json
    import logging

    import torch

    from omni_prefix_cache.simulate import SimConfig, WorkloadConfig, run_simulation
    from omni_prefix_cache.simulate.report import ProgressLine, format_table, summary

    cfg = SimConfig(
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
    )
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run = run_simulation
    if args.engine == "vllm":
        from omni_prefix_cache.simulate.vllm_engine import run_vllm_simulation as run
    progress = ProgressLine(enabled=False if args.quiet else None)
    try:
        res = run(cfg, progress=progress)
    except ImportError as exc:
        print(f"simulate --engine {args.engine}: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    if args.json:
        print(json.dumps(summary(res), indent=2, default=str))
    else:
        print(format_table(res))
    if res.error is not None:
        return 2
    return 0 if res.ok else 1


# ------------------------------------------------------------------ bench


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="engine and materialize cost per step against a memcpy floor, with targets",
        description="Scenarios decode, prefill_hits, deferred and a decode batch sweep. Each row reports "
        "microseconds per step, tokens/s and the ratio to a torch clone of the step's row bytes measured "
        "in the same run; rows with a target say met or missed. Exit status 1 when a target is missed "
        "(only with --strict).",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="eager", action="store_true", help="inline copies (default)")
    mode.add_argument("--threaded", dest="eager", action="store_false", help="real committer thread")
    p.set_defaults(eager=True)
    p.add_argument("--scenario", action="append", help="run only these scenarios (repeatable)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per scenario (default per scenario)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default per scenario)")
    p.add_argument("--no-sweep", action="store_true", help="skip the decode batch-size sweep")
    p.add_argument("--profile", metavar="SCENARIO", help="cProfile one scenario and print the top functions")
    p.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    p.add_argument("--json", action="store_true", help="print the machine-readable report")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the run (default 1: steadier on a shared or small machine)",
    )
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from omni_prefix_cache.bench import main_bench

    return main_bench(args)


# ------------------------------------------------------------------ check


def _add_check_parser(sub: argparse._SubParsersAction) -> None:
    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, BROKEN, CI_BOUNDS

    b = CI_BOUNDS
    p = sub.add_parser(
        "check",
        help="bounded exhaustive check of the composed model (every reachable state, TLC-style)",
        description="Breadth-first over every reachable state of the composed write pipeline (write tasks, "
        "slot occupancy, staging holders, step contexts, the committer, escalate/join/fail/reuse/materialize/"
        "discard), with every component move taken from the compiled specs. Checks every invariant in every "
        "state and that every state can still settle; prints states explored, depth and time, or a shortest "
        "counterexample. Exit status: 0 ok, 1 violation. The defaults are the CI bound.",
    )
    p.add_argument("--requests", type=int, default=b.requests, help=f"requests (default {b.requests})")
    p.add_argument("--tasks", type=int, default=b.tasks, help=f"write tasks in all (default {b.tasks})")
    p.add_argument("--slots", type=int, default=b.slots, help=f"KV slots (default {b.slots})")
    p.add_argument("--pages", type=int, default=b.pages, help=f"staging pages (default {b.pages})")
    p.add_argument("--steps", type=int, default=b.steps, help=f"saved steps in all (default {b.steps})")
    p.add_argument("--reads", type=int, default=b.reads, help=f"planned delayed reads at a time (default {b.reads})")
    p.add_argument("--failures", type=int, default=b.failures, help=f"injected write failures (default {b.failures})")
    p.add_argument(
        "--broken",
        choices=sorted(BROKEN),
        help="check a deliberately broken variant instead: " + "; ".join(f"{k}: {v}" for k, v in BROKEN.items()),
    )
    p.add_argument(
        "--big",
        action="store_true",
        help=f"start from the bigger bound ({BIG_BOUNDS.describe()}; minutes) instead of the CI bound",
    )
    p.add_argument("--max-states", type=int, default=None, help="give up past this many states (exit 2)")
    p.set_defaults(func=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    import dataclasses

    from omni_prefix_cache.testing.modelcheck import BIG_BOUNDS, CI_BOUNDS, check

    base = BIG_BOUNDS if args.big else CI_BOUNDS
    # Flags left at their (CI) default take the chosen base's value.
    changed = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(CI_BOUNDS)
        if getattr(args, f.name) != getattr(CI_BOUNDS, f.name)
    }
    bounds = dataclasses.replace(base, **changed)
    try:
        result = check(bounds, args.broken, max_states=args.max_states)
    except ValueError as exc:
        print(f"check: {exc}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-prefix-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("diagrams", help="render every spec into DOT (and SVG)")
    p.add_argument("--out", default="diagrams", help="output folder (default: diagrams)")
    p.add_argument("--check", action="store_true", help="fail if a committed .dot differs from the specs")
    p.add_argument("--no-svg", action="store_true", help="write .dot only")
    p.set_defaults(func=_cmd_diagrams)
    _add_simulate_parser(sub)
    _add_bench_parser(sub)
    _add_check_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
