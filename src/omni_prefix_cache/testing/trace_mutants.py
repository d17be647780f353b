"""Does trace validation alone catch a mutant? (``make mutants``' trace column)

Per mutant, a child process applies it (``mutant_catalogue.applied``), runs a
short recorded simulation (threaded committer, lagged materialize, and the
same again eager) and exits; the parent then validates the trace the child
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

TIMEOUT_S = 60
STEPS = 200
MODES = ("threaded", "eager")


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
        cfg = SimConfig(
            steps=STEPS,
            workload=WorkloadConfig(arrival_steps=STEPS // 2),
            eager=mode == "eager",
            trace_path=str(Path(folder) / f"{mode}.jsonl"),
        )
        try:
            run_simulation(cfg)
        except Exception as exc:  # the run's own failure: the trace still says what happened
            print(f"{mode} run raised {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0
