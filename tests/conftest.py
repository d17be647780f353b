# Shared test fixtures and markers. Keep this small: anything only one test
# module needs belongs in that module. Other test modules may add fixtures here.
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "packaging: builds and installs the wheel (~20 s); part of the default suite")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout the tests run from."""
    return REPO_ROOT


# ---------------------------------------------------------------- Hypothesis
# `ci` (default): bounded and derandomized, so a CI failure replays exactly
# with the same command. `fuzz`: long random runs (`make fuzz`), printing the
# reproduce blob on failure. Pick with HYPOTHESIS_PROFILE=<name>.
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "fuzz",
    max_examples=100_000,
    stateful_step_count=80,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# `mutants`: like ci, but stop at the first failure without shrinking: the
# catalogue only needs to know whether a mutant dies.
settings.register_profile(
    "mutants",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ---------------------------------------------------------------- mutants
# `make mutants` sets OMNI_PREFIX_CACHE_MUTANT to re-inject one catalogued
# bug for the whole session (see omni_prefix_cache.testing.mutant_catalogue).
@pytest.fixture(scope="session", autouse=True)
def _catalogued_mutant() -> Iterator[None]:
    name = os.environ.get("OMNI_PREFIX_CACHE_MUTANT")
    if not name:
        yield
        return
    from omni_prefix_cache.testing.mutant_catalogue import applied

    with applied(name):
        yield


@pytest.fixture
def managers() -> Iterator[list[Any]]:
    """Managers a test makes; each is shut down after the test, pass or fail."""
    made: list[Any] = []
    yield made
    for mgr in made:
        mgr.shutdown()
