"""`inspect` and `check` read metadata without importing torch, and answer exactly as with torch loaded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import main
from tests.conftest import FIXTURES

CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
RUN_FLAGS = {
    "same": None,  # the checkpoint's own sizes (filled per case from inspect)
    "other": ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer", "--bf16"],
}
# Run the CLI in a fresh interpreter and report which heavy modules it loaded.
_PROBE = """
import json, sys
from megatron_preflight.cli.main import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print(json.dumps([m for m in ("torch", "numpy", "torch.distributed.checkpoint") if m in sys.modules]), file=sys.stderr)
sys.exit(rc)
"""


def _fresh(args: list[str]) -> tuple[int, dict, list[str]]:
    p = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    loaded = json.loads(p.stderr.strip().splitlines()[-1])
    return p.returncode, json.loads(p.stdout), loaded


def _here(args: list[str]) -> tuple[int, dict]:
    import torch  # noqa: F401 - the mode the hook and the resharder run in

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, json.loads(out.getvalue())


def _same_sizes(layout: dict) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout["tp"] or 1), "--pipeline-model-parallel-size",
             str(layout["pp"] or 1), "--expert-model-parallel-size", str(layout["ep"] or 1)]
    return flags + (["--use-distributed-optimizer"] if layout["distributed_optimizer"] else [])


@pytest.mark.parametrize("case", CASES)
def test_inspect_and_check_never_load_torch_and_answer_as_with_it(case):
    path = os.path.join(FIXTURES, case)
    rc, free, loaded = _fresh(["inspect", path, "--json"])
    assert loaded == [], f"inspect loaded {loaded}"
    assert (rc, free) == _here(["inspect", path, "--json"])
    for flags in (_same_sizes(free), RUN_FLAGS["other"]):
        args = ["check", path, "--json", "--", *flags]
        rc, plan, loaded = _fresh(args)
        assert loaded == [], f"check loaded {loaded}"
        plan.pop("seconds", None)
        rc2, plan2 = _here(args)
        plan2.pop("seconds", None)
        assert (rc, plan) == (rc2, plan2)
