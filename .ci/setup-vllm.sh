#!/usr/bin/env bash
# Build .venv-vllm: the real vLLM 0.33.0 v1 scheduler and InputBatch on a CPU-only machine.
# vLLM is installed with --no-deps (its deps would pull CUDA torch and a 1 GB triton); only
# the pure-Python deps that importing the scheduler, InputBatch and config need are added.
# Idempotent: a venv whose stamp matches this recipe and that imports vllm is reused as is.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.33.0
PINS=(
    "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
)
DEPS=(
    "transformers>=5.16.1,<5.21" "fastapi<0.137" "llguidance>=1.7,<1.8" openai openai-harmony aiohttp
    starlette cbor2 psutil pyzmq pillow pybase64 cachetools msgspec uvloop prometheus_client
    partial-json-parser einops
)
RECIPE="vllm==$VLLM_VERSION ${PINS[*]} ${DEPS[*]}"
STAMP="$VENV/.omni-vllm-recipe"

venv_ok() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] &&
        VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm, omni_prefix_cache" >/dev/null 2>&1
}

if venv_ok; then
    echo "setup-vllm: $VENV already complete (vllm $VLLM_VERSION); took $(($(date +%s) - START)) s"
    exit 0
fi
# The CPU torch comes from the system site-packages (installed by .ci/setup.sh).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q torch==2.13.0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --no-deps "vllm==$VLLM_VERSION" "${PINS[@]}"
"$VPY" -m pip install -q "${DEPS[@]}"
"$VPY" -m pip install -q --no-deps -e .
VLLM_TARGET_DEVICE=cpu "$VPY" -c "import vllm, omni_prefix_cache; print('setup-vllm: vllm', vllm.__version__)"
echo "$RECIPE" >"$STAMP"
echo "setup-vllm: $VENV ready, $(du -sh "$VENV" | cut -f1); took $(($(date +%s) - START)) s"
