# Tests against the real vLLM (0.33.0), run by `make test-vllm` in .venv-vllm (.ci/setup-vllm.sh).
# Not collected by `make test` (testpaths = tests). vLLM is imported here, at collection, on purpose:
# where it cannot be imported this suite errors instead of skipping.
from __future__ import annotations

import os

for _k, _v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402, F401  (fails collection when vLLM is missing: never a silent skip)

from omni_prefix_cache.tools.simulate.vllm_engine import load_vllm  # noqa: E402

# One line per simulation run, printed in the terminal summary (make test-vllm's report).
RUN_LINES: list[str] = []


@pytest.fixture(scope="session")
def v():
    """The vLLM names the driver uses, imported once."""
    torch.set_num_threads(1)
    return load_vllm()


@pytest.fixture(scope="session")
def run_lines() -> list[str]:
    """Where a run's summary line goes."""
    return RUN_LINES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RUN_LINES:
        return
    terminalreporter.section(f"simulate --engine vllm (vLLM {vllm.__version__})")
    for line in RUN_LINES:
        terminalreporter.write_line(line)
