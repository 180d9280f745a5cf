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
# a static path in a .pth (setuptools' compat mode), not the default editable finder: site imports no finder (and
# pathlib, urllib) at every interpreter start, ~9 ms of each command and of each process the tests start; a
# setuptools without that mode gets the default editable install
.venv/bin/pip install -q --no-deps -e . --config-settings editable_mode=compat 2>/dev/null \
  || .venv/bin/pip install -q --no-deps -e .
