#!/usr/bin/env bash
# Create .venv with torch (CPU), megatron-core and the test tools, and install megatron-preflight into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q -r requirements-test.txt
.venv/bin/pip install -q -r requirements-parallel.txt || echo "pytest-xdist not installed: the tests will run serially" >&2
.venv/bin/pip install -q --no-deps -e .
