"""`make gpu-check`: the first run of the CUDA path, in one short script.

On a GPU (under 3 minutes on one device):

serve         the serving simulation with static CUDA output buffers that a
              deliberately slow forward overwrites every step, copy/read
              lanes lagged by a sleep after every stream wait, materialize
              one step behind on another thread, a GPU budget small enough
              to flush, and a same-sized garbage allocation after every save
              that recycles whatever device memory was freed. Passes with 0
              mismatches, 0 leaks, device memory back to its starting level,
              budget flushes seen and the read lane used. The run records
              a trace (docs/trace.md, ``--trace FILE``) that must then
              validate against the specs.
copy_failure  an injected failure in a deferred copy: the task ends FAILED,
              its join raises, the budget is back at 0.
device_fault  an asynchronous device fault (an out-of-bounds index kernel)
              while a step's copy is in flight: materialize raises, the next
              call raises the sticky error, shutdown returns. Runs in a child
              process on CUDA (the fault kills the CUDA context).
cuda_tests    ``pytest -m cuda`` on the repository's tests.

``--dry-run`` (automatic without CUDA) runs the same harness on CPU: serve and
copy_failure with the CPU copy engine, and every check with the real CUDA
engine over the logging fake runtime (``testing.fake_device``), so the
harness cannot rot. The test suite runs the dry run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import BudgetTicket, OmniPrefixCacheController, TaskState, WriteChunk, WriteTask
from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    WriteSchedule,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.gpu_backends import Backend, cpu_backend, cuda_backend, fake_backend
from omni_prefix_cache.tools.simulate.batch import SimGroupView
from omni_prefix_cache.tools.simulate.engine import LEFTOVER_KEY, SimConfig, Simulation
from omni_prefix_cache.tools.simulate.report import budget_flushes

# ------------------------------------------------------------------ serve


class _DeviceSimulation(Simulation):
    """The serving simulation with its outputs in static device buffers.

    The base forward computes rows on the host; here they travel to the
    device behind a slow kernel, so the static buffers are written after
    the host has moved on, and overwritten by the next step's forward.
    """

    def __init__(self, cfg: SimConfig, backend: Backend, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.backend = backend
        self._device_bufs: dict[str, torch.Tensor] = {}

    def _device_static(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._device_bufs.get(key)
        if buf is None:
            cap = max(self.cfg.token_budget, self.cfg.pad_max_tokens)
            shape = (cap, int(like.shape[-1]))
            buf = self._device_bufs[key] = torch.empty(shape, dtype=like.dtype, device=self.backend.device)
        return buf

    def _to_device(self, key: str, host: torch.Tensor) -> torch.Tensor:
        dst = self._device_static(key, host)[: int(host.shape[0])]
        if dst.device.type == "cuda":  # pragma: no cover - CUDA only
            # Pinned source: the copy is queued behind the slow kernel, not waited by the host.
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)
        return dst

    def _forward(self, order: list[str], plan: Any) -> tuple[torch.Tensor, dict[str, Any], int, int]:
        hidden, mm, n, padded = super()._forward(order, plan)
        self.backend.slow_forward()
        out_mm = {k: (v if k == LEFTOVER_KEY else self._to_device(k, v)) for k, v in mm.items()}
        return self._to_device(HIDDEN_KEY, hidden), out_mm, n, padded


class _GarbageManager:
    """Passes calls through; after each save allocates and poisons tensors
    the size of the step's clones, so freed device blocks are recycled at
    once (a clone freed while a lane still reads it shows up as NaN rows)."""

    def __init__(self, mgr: OmniPrefixCacheManager) -> None:
        self.mgr = mgr
        self.garbage_allocs = 0

    def save_outputs(self, hidden: Any, mm: Any, **kw: Any) -> int:
        sid = self.mgr.save_outputs(hidden, mm, **kw)
        n = int(kw["num_tokens_unpadded"])
        for t in [hidden, *[v for v in (mm or {}).values() if isinstance(v, torch.Tensor)]]:
            torch.full((max(n, 1), int(t.shape[-1])), float("nan"), dtype=t.dtype, device=t.device)
            self.garbage_allocs += 1
        return sid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mgr, name)


@dataclass
class Check:
    name: str
    ok: bool
    numbers: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def _validated(path: Path) -> dict[str, Any]:
    """The trace at ``path`` replayed against the specs (docs/trace.md)."""
    from omni_prefix_cache.tools.trace_check import TraceFormatError, read_trace, validate_trace

    try:
        trace = read_trace(path)
    except (OSError, TraceFormatError) as exc:
        return {"ok": False, "path": str(path), "error": str(exc)}
    res = validate_trace(trace)
    v = res.violation
    return {
        "ok": v is None and res.lost_at is None and res.moves > 0,
        "path": str(path),
        "bytes": path.stat().st_size,
        "records": res.records,
        "moves": res.moves,
        "validate_s": round(res.seconds, 3),
        "violation": None if v is None else f"{v.rule}: {v.message}",
    }


def check_serve(backend: Backend, steps: int, seed: int, trace: Path | None = None) -> Check:
    # A budget of a few steps' deferred rows: flushes start within the first steps.
    if trace is None:
        trace = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "serve.jsonl"
    cfg = SimConfig(seed=seed, steps=steps, eager=False, lag=True, gpu_staging_bytes=8 * 1024, trace_path=str(trace))
    engines: list[CopyEngine] = []
    wrappers: list[_GarbageManager] = []

    def factory(config: PrefixCacheConfig, view: Any, eager: bool) -> Any:
        engines.append(backend.make_engine())
        wrappers.append(_GarbageManager(OmniPrefixCacheManager(config, view, eager=False, engine=engines[-1])))
        return wrappers[-1]

    start_mem = backend.memory()
    sim = _DeviceSimulation(cfg, backend, manager_factory=factory)
    res = sim.run()
    del sim, wrappers[0].mgr
    gc.collect()
    end_mem = backend.memory()
    engine = engines[0]
    lane_uses = dict(getattr(engine, "lane_uses", {}))
    stats = res.manager_stats or {}
    numbers: dict[str, Any] = {
        "steps": res.steps,
        "rows_checked": res.rows_checked,
        "rows_from_cache": res.rows_from_cache,
        "mismatches": res.mismatches,
        "leaks": res.leaks,
        "budget_flushes": budget_flushes(res),
        "lane_uses": lane_uses,
        "garbage_allocs": wrappers[0].garbage_allocs,
        "device_bytes_start": start_mem,
        "device_bytes_end": end_mem,
        "pool_host_bytes": stats.get("pool_host_bytes"),
        "staging_host_bytes": stats.get("staging_host_bytes"),
        "pinned_bytes_allocated": getattr(getattr(engine, "rt", None), "pinned_bytes", None),
        "wall_s": round(res.wall_s, 2),
        "engine_us_median": _median(res.engine_us),
        "error": res.error,
        "trace": _validated(trace),
    }
    ok = (
        res.error is None
        and res.mismatches == 0
        and res.rows_checked > 0
        and not res.leaked
        and numbers["budget_flushes"] > 0
        and start_mem == end_mem
        and (not backend.lanes or lane_uses.get("read", 0) > 0)
        and numbers["trace"]["ok"]
    )
    note = "" if backend.lanes else "host copies: no lanes, so no read-lane check"
    return Check(f"serve[{backend.name}]", ok, numbers, note)


def _median(xs: list[float]) -> float | None:
    return round(sorted(xs)[len(xs) // 2], 1) if xs else None


# ------------------------------------------------------------------ failures


def check_copy_failure(backend: Backend) -> Check:
    cfg = PrefixCacheConfig(num_blocks=8, block_size=4, staging_capacity_tokens=32, staging_claim_timeout_s=30.0)
    pool = PrefixBlockPool(cfg)
    pool.ensure_key(HIDDEN_KEY, torch.float32, 8)
    engine = backend.make_engine()

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        raise RuntimeError("injected copy failure")

    engine.copy_into = failing  # type: ignore[method-assign]
    ctrl = OmniPrefixCacheController(pool, cfg, eager=False, engine=engine)
    raised = ""
    try:
        clone = torch.arange(32.0, device=backend.device).reshape(4, 8).clone()
        ticket = BudgetTicket(nbytes=clone.numel() * clone.element_size())
        ctrl.reserve(ticket.nbytes)
        chunk = WriteChunk(slots_cpu=torch.tensor([0, 1, 2, 3]), tensors={HIDDEN_KEY: clone}, budget=ticket)
        task = WriteTask(
            tid=1,
            req_id="r",
            write_n=1,
            schedule=WriteSchedule.JOIN_ON_FINISH,
            chunks=[chunk],
            freeze_event=ctrl.parts.host_rows.engine.freeze([clone]),
        )
        del clone
        ctrl.parts.budget.pin(ticket, 1)
        ctrl.submit(task, queued=False)
        ctrl.escalate([1])
        try:
            ctrl.join([1])
        except OmniPrefixCacheUnmatchError as exc:
            raised = str(exc)
        staged = ctrl.stats()["staged_bytes"]
        state = task.state.name
    finally:
        ctrl.shutdown()
    ok = state == TaskState.FAILED.name and staged == 0 and "write failed" in raised
    return Check(f"copy_failure[{backend.name}]", ok, {"state": state, "staged_bytes": staged, "join_raised": raised})


def check_device_fault(
    backend: Backend,
    timeout_s: float = 60.0,
    report: Callable[[dict[str, Any]], None] | None = None,
    trace: Path | None = None,
) -> Check:
    """Materialize raises on a device fault, the next call raises the sticky
    error, shutdown returns: all within ``timeout_s``. ``report`` gets the
    numbers before shutdown (a child process prints them, in case the dead
    CUDA context takes the process down while tearing down)."""
    assert backend.inject_fault is not None
    engine = backend.make_engine()
    view = SimGroupView(4)
    # Traced: a faulted run's trace (sticky failure included) must validate too.
    trace = trace or Path(tempfile.mkdtemp(prefix="gpu-check-")) / "device_fault.jsonl"
    cfg = PrefixCacheConfig(
        num_blocks=16, block_size=4, staging_capacity_tokens=64, staging_claim_timeout_s=10.0, trace_path=str(trace)
    )
    mgr = OmniPrefixCacheManager(cfg, view, eager=False, engine=engine)
    mgr.register_policy(ModelCachePolicy(deferred_keys=frozenset({"d"})))
    started = time.monotonic()
    numbers: dict[str, Any] = {}

    def step(new: bool, start: int, count: int, fault: bool = False) -> int:
        view.set_step(["a"], {"a": [0, 1, 2]}, {"a": start})
        req = SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=([0, 1, 2],))
        sched = SimpleNamespace(
            scheduled_new_reqs=[req] if new else [], finished_req_ids=set(), num_scheduled_tokens={"a": count}
        )
        mgr.new_step_starts(sched)
        if fault:
            # The fault is part of this step's forward: the step's copy is ordered after it on the
            # device, so it is in flight when the fault lands (a fault queued after the copy may
            # land once the copy is done, and then rightly loses nothing of this step).
            assert backend.inject_fault is not None
            backend.inject_fault(engine)
        rows = torch.arange(count * 8, dtype=torch.float32, device=backend.device).reshape(count, 8) + start
        mm = {"d": rows[:, :2].contiguous()}
        return mgr.save_outputs(rows, mm, num_tokens_unpadded=count, num_tokens_padded=count)

    try:
        first = step(True, 0, 6)
        hidden = mgr.materialize(first, ["a"]).hidden_states
        numbers["first_ok"] = hidden is not None and bool(hidden["a"].shape[0] == 6)
        second = step(False, 6, 1, fault=True)
        for name, call in (
            ("materialize", lambda: mgr.materialize(second, ["a"])),
            ("next_call", lambda: mgr.new_step_starts(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"a"}))),
        ):
            try:
                call()
                numbers[name] = "returned"
            except OmniPrefixCacheUnmatchError as exc:
                numbers[name] = f"raised: {str(exc)[:160]}"
            except BaseException as exc:  # the wrong type: reported, not hidden
                numbers[name] = f"raised {type(exc).__name__}: {str(exc)[:160]}"
        if report is not None:
            report(dict(numbers))
    finally:
        mgr.shutdown()
    numbers["shutdown"] = "returned"
    numbers["elapsed_s"] = round(time.monotonic() - started, 2)
    numbers["trace"] = _validated(trace)
    # Either side may see the fault first: materialize's own wait ("device
    # fault") or the committer's wait of the same copy ("write failed").
    ok = (
        numbers.get("first_ok") is True
        and str(numbers.get("materialize", "")).startswith("raised: ")
        and str(numbers.get("next_call", "")).startswith("raised: ")
        and numbers["shutdown"] == "returned"
        and numbers["elapsed_s"] < timeout_s
        and numbers["trace"]["ok"]
    )
    return Check(f"device_fault[{backend.name}]", ok, numbers)


def _device_fault_in_child(timeout_s: float) -> Check:  # pragma: no cover - CUDA only
    cmd = [sys.executable, "-m", "omni_prefix_cache.tools.gpu_check", "--child-fault", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Check("device_fault[cuda]", False, {}, f"hung: no answer within {timeout_s:g}s")
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.startswith("{")]
    try:
        got = json.loads(lines[-1])
    except (ValueError, IndexError):
        return Check("device_fault[cuda]", False, {"rc": out.returncode}, (out.stdout + out.stderr)[-800:])
    if "name" not in got:  # only the pre-shutdown report: the child died tearing down
        # The cause (a C++ ``what():``, a Python traceback's last line) comes before the frames.
        causes = [ln for ln in out.stderr.splitlines() if "what():" in ln or "terminate" in ln or "Error" in ln]
        note = (
            f"child exited rc={out.returncode} during shutdown: {' | '.join(causes[:6])[:800]} ... {out.stderr[-300:]}"
        )
        return Check("device_fault[cuda]", False, got, note)
    return Check(got["name"], bool(got["ok"]), got["numbers"], got.get("note", ""))


def check_cuda_tests() -> Check:  # pragma: no cover - CUDA only
    tests = Path.cwd() / "tests"
    if not tests.is_dir():
        return Check("cuda_tests", False, {}, f"no tests/ under {Path.cwd()}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(tests)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    tail = out.stdout.strip().splitlines()[-1:] or [""]
    return Check("cuda_tests", out.returncode == 0, {"rc": out.returncode, "summary": tail[0]})


# ------------------------------------------------------------------ main


def run_checks(
    *, dry_run: bool, steps: int, seed: int, lag_ms: float, forward_ms: float, trace: Path | None = None
) -> list[Check]:
    # Injected failures are logged by the committer; keep them off stderr.
    logging.getLogger("omni_prefix_cache").addHandler(logging.NullHandler())
    checks: list[Check] = []
    if dry_run:
        for backend in (cpu_backend(), fake_backend(lag_ms)):
            checks.append(
                check_serve(
                    backend, steps, seed, None if trace is None else trace.with_suffix(f".{backend.name}.jsonl")
                )
            )
            checks.append(check_copy_failure(backend))
        checks.append(check_device_fault(fake_backend(0.0)))
        return checks
    backend = cuda_backend(lag_ms, forward_ms)  # pragma: no cover - CUDA only
    checks.append(check_serve(backend, steps, seed, trace))  # pragma: no cover
    checks.append(check_copy_failure(backend))  # pragma: no cover
    checks.append(_device_fault_in_child(120.0))  # pragma: no cover
    checks.append(check_cuda_tests())  # pragma: no cover
    return checks  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same harness on CPU (automatic without CUDA)")
    ap.add_argument("--steps", type=int, default=None, help="serving steps (default: 400 on CUDA, 40 dry)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag-ms", type=float, default=None, help="sleep after each lane wait (default 2 CUDA, 1 dry)")
    ap.add_argument("--forward-ms", type=float, default=3.0, help="slow kernel ahead of each forward's writes")
    ap.add_argument("--trace", type=Path, default=None, help="where serve records its trace (default: a temp file)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child-fault", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_fault:  # pragma: no cover - CUDA only
        check = check_device_fault(
            cuda_backend(lag_ms=200.0, forward_ms=0.0), report=lambda n: print(json.dumps(n, default=str), flush=True)
        )
        payload = {"name": check.name, "ok": check.ok, "numbers": check.numbers, "note": check.note}
        print(json.dumps(payload, default=str), flush=True)
        return 0 if check.ok else 1
    dry = args.dry_run or not torch.cuda.is_available()
    steps = args.steps if args.steps is not None else (40 if dry else 400)
    lag = args.lag_ms if args.lag_ms is not None else (1.0 if dry else 2.0)
    started = time.monotonic()
    checks = run_checks(
        dry_run=dry, steps=steps, seed=args.seed, lag_ms=lag, forward_ms=args.forward_ms, trace=args.trace
    )
    wall = round(time.monotonic() - started, 1)
    ok = all(c.ok for c in checks)
    if args.json:
        payload = {"dry_run": dry, "ok": ok, "wall_s": wall, "checks": [c.__dict__ for c in checks]}
        print(json.dumps(payload, default=str))
    else:
        where = "dry run on CPU" if dry else torch.cuda.get_device_name()  # pragma: no branch
        print(f"gpu-check ({where}): {'PASS' if ok else 'FAIL'} in {wall}s")
        for c in checks:
            print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {json.dumps(c.numbers, default=str)}")
            if c.note:
                print(f"       note: {c.note}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
