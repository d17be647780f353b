"""Packaging: license, version, typed marker, minimal runtime dependencies, README links, and the
built wheel (every module under src/ and every spec in it, installed and imported from a venv)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from omni_prefix_cache.specs import load_all_specs
from omni_prefix_cache.specs.diagrams import render_dot

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


# --------------------------------------------------------------- the built wheel
# What a wheel must carry: every module under src/, the specs, the typed marker.
SRC = ROOT / "src"
SHIPPED_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")


def src_modules() -> dict[str, str]:
    """Dotted module name -> its path inside a wheel, for every module under src/."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(SRC)
        parts = rel.with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel.as_posix()
    return found


def run_ok(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the project's sources (no stale build/ folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    proj = tmp / "proj"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for folder in ("src", "spec"):
        shutil.copytree(ROOT / folder, proj / folder, ignore=ignore)
    for file in SHIPPED_FILES:
        shutil.copy2(ROOT / file, proj / file)
    dist = tmp / "dist"
    run_ok(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        dist,
        proj,
        cwd=tmp,
    )
    (built,) = dist.glob("omni_prefix_cache-*.whl")
    return built


@pytest.mark.packaging
def test_the_wheel_ships_every_module_the_specs_and_the_typed_marker(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        specs = {
            Path(n).name: zf.read(n) for n in names if n.startswith("omni_prefix_cache/_spec/") and n.endswith(".yaml")
        }
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entries = zf.read(entry_points).decode()
    missing = sorted(path for path in src_modules().values() if path not in names)
    assert missing == [], f"modules under src/ missing from the wheel: {missing}"
    assert specs == {p.name: p.read_bytes() for p in (ROOT / "spec").glob("*.yaml")}
    assert "omni_prefix_cache/py.typed" in names
    assert "omni-prefix-cache = omni_prefix_cache.tools.cli:main" in entries
    assert "[vllm.general_plugins]\nomni_prefix_cache = omni_prefix_cache.vllm_plugin:register" in entries


@pytest.mark.packaging
def test_the_installed_wheel_imports_every_module_and_loads_the_specs_from_site_packages(
    wheel: Path, tmp_path: Path
) -> None:
    """Install the wheel into a fresh venv and import every module there: each
    must come from the venv's site-packages, never from this checkout (the
    editable install stays visible through the system site-packages, so a
    module missing from the wheel would otherwise still import)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    venv = tmp_path / "venv"
    run_ok(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    # --ignore-installed: never touch the editable install visible through system site-packages.
    pip = (sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "--ignore-installed")
    run_ok(*pip, wheel, cwd=tmp_path, env=env)
    probe = (
        "import importlib, json, sys\n"
        "from omni_prefix_cache.specs import load_all_specs\n"
        "from omni_prefix_cache.specs.loader import spec_dir\n"
        "from omni_prefix_cache.specs.diagrams import render_dot\n"
        "files = {m: importlib.import_module(m).__file__ for m in json.loads(sys.argv[1])}\n"
        "import omni_prefix_cache\n"
        "print(json.dumps({'files': files, 'spec_dir': str(spec_dir()), 'version': omni_prefix_cache.__version__,\n"
        "    'dots': {n: render_dot(s) for n, s in load_all_specs().items()}}))\n"
    )
    modules = [m for m in src_modules() if not m.endswith("__main__")]  # __main__ runs the CLI
    found = json.loads(run_ok(py, "-c", probe, json.dumps(modules), cwd=tmp_path, env=env))
    site = Path(run_ok(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    outside = sorted(m for m, f in found["files"].items() if not Path(f).is_relative_to(site))
    assert outside == [], f"imported from outside the installed wheel: {outside}"
    assert Path(found["spec_dir"]).is_relative_to(site)
    assert found["version"] == PYPROJECT["project"]["version"]
    assert found["dots"] == {name: render_dot(spec) for name, spec in load_all_specs().items()}
    assert (
        run_ok(venv / "bin" / "omni-prefix-cache", "--version", cwd=tmp_path, env=env)
        .strip()
        .endswith(found["version"])
    )
