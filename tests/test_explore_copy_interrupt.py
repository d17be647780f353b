"""The explorer's ``copy-interrupt`` scenario (issue 28, item 1): clean on
the runtime, deterministic, and it catches the stranding a copy stage that
only handles Exception brings back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import omni_prefix_cache
from omni_prefix_cache.interface import Tid
from omni_prefix_cache.testing.explore.runner import explore, replay
from omni_prefix_cache.writes.committer import Committer
from omni_prefix_cache.writes.write_errors import write_error

# Interrupted passes the stand-in below saw (a stand-in that breaks before
# the copy would strand the tasks by itself, whatever the interrupt does).
_interrupted: list[list[Tid]] = []


def _copy_catching_exception_only(self: Committer, tids: list[Tid]) -> None:
    """The copy stage before the fix: only an Exception of the batch is
    handled, so a BaseException leaves its claimed tasks in COPYING."""
    tasks = [task for tid in tids if (task := self._registry.tasks.get(tid)) is not None]
    if not tasks:
        return
    try:
        batch = self._runner.run_batch(self._ops.copy, tasks)
    except KeyboardInterrupt:
        _interrupted.append(list(tids))
        raise
    for task, exc in batch.errors:
        self._fail(task, write_error(task, exc, "copy"))


# One CI-bound exploration in a fresh interpreter; it also prints the order a
# set of the scenario's request ids iterates in under that interpreter's hash seed.
_CHILD = """
import json
from omni_prefix_cache.testing.explore.runner import explore
r = explore("copy-interrupt", bound=1, budget=10**6)
print(json.dumps({"set_order": list({"a", "b"}), "schedules": r.schedules, "states": r.states}))
"""


def test_copy_interrupt_is_clean_at_the_ci_bound() -> None:
    report = explore("copy-interrupt", bound=1, budget=10**6)
    assert report.exhausted and not report.found, [f.describe() for f in report.found]
    assert report.schedules > 10 and report.states > report.schedules


def test_copy_interrupt_catches_a_copy_stage_that_strands_its_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Committer, "_copy", _copy_catching_exception_only)
    _interrupted.clear()
    report = explore("copy-interrupt", bound=1, budget=50)
    assert report.found, report.line()
    assert _interrupted, "the KeyboardInterrupt never went through the copy stage under test"
    found = report.found[0]
    assert found.failure.reason == "invariant joins_terminate", found.failure
    assert "state=COPYING" in found.failure.message
    sched, diverged = replay(found.token)
    assert not diverged and sched.failure is not None and sched.failure.reason == found.failure.reason


def test_copy_interrupt_explores_the_same_space_under_any_hash_seed() -> None:
    """Two interpreters whose str hashes order the request ids differently
    explore the same schedules: the space (and a replay token) must not
    depend on PYTHONHASHSEED."""
    seeds = ("0", "2")
    # The children import the package this test imported, wherever it comes from.
    src = str(Path(omni_prefix_cache.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env={**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in seeds
    ]
    results = []
    for seed, child in zip(seeds, children):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, f"PYTHONHASHSEED={seed}: {err[-2000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    first, second = results
    assert first["set_order"] != second["set_order"], f"seeds {seeds} order {{'a', 'b'}} alike; pick others"
    assert (first["schedules"], first["states"]) == (second["schedules"], second["states"]), results
