#!/usr/bin/env bash
# The built wheel is the library: build it from a copy of the sources, install it into a clean
# venv (no -e, no src/ on the path, no system site-packages), and run from it the seed suite,
# `omni-prefix-cache simulate` and the examples. `make wheel-check`; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
unset PYTHONPATH

# A copy, so a stale build/ folder of this checkout cannot add modules the sources lack.
mkdir "$WORK/proj"
cp -r src spec pyproject.toml setup.py README.md LICENSE "$WORK/proj/"
find "$WORK/proj" -name __pycache__ -prune -exec rm -rf {} + -o -name '*.egg-info' -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/proj"
WHEEL=$(ls "$WORK"/dist/omni_prefix_cache-*.whl)
echo "wheel-check: built $(basename "$WHEEL")"

"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# CPU torch first: the wheel's bare torch requirement would pull a multi-GB CUDA build.
"$VPY" -m pip install -q torch==2.13.0
"$VPY" -m pip install -q "$WHEEL[testing]" pytest
"$VPY" - "$(pwd)" <<'PYEOF'
import sys, omni_prefix_cache
from omni_prefix_cache.specs.loader import spec_dir
for where in (omni_prefix_cache.__file__, str(spec_dir())):
    assert not where.startswith(sys.argv[1]), f"wheel-check: {where} is in the checkout, not the installed wheel"
print(f"wheel-check: omni_prefix_cache {omni_prefix_cache.__version__} from {omni_prefix_cache.__file__}")
PYEOF

# -P: the checkout's root never lands on sys.path; the tests import the installed package.
"$VPY" -P -m pytest -q -p no:cacheprovider tests/test_seed_suite.py
"$WORK/venv/bin/omni-prefix-cache" simulate --quiet
"$VPY" -P examples/minimal_engine.py
"$VPY" -P examples/threaded_lagged.py
echo "wheel-check: OK in $(($(date +%s) - START)) s"
