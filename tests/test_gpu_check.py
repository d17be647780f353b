"""`make gpu-check` in CI: its CPU dry run, so the harness cannot rot, and
proof that the harness fails when copies go wrong."""

from __future__ import annotations

import json

import pytest
import torch

from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.testing.fake_device import FakeDeviceEngine
from omni_prefix_cache.tools import gpu_check


def test_dry_run_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    rc = gpu_check.main(["--dry-run", "--steps", "30", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = [c["name"] for c in out["checks"]]
    assert names == [
        "serve[cpu-engine]",
        "copy_failure[cpu-engine]",
        "serve[fake-lanes]",
        "copy_failure[fake-lanes]",
        "device_fault[fake-lanes]",
    ]
    failed = [c for c in out["checks"] if not c["ok"]]
    assert rc == 0 and out["dry_run"] and out["ok"], failed or out
    lanes = out["checks"][2]["numbers"]
    assert lanes["lane_uses"]["read"] > 0 and lanes["budget_flushes"] > 0 and lanes["mismatches"] == 0


class _PoisonedCopies(FakeDeviceEngine):
    """Every third copy lands NaN rows, as a copy that read a recycled block would."""

    def __init__(self) -> None:
        super().__init__()
        self._n = 0

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        super().copy_into(dst, src)
        self._n += 1
        if self._n % 3 == 0:
            dst.fill_(float("nan"))


def test_serve_check_fails_on_wrong_rows() -> None:
    def make() -> CopyEngine:
        return _PoisonedCopies()

    backend = gpu_check.fake_backend(0.0)
    backend.make_engine = make
    check = gpu_check.check_serve(backend, steps=30, seed=0)
    assert not check.ok and check.numbers["mismatches"] > 0, check
