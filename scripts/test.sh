#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1
# two pytest workers (pytest-xdist), a test file each at a time, for the 2-core box CI runs on (on such a box here: a
# serial run ~19 min, two workers ~13). PYTEST_WORKERS=0 runs serially.
workers=${PYTEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ] && .venv/bin/python -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
fi
set +e
.venv/bin/python -m pytest -q ${parallel[@]+"${parallel[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: that is a failure" >&2; exit 1; fi
exit $rc
