"""The examples run and check their own rows (tests/test_docs.py: the README quotes the minimal one's engine loop)."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_checks_its_rows(path: Path) -> None:
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{path.stem}: OK" in done.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_exits_nonzero_on_wrong_rows(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    real = OmniPrefixCacheManager.materialize

    def served_as_zeros(self: OmniPrefixCacheManager, step_id: int, req_ids: Any) -> Any:
        out = real(self, step_id, req_ids)
        hidden = {rid: torch.zeros_like(rows) for rid, rows in (out.hidden_states or {}).items()}
        return dataclasses.replace(out, hidden_states=hidden)

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", served_as_zeros)
    assert _load(path).main() == 1
