#!/usr/bin/env bash
# Gather, on a machine with a package index, the wheels scripts/device-check-gpu.sh needs on
# a lent GPU machine that reaches none (its Python is 3.12 with torch, psutil, httpx and
# nvidia-ml-py already; the platform's agent code also reads pydantic and httptools).
# A few MB into .device/wheels (ignored by git); name .device in the device tool's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
rm -rf .device/wheels && mkdir -p .device/wheels
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .device/wheels pydantic httptools
du -sh .device/wheels >&2
