"""Packaging metadata: license, version, typed marker, minimal runtime dependencies, README links."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_expression_with_its_file() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # An SPDX expression and a License :: classifier together are a build error.
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_version_comes_from_the_installed_metadata() -> None:
    import omni_prefix_cache

    assert omni_prefix_cache.__version__ == importlib.metadata.version("omni-prefix-cache")
    assert omni_prefix_cache.__version__ == PYPROJECT["project"]["version"]


def test_typed_marker_ships() -> None:
    assert (ROOT / "src" / "omni_prefix_cache" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["omni_prefix_cache"]


def test_runtime_needs_only_its_declared_dependencies() -> None:
    deps = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    assert deps == {"torch", "numpy", "pyyaml"}  # numpy: the slot math on vLLM's numpy tables
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(d.startswith("hypothesis") for d in extras["testing"])
    assert any(d.startswith("transitions") for d in extras["testing"])
    assert any(d.startswith("graphviz") for d in extras["diagrams"])
    assert any(d.startswith("prometheus_client") for d in extras["metrics"])
    # The engine-facing modules must import without the extras' packages.
    code = (
        "import sys\n"
        "import omni_prefix_cache.manager, omni_prefix_cache.group_view, omni_prefix_cache.tools.cli\n"
        "import omni_prefix_cache.ops.stats, omni_prefix_cache.tools.simulate, omni_prefix_cache.tools.bench\n"
        "import omni_prefix_cache.testing.modelcheck\n"
        "print(sorted(m for m in ('hypothesis', 'transitions', 'graphviz', 'prometheus_client') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_readme_relative_links_and_images_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t.split("#", 1)[0] for t in targets if "://" not in t and not t.startswith("#")]
    assert relative, "README links nothing"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert missing == []
