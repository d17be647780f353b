"""Does trace validation alone catch a mutant? (``make mutants``' trace column)

Per mutant, a child process applies it and records short runs: the
simulation (threaded committer, lagged materialize; the same again eager),
the simulation again with one immediate write's pool write failing
(``testing.write_fakes``: the failure record, the sticky failure, shutdown
failing what is left, paths a clean run never takes), gpu-check's
device-fault scenario on the fake CUDA runtime, and the simulation with an
on-demand committer (writes run only inside the joins that wait for them,
so a missing join shows in every run, not only when the committer thread
happens to lag); then it exits; the parent then validates the trace the child
left, whatever became of the run (a crash or a hang leaves the trace up to
its last flush, and the child is killed past ``TIMEOUT_S``). The verdict is
``caught by RULE`` or ``not caught``; it is reported beside the kill verdict
and never changes it.

The child is ``python -m omni_prefix_cache.testing.mutant_catalogue
--trace-child NAME FOLDER`` (the catalogue applies the mutant, then calls
``record_runs``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TIMEOUT_S = 60
STEPS = 160
MODES = ("threaded", "eager", "failing", "fault", "on_demand")
FAILING_TID = 30  # the write whose pool write the "failing" run fails


def trace_verdict(name: str) -> str:
    """Run mutant ``name`` recorded (each of ``MODES``, in one child) and
    validate: the first rule broken, or ``not caught``."""
    from omni_prefix_cache.tools.trace_check import TraceFormatError, read_trace, validate_trace

    with tempfile.TemporaryDirectory(prefix="trace-mutant-") as tmp:
        try:
            subprocess.run(
                [sys.executable, "-m", "omni_prefix_cache.testing.mutant_catalogue", "--trace-child", name, tmp],
                timeout=TIMEOUT_S,
                capture_output=True,
                env=dict(os.environ),
            )
        except subprocess.TimeoutExpired:
            pass  # the traces up to their last flush are what a hung run leaves
        for mode in MODES:
            try:
                res = validate_trace(read_trace(Path(tmp) / f"{mode}.jsonl"))
            except (OSError, TraceFormatError):
                continue
            if res.violation is not None:
                return f"caught by {res.violation.rule} ({mode})"
    return "not caught"


def record_runs(folder: str) -> int:
    """The child's runs, with the mutant already applied: one recorded
    simulation per mode into ``folder``."""
    from omni_prefix_cache.tools.simulate import SimConfig, WorkloadConfig, run_simulation

    for mode in MODES:
        path = Path(folder) / f"{mode}.jsonl"
        if mode == "fault":
            from omni_prefix_cache.tools.gpu_backends import fake_backend
            from omni_prefix_cache.tools.gpu_check import check_device_fault

            try:
                check_device_fault(fake_backend(0.0), timeout_s=20.0, trace=path)
            except Exception as exc:
                print(f"{mode} run raised {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        cfg = SimConfig(
            steps=STEPS,
            workload=WorkloadConfig(arrival_steps=STEPS // 2),
            eager=mode == "eager",
            trace_path=str(path),
        )
        try:
            factory = {"failing": failing_manager, "on_demand": on_demand_manager}.get(mode)
            run_simulation(cfg, manager_factory=factory)
        except Exception as exc:  # the run's own failure: the trace still says what happened
            print(f"{mode} run raised {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


def on_demand_manager(config: Any, view: Any, eager: bool) -> Any:
    """A manager whose writes run only when something joins them. A
    mutant that skips a join then exhausts the staging pages: a short claim
    timeout ends that run in seconds (its trace says what happened)."""
    import dataclasses

    from omni_prefix_cache.manager import OmniPrefixCacheManager

    config = dataclasses.replace(config, staging_claim_timeout_s=2.0)
    return OmniPrefixCacheManager(config, view, eager=False, committer="on_demand")


def failing_manager(config: Any, view: Any, eager: bool) -> Any:
    """A threaded manager whose pool write of task ``FAILING_TID`` raises."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.testing.write_fakes import install_failing_stages

    mgr = OmniPrefixCacheManager(config, view, eager=False)
    install_failing_stages(mgr.components.controller, lambda task: False, lambda task: task.tid == FAILING_TID)
    return mgr
