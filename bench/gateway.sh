#!/usr/bin/env bash
# Gateway overhead: HeteroFlow's gateway beside a direct call, nginx and LiteLLM, in one
# run of the shared harness (../shared/bench/gateway). Prints the harness's tables, then
# one JSON line of figures and ratios against the baselines of the same run.
# Knobs: DUR (s per cell, default 10), TARGETS, CONCS — see the harness README.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HARNESS="${HARNESS:-$ROOT/../shared/bench/gateway}"
PY="${PY:-$ROOT/.venv/bin/python}"
export RESDIR="${RESDIR:-$ROOT/bench/results/gateway-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RESDIR"
export GATEWAY_NAME=heteroflow GATEWAY_URL=http://127.0.0.1:18090 GATEWAY_KEY=sk-bench-heteroflow
export GATEWAY_CMD="exec $PY $ROOT/bench/gateway_slot.py --port 18090 --upstream \"\$BENCH_BACKEND_URL\" --key $GATEWAY_KEY"
bash "$HARNESS/run.sh"
"$PY" "$ROOT/bench/gateway_summary.py" "$RESDIR/results.jsonl"
