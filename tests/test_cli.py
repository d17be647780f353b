"""The command line: usage errors, exit statuses, help, progress and JSON output."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_prefix_cache.tools import cli
from omni_prefix_cache.tools.cli import EXIT_ERROR, EXIT_NOTHING_CHECKED, EXIT_USAGE, build_parser, main
from omni_prefix_cache.tools.commands.common import progress_enabled
from omni_prefix_cache.tools.progress import StepProgress


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``argv``; asserts it stops as a usage error (argparse's status); returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" in err
    return err


# ---------------------------------------------------------- issue 11, item 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--discard-prob", "2"], "argument --discard-prob: must be in [0.0, 1.0], got 2"),
        (["simulate", "--discard-prob", "nan"], "argument --discard-prob"),
        (["simulate", "--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
        (["simulate", "--hidden", "0"], "argument --hidden: must be at least 1, got 0"),
        (["simulate", "--steps", "x"], "argument --steps: expected an integer"),
        (["simulate", "--kv-layout", "hybrid-sw-first"], "--kv-layout hybrid-sw-first needs --engine vllm"),
        (["simulate", "--kv-layout", "nope"], "argument --kv-layout: invalid choice: 'nope'"),
        (["bench", "--scenario", "nope"], "argument --scenario: unknown scenario 'nope'"),
        (["bench", "--profile", "decode_x"], "argument --profile: unknown scenario 'decode_x'"),
        (["bench", "--iters", "0"], "argument --iters: must be at least 1"),
        (["bench", "--forward-us", "-1"], "argument --forward-us: must be at least 0"),
        (["check", "--tasks", "-1"], "argument --tasks: must be at least 1, got -1"),
        (["check", "--slots", "0"], "argument --slots: must be at least 1, got 0"),
        (["check", "--failures", "-1"], "argument --failures: must be at least 0"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _usage_error(argv, capsys)


def test_diagrams_out_unwritable_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    err = _usage_error(["diagrams", "--out", str(blocker / "sub"), "--no-svg"], capsys)
    assert "argument --out: cannot create folder" in err


def test_check_big_keeps_an_explicit_bound(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_prefix_cache.testing import modelcheck

    seen: list[modelcheck.Bounds] = []
    real = modelcheck.check

    def spy(bounds: modelcheck.Bounds, *args: object, **kw: object) -> modelcheck.CheckResult:
        seen.append(bounds)
        # Explore a tiny world instead of the big bound; the chosen bounds are what is checked.
        tiny = modelcheck.Bounds(requests=1, tasks=1, slots=2, pages=1, steps=1, life=modelcheck.LifeBounds(steps=1))
        return real(tiny, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(modelcheck, "check", spy)
    assert main(["check", "--big", "--steps", "2", "--quiet"]) == 0
    assert main(["check", "--big", "--quiet"]) == 0
    assert main(["check", "--big", "--life-steps", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert seen[0] == dataclasses.replace(modelcheck.BIG_BOUNDS, steps=2) and modelcheck.BIG_BOUNDS.steps != 2
    assert seen[1] == modelcheck.BIG_BOUNDS
    big_life = modelcheck.BIG_BOUNDS.life
    assert seen[2].life == dataclasses.replace(big_life, steps=2) and big_life.steps != 2


def test_simulate_that_checks_nothing_is_not_ok(capsys: pytest.CaptureFixture[str]) -> None:
    # The seed-era API discards every step; the event API never discards a step a request finishes in.
    argv = ["simulate", "--api", "seed", "--eager", "--discard-prob", "1", "--steps", "40", "--arrival-steps", "8"]
    argv.append("--quiet")
    rc = main([*argv, "--torch-threads", "0"])
    out = capsys.readouterr().out
    assert rc == EXIT_NOTHING_CHECKED
    assert "result: OK" not in out and "result: NOTHING CHECKED" in out
    rc = main([*argv, "--json", "--torch-threads", "0"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == EXIT_NOTHING_CHECKED and summary["ok"] is False and summary["checked_nothing"] is True


def test_check_gives_up_with_the_error_status(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--requests", "1", "--tasks", "2", "--steps", "2", "--max-states", "50", "--quiet"])
    assert rc == EXIT_ERROR and rc != EXIT_USAGE
    assert "more than 50 states" in capsys.readouterr().err


# ------------------------------------------------------------ help, version


def test_help_lists_every_command_without_rst_quotes() -> None:
    text = build_parser().format_help()
    for command in cli.COMMANDS:
        assert command in text
    assert "``" not in text and "exit status:" in text


def test_every_option_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    undocumented = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, p in sub.choices.items()
        for action in p._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert undocumented == []
    assert "``" not in "".join(p.format_help() for p in sub.choices.values())


def test_help_does_not_import_torch() -> None:
    # --help must not pay torch's import (seconds); the latency itself is measured, not asserted.
    code = (
        "import sys\n"
        "from omni_prefix_cache.tools.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "NO-TORCH" in done.stderr and "bench" in done.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import omni_prefix_cache

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"omni-prefix-cache {omni_prefix_cache.__version__}"


def test_simulate_kv_layouts_match_the_vllm_driver() -> None:
    from omni_prefix_cache.tools.commands.simulate import KV_LAYOUT_CHOICES
    from omni_prefix_cache.tools.simulate.vllm_setup import KV_LAYOUTS

    assert KV_LAYOUT_CHOICES == list(KV_LAYOUTS)


def test_bench_scenario_names_match_the_bench() -> None:
    from omni_prefix_cache.tools.bench import SCENARIOS

    assert set(cli.BENCH_SCENARIOS) == set(SCENARIOS)


# --------------------------------------------------------- progress, --json


def test_check_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "check",
        "--requests",
        "1",
        "--tasks",
        "1",
        "--steps",
        "1",
        "--slots",
        "2",
        "--pages",
        "1",
        "--life-steps",
        "2",
    ]
    argv.append("--json")
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] is True and data["states"] > 1 and data["bounds"]["slots"] == 2
    assert [w["model"] for w in data["worlds"]] == ["write path", "lifecycle"] and data["bounds"]["life"]["steps"] == 2
    assert captured.err == ""
    rc = main([*argv[:-1], "--tasks", "2", "--steps", "2", "--broken", "escalate-requeues-copying", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["ok"] is False and data["violation"]["name"] and data["trace"]


def test_progress_line_draws_steps_elapsed_and_eta_only_when_enabled() -> None:
    on = io.StringIO()
    line = StepProgress("step", stream=on, enabled=True, every_s=0.0)
    line.update(30, 120)
    drawn = on.getvalue()
    assert "25%" in drawn and "step 30/120" in drawn and "elapsed" in drawn and "ETA" in drawn
    line.close()
    off = io.StringIO()  # not a TTY: nothing, so piped and --json output stay clean
    StepProgress("step", stream=off).update(30, 120)
    assert off.getvalue() == ""
    assert progress_enabled(argparse.Namespace(json=True, quiet=False)) is False
