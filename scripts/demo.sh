#!/usr/bin/env bash
# Set up (if needed) and run megatron-preflight on the built-in example checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1
exec .venv/bin/python examples/demo.py "$@"
