#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.33.0's real v1 scheduler and InputBatch on a CPU-only machine, for
# `make test-vllm` and `.venv-vllm/bin/omni-prefix-cache simulate --engine vllm`.
# vLLM is installed with --no-deps (its deps would pull a CUDA torch and a 1 GB triton); only the
# pure-Python deps that importing its config, scheduler and input batch needs are added, at vLLM's
# pins. The CPU torch comes from the system site-packages (.ci/setup.sh installs it first).
# Idempotent: a venv whose stamp matches this recipe is reused (about a second).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.33.0
NO_DEPS=("vllm==$VLLM_VERSION" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11")
DEPS=(
    "transformers>=5.16.1,<5.21" "fastapi<0.137" "llguidance>=1.7,<1.8" openai openai-harmony aiohttp
    starlette cbor2 psutil pyzmq pillow pybase64 cachetools msgspec uvloop prometheus_client
    partial-json-parser einops
)
# The packaging files are part of the recipe: the editable install's entry points (the vLLM
# plugin) are written at install time, so a change to them reinstalls this checkout.
RECIPE="${NO_DEPS[*]} | ${DEPS[*]} | $(pwd) | $(cat pyproject.toml setup.py | sha256sum | cut -c1-16)"
STAMP="$VENV/.omni-vllm-recipe"
LOG="$VENV/setup.log"

elapsed() { echo "$(($(date +%s) - START)) s"; }

venv_ok() {
    # Cheap checks only (importing vLLM takes 8-30 s): the recipe stamp, the installed vLLM version,
    # and this checkout installed editable (tests_vllm import vllm at collection and fail if it is broken).
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" - "$VLLM_VERSION" "$(pwd)" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util as iu, sys
assert md.version("vllm") == sys.argv[1]
assert iu.find_spec("omni_prefix_cache").origin.startswith(sys.argv[2] + "/src/")
EOF
}

pip_install() {
    # pip's resolver prints conflicts for the --no-deps pins (expected); keep them in the log.
    if ! "$VPY" -m pip install --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
        tail -40 "$LOG" >&2
        echo "setup-vllm: pip install $* failed after $(elapsed); full log: $LOG" >&2
        exit 1
    fi
}

# One setup at a time per checkout: two pips writing one venv corrupt it.
exec 9>"$VENV.lock"
flock 9
if venv_ok; then
    echo "setup-vllm: $VENV already complete (vllm $VLLM_VERSION); took $(elapsed)"
    exit 0
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q torch==2.13.0
fi
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
: >"$LOG"
echo "setup-vllm: installing vllm $VLLM_VERSION (no deps) and its pure-Python deps into $VENV (~0.5 GB download)"
pip_install --no-deps "${NO_DEPS[@]}"
pip_install "${DEPS[@]}"
pip_install --no-deps -e .
VLLM_TARGET_DEVICE=cpu "$VPY" -c "import vllm, omni_prefix_cache; print('setup-vllm: imports vllm', vllm.__version__)"
echo "$RECIPE" >"$STAMP"
echo "setup-vllm: $VENV ready ($(du -sh "$VENV" | cut -f1)); took $(elapsed)"
