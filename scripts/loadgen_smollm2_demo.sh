#!/usr/bin/env bash
# Replay the first minute(s) of the Azure LLM conversation trace (2023) against a
# local SmolLM2 Baton stack, slowed down to what two CPU cores sustain, and write
# the result JSON, per-request JSONL and PNG charts to results/.
#
#   scripts/loadgen_smollm2_demo.sh            # against a stack already up (./baton up)
#   scripts/loadgen_smollm2_demo.sh --start    # start ./baton up itself, stop it at the end
#
# Settings (environment variables, defaults in brackets):
#   BATON_URL      gateway root                                [http://127.0.0.1:8000]
#   MODEL          model or routing preset                     [smollm2-135m]
#   TRACE          trace file                                  [$BATON_DATA_DIR/traces/azure_llm_2023_conv.csv,
#                  BATON_DATA_DIR defaulting to data/]
#   TRACE_SECONDS  how much of the trace, in trace seconds     [60: 191 requests]
#   RATE           mean replay rate, req/s (sets the stretch)  [0.4: the minute takes ~8 min]
#   MAX_IN         cap on prompt tokens                        [256]
#   MAX_OUT        cap on output tokens (max_tokens)           [32]
#   OUT            output prefix                               [results/loadgen-smollm2-azure]
#   CLUSTER        cluster file for --start                    [configs/local.toml if the
#                  derived SmolLM2 models are built, else a one-model smollm2-135m cluster]
#
# The trace's first minute runs at 3.3 req/s with ~900-token prompts and ~230-token
# answers; a 2-core box running SmolLM2-135M (bf16, one thread per worker) decodes
# ~50 tok/s per worker, so both the rate and the lengths are scaled down. The
# arrival pattern (bursts and lulls) is the trace's, only stretched in time.
# The run passes when the achieved rate is within 5% of the requested one
# (`achieved_to_scheduled` >= 0.95); the exit code says so (0 ok, 1 not kept up).
set -euo pipefail
cd "$(dirname "$0")/.."

URL=${BATON_URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-smollm2-135m}
TRACE=${TRACE:-${BATON_DATA_DIR:-data}/traces/azure_llm_2023_conv.csv}
TRACE_SECONDS=${TRACE_SECONDS:-60}
RATE=${RATE:-0.4}
MAX_IN=${MAX_IN:-256}
MAX_OUT=${MAX_OUT:-32}
OUT=${OUT:-results/loadgen-smollm2-azure}
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

healthy() { curl -sf -o /dev/null --max-time 2 "$URL/health"; }

launcher_pid=""
stop_stack() {
  if [ -n "$launcher_pid" ] && kill -0 "$launcher_pid" 2>/dev/null; then
    echo "demo: stopping the stack (pid $launcher_pid)" >&2
    kill -INT "$launcher_pid" 2>/dev/null || true
    wait "$launcher_pid" 2>/dev/null || true
  fi
  [ -z "${tmp_cluster:-}" ] || rm -f "$tmp_cluster"
}
trap stop_stack EXIT

if [ "${1:-}" = "--start" ] && ! healthy; then
  cluster=${CLUSTER:-}
  if [ -z "$cluster" ]; then
    if [ -f models/smollm2-medium.safetensors ] && [ -f models/smollm2-small.safetensors ]; then
      cluster=configs/local.toml
    else  # the derived models are not built (`just models`): serve smollm2-135m alone
      tmp_cluster=$(mktemp --suffix=.toml)
      cat >"$tmp_cluster" <<'EOF'
namespace = "baton-demo"

[gateway]
host = "127.0.0.1"
port = 8000

[models.smollm2-135m]
dtype = "bfloat16"
device = "cpu"
price_input_per_mtok = 1.0
price_output_per_mtok = 2.0

[[instances]]
model = "smollm2-135m"
replicas = 1
[instances.scheduler]
max_num_seqs = 16
max_num_batched_tokens = 512
num_kv_blocks = 512
max_model_len = 2048
EOF
      cluster=$tmp_cluster
    fi
  fi
  mkdir -p logs
  echo "demo: starting ./baton up $cluster (log: logs/loadgen-demo-baton.log)" >&2
  ./baton up "$cluster" >logs/loadgen-demo-baton.log 2>&1 &
  launcher_pid=$!
  for _ in $(seq 600); do
    healthy && break
    kill -0 "$launcher_pid" 2>/dev/null || { echo "demo: the stack exited; see logs/" >&2; exit 2; }
    sleep 1
  done
fi
healthy || { echo "demo: no Baton gateway answers at $URL/health (start it: ./baton up)" >&2; exit 2; }

tokenizer=()
for t in .cache/smollm2-135m/tokenizer.json .cache/baton/tokenizers/smollm2-135m/tokenizer.json; do
  if [ -f "$t" ]; then tokenizer=(--tokenizer "$t"); break; fi
done

mkdir -p "$(dirname "$OUT")"
"$PY" -m loadgen \
  --base-url "$URL" --model "$MODEL" \
  --trace "$TRACE" --trace-duration-s "$TRACE_SECONDS" --request-rate "$RATE" \
  --max-input-tokens "$MAX_IN" --max-output-tokens "$MAX_OUT" \
  "${tokenizer[@]}" \
  --label smollm2-azure --metadata "trace_seconds=$TRACE_SECONDS" "cpu_cores=$(nproc)" \
  --save-result "$OUT.json" --save-detailed "$OUT.requests.jsonl" --plot "$OUT-plots"

"$PY" - "$OUT.json" <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
ratio = r["achieved_to_scheduled"] or 0.0
print(
    f"demo: {r['completed']}/{r['num_prompts']} completed; requested {r['requested_rate']:.3f} "
    f"req/s, achieved {r['achieved_rate']:.3f} req/s ({ratio:.1%} of the schedule); "
    f"median TTFT {r['median_ttft_ms'] or float('nan'):.0f} ms"
)
sys.exit(0 if ratio >= 0.95 and r["failed"] == 0 else 1)
EOF
