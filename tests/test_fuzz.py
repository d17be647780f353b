"""The fuzz harness (tests/fuzz.py): it finds every stateful machine, a
failure prints a replay command that fails the same way, the example
database replays a failure first next time, and the summary shows which
spec moves ran."""

from __future__ import annotations

import inspect
import shlex
import sys
from pathlib import Path

import pytest

import omni_prefix_cache.writes.write_task as write_task_mod
from omni_prefix_cache.specs import load_spec, spec_names
from omni_prefix_cache.testing.mutants import recompile, single_moves, without_move

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz  # noqa: E402


def test_every_spec_and_every_racing_machine_ci_runs_is_fuzzed() -> None:
    names = set(fuzz.all_targets())
    assert {f"spec-{n}" for n in spec_names()} <= names
    for path in Path(fuzz.TESTS).glob("test_race_*.py"):
        module = __import__(path.stem)
        # The machines pytest runs: each module-level TestCase's state machine.
        ran = {
            obj.runTest._hypothesis_state_machine_class.__name__
            for _, obj in inspect.getmembers(module, inspect.isclass)
            if hasattr(getattr(obj, "runTest", None), "_hypothesis_state_machine_class")
        }
        assert ran and ran <= names, (path.name, ran - names)


def test_coverage_line_names_every_declared_move(capsys: pytest.CaptureFixture[str]) -> None:
    moves = single_moves(load_spec("write_task"))
    assert fuzz.main(["--machine", "spec-write_task", "--duration", "0", "--no-db"]) == 0
    idle = capsys.readouterr().out
    assert f"write_task: 0/{len(moves)} moves, UNCOVERED " in idle
    assert all(f"{t}@{s}:0" in idle for t, s in moves)
    assert fuzz.main(["--machine", "spec-write_task", "--seed", "0", "--examples", "20"]) == 0
    out = capsys.readouterr().out
    assert f"write_task: {len(moves)}/{len(moves)} moves, all covered" in out
    assert "fuzz summary: 1 machines, " in out


def test_failure_prints_a_replay_that_fails_and_the_database_replays_it_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = write_task_mod.WRITE_TASK_MACHINE
    broken = recompile(real, without_move(real.spec, "fail", "COPYING"))
    monkeypatch.setattr(write_task_mod, "WRITE_TASK_MACHINE", broken)
    db = tmp_path / "no-such-dir-yet"
    common = ["--machine", "spec-write_task", "--examples", "20", "--shrink-seconds", "10"]
    assert fuzz.main([*common, "--duration", "60", "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert "FAILED spec-write_task (seed " in err and "state = " in err and "fail on " in err
    replay = shlex.split(err.split("Replay exactly with:\n")[1].splitlines()[0])
    assert replay[1] == "tests/fuzz.py" and "--seed" in replay
    assert fuzz.main(replay[2:]) == 1
    assert "FAILED spec-write_task (seed " in capsys.readouterr().err
    # Next run: the stored failure replays before any new seed is tried.
    assert fuzz.main([*common, "--duration", "60", "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert "FAILED spec-write_task (replaying its example database" in err
    assert "--replay-db" in err.split("Replay exactly with:\n")[1]


def test_a_database_holding_only_entries_of_an_older_machine_replays_nothing_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Hypothesis keys entries by the machine's source; a changed machine leaves its old keys behind.
    stale = tmp_path / "db" / "spec-write_task" / "0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "fedcba9876543210").write_bytes(b"\x00\x01")
    args = ["--machine", "spec-write_task", "--db", str(tmp_path / "db")]
    assert fuzz.main([*args, "--replay-db"]) == 0
    assert "holds no example for the machine as it is now" in capsys.readouterr().out
    assert fuzz.main([*args, "--duration", "0"]) == 0
