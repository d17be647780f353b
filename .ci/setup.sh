#!/usr/bin/env bash
# Install everything the project needs on a machine that has only Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q torch==2.13.0
fi
if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq graphviz >/dev/null
fi
"$PY" -m pip install -q -e ".[dev]"
