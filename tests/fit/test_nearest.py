"""check names the nearest layouts that fit when the run's does not (memory, world size, divisibility), with their
flags; each named layout, put into the run's flags, passes the check."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_preflight.check import plan as check_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.fit.flags import without_layout
from megatron_preflight.fit.nearest import annotate
from tests.conftest import fixture_path
from tests.helpers.run_flags import model_flags


def make_plan(path, rt):
    """The check as `check` and the hook render it: a failed one names the nearest layouts that fit."""
    plan = check_plan.make_plan(path, rt)
    if plan.verdict == check_plan.Verdict.FAIL:
        annotate(plan.findings, plan.index, rt)
    return plan

MOE = "moe_ep2_torch"


def _named_flags(fix: str) -> list[list[str]]:
    """The layout flags each named layout gives, as printed."""
    text = fix.split("lists and ranks every one): ", 1)[1]
    return [shlex.split(part.split("): ", 1)[1]) for part in re.split(r"; (?=TP\d)", text)]


@pytest.mark.parametrize("sizes, world, field", [
    (["--expert-model-parallel-size", "4"], 6, "world_size"),  # 6 GPUs cannot hold EP4
    (["--tensor-model-parallel-size", "3"], 6, "tensor_model_parallel_size"),  # 4 heads over TP3
    ([], 4, "memory"),  # the saved layout, on a device too small for it
])
def test_a_run_that_does_not_fit_gets_the_nearest_layouts_that_do(sizes, world, field):
    base = model_flags(fixture_path(MOE)) + ["--no-load-rng", "--micro-batch-size", "1", "--global-batch-size", "12"]
    device = ["--preflight-device-memory", "0.00085"] if field == "memory" else []  # ~870 KiB: EP2 needs more
    run = base + ["--expert-model-parallel-size", "2"] + sizes + device + ["--world-size", str(world)]
    plan = make_plan(fixture_path(MOE), from_cli(run))
    fatal = [f for f in plan.fatal if f.field == field]
    assert fatal, [(f.field, f.message) for f in plan.findings]
    assert "nearest to the run's" in fatal[0].fix, fatal[0].fix
    assert f"megatron-preflight plan {fixture_path(MOE)} --world-size {world}" in fatal[0].fix
    listed = re.search(r"\((megatron-preflight plan [^)]+?) lists and ranks every one\)", fatal[0].fix)
    assert listed, fatal[0].fix  # the command it names, run as printed: it lists the same world's layouts
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "megatron-preflight"),
                           *shlex.split(listed.group(1))[1:]], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1) and f"world       {world} ranks" in done.stdout, done.stdout + done.stderr
    named = _named_flags(fatal[0].fix)
    assert 1 <= len(named) <= 3
    for flags in named:  # followed: the run's flags with the named layout's in place of its own
        fixed = without_layout(base + device, hybrid=False) + flags + ["--world-size", str(world)]
        if "--expert-tensor-parallel-size" in flags and flags[flags.index("--tensor-model-parallel-size") + 1] != "1":
            fixed.append("--sequence-parallel")
        after = make_plan(fixture_path(MOE), from_cli(fixed))
        assert not after.fatal, (flags, [(f.field, f.message) for f in after.fatal])


def test_a_run_that_fits_gets_no_layout_advice():
    run = model_flags(fixture_path(MOE)) + ["--no-load-rng", "--expert-model-parallel-size", "2", "--world-size", "4"]
    plan = make_plan(fixture_path(MOE), from_cli(run))
    assert not plan.fatal
    assert not any("nearest to the run's" in f.fix for f in plan.findings)


def test_when_no_layout_of_the_world_fits_the_finding_says_so():
    run = model_flags(fixture_path(MOE)) + ["--no-load-rng", "--expert-model-parallel-size", "2", "--world-size", "2",
                                            "--preflight-device-memory", "0.0001"]
    plan = make_plan(fixture_path(MOE), from_cli(run))
    memory = next(f for f in plan.fatal if f.field == "memory")
    assert "no layout of 2 GPUs fits the device" in memory.fix and "more GPUs" in memory.fix, memory.fix
