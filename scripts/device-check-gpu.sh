#!/usr/bin/env bash
# Run on a lent NVIDIA machine (the device tool, with carry [".device"] after
# scripts/device-prepare.sh here): the platform's GPU path against the real card.
# The last line is one JSON object (scripts/device-check-gpu.py says what it checks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEPS=/tmp/heteroflow-device-deps
if ! "$PY" -c 'import pydantic, httptools' 2>/dev/null; then
  [ -d .device/wheels ] || { echo "missing pydantic/httptools and no .device/wheels (run scripts/device-prepare.sh here first)" >&2; exit 2; }
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --target "$DEPS" .device/wheels/*.whl
fi
nvidia-smi -L >&2 || true
PYTHONPATH="src:$DEPS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  timeout 480 "$PY" scripts/device-check-gpu.py "$@"
