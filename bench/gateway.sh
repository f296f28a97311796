#!/usr/bin/env bash
# Gateway overhead: HeteroFlow's gateway beside a direct call, nginx and LiteLLM, in the
# shared harness (../shared/bench/gateway). Our gateway runs as deployed at the edge —
# `heteroflow gateway --routes FILE` (bench/gateway_slot.py) — with key auth, RPM/TPM
# limits in a Redis of its own, usage accounting and least_connections all on.
# Prints the harness's tables, then (last line) one JSON object of figures
# (bench/gateway_summary.py): cpu_ms_per_req, cpu_ms_per_stream, litellm_/nginx_cpu_ms_per_req,
# errors_c450, added_p50_ms_c1, added_p99_ms_c32 and added_p99_ms_c450 (our p99 minus the
# direct call's under wrk, same run; median of RUNS), redis_cpu_ms_per_req, soak_rss_growth_pct.
#
# MODE=openloop: the arrival-rate mode instead (bench/gateway_openloop.py, same Redis): nginx's
# closed-loop capacity, then direct, nginx and our gateway at FRACTIONS (25,50,80) % of it,
# non-stream and stream, each point DUR s (10) at a fixed rate with bench/openloop (latency
# from each request's intended send time); last line its JSON (added_p99_ms_at_50pct, ...).
# ANCHOR=heteroflow takes the fractions of our own closed-loop capacity instead of nginx's.
#
# Knobs: RUNS (harness runs, default 1; the issue's target is the median of 3),
#   SOAK_S (0 = no soak; 600 = the 10-minute soak at SOAK_C=450 streams, after the runs),
#   REDIS_PORT (16379), GATEWAY_PORT (18090), and the harness's own (DUR, TARGETS, CONCS,
#   CPU_GW, BACKEND_PORT, NGINX_PORT, ...).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HARNESS="${HARNESS:-$ROOT/../shared/bench/gateway}"
if [[ ! -f "$HARNESS/run.sh" ]]; then
  echo "bench/gateway.sh needs the shared gateway harness (run.sh, bench.py, fake_engine.py)" >&2
  echo "at $HARNESS: set HARNESS=/path/to/shared/bench/gateway" >&2
  exit 2
fi
PY="${PY:-$ROOT/.venv/bin/python}"
RUNS="${RUNS:-1}"
SOAK_S="${SOAK_S:-0}"
SOAK_C="${SOAK_C:-450}"
REDIS_PORT="${REDIS_PORT:-16379}"
GATEWAY_PORT="${GATEWAY_PORT:-18090}"
OUT="${RESDIR:-$ROOT/bench/results/gateway-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

# A Redis of our own (no persistence), on the backend's core, so its CPU is ours to
# count and nobody else's traffic is in it. Its CPU is reported per request served.
redis_cmd=(redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no
  --logfile "$OUT/redis.log")
if command -v taskset >/dev/null; then redis_cmd=(taskset -c "${CPU_BACKEND:-1}" "${redis_cmd[@]}"); fi
"${redis_cmd[@]}" &  # taskset execs redis-server: $! is Redis itself
REDIS_PID=$!
trap 'kill "$REDIS_PID" 2>/dev/null; wait "$REDIS_PID" 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
kill -0 "$REDIS_PID" 2>/dev/null || { echo "redis-server did not start (port $REDIS_PORT taken?)" >&2; exit 1; }
redis_stats() {  # "cpu_seconds commands"
  redis-cli -p "$REDIS_PORT" INFO all | tr -d '\r' | awk -F: '
    /^used_cpu_(sys|user):/ {cpu += $2} /^total_commands_processed:/ {cmd = $2}
    END {printf "%.6f %d\n", cpu, cmd}'
}
export HETEROFLOW_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
export GATEWAY_NAME=heteroflow GATEWAY_URL="http://127.0.0.1:$GATEWAY_PORT" GATEWAY_KEY=sk-bench-heteroflow
if [[ "${MODE:-closed}" == "openloop" ]]; then
  "$PY" "$ROOT/bench/gateway_openloop.py" --harness "$HARNESS" --out "$OUT" \
    --gateway-port "$GATEWAY_PORT" --key "$GATEWAY_KEY"
  exit
fi

runs=()
for i in $(seq "$RUNS"); do
  run="$OUT/run$i"
  mkdir -p "$run"
  export RESDIR="$run"
  export GATEWAY_CMD="exec $PY $ROOT/bench/gateway_slot.py --port $GATEWAY_PORT --upstream \"\$BENCH_BACKEND_URL\" --key $GATEWAY_KEY --workdir $run"
  read -r cpu0 cmd0 < <(redis_stats)
  bash "$HARNESS/run.sh"
  read -r cpu1 cmd1 < <(redis_stats)
  printf '{"cpu_s": %s, "commands": %s}\n' "$(awk "BEGIN {printf \"%.6f\", $cpu1 - $cpu0}")" "$((cmd1 - cmd0))" >"$run/redis.json"
  runs+=("$run")
done

soak=()
if [[ "$SOAK_S" != "0" ]]; then
  "$PY" "$ROOT/bench/gateway_soak.py" --harness "$HARNESS" \
    --bench-python "${BENCH_VENV:-/tmp/venv-bench}/bin/python" \
    --duration "$SOAK_S" --concurrency "$SOAK_C" --out "$OUT/soak.json"
  soak=(--soak "$OUT/soak.json")
fi
"$PY" "$ROOT/bench/gateway_summary.py" "${runs[@]}" "${soak[@]}"
