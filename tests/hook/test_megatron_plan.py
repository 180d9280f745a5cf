"""The planner's top layout, run as printed in the REAL Megatron-LM pretrain_gpt.py (skipped unless MEGATRON_LM_ROOT is
set; see tests/hook/test_megatron_lm.py): it trains with the loss of Megatron's own reshard of the checkpoint's
torch_dist twin at that layout, and each rank allocates exactly the parameter, gradient and optimizer bytes the plan
gave for it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_preflight import fit, reshard
from megatron_preflight.check.memory import GIB
from megatron_preflight.fit.choose import MARGIN, Load
from tests.conftest import fixture_path
from tests.hook.test_megatron_lm import MEMORY_PROBE, ROOT, TINY, loss, run

pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here")


def test_the_top_planned_layout_trains_like_megatrons_reshard_and_allocates_what_the_plan_says(tmp_path):
    source, world = "distopt_tp2dp2_torch", 4
    common = ["--no-load-rng", "--train-iters", "4", "--use-distributed-optimizer", "--ckpt-format", "torch"]
    run_flags = [*TINY, *common]
    index = reshard.open_index(fixture_path(source))
    rt = fit.run_args(index.layout.saved_args, run_flags)
    every = fit.plan_layouts(index, rt, run_flags, world).candidates
    saved = min(c.worst.total for c in every if c.load == Load.AS_SAVED)
    least = min(c.worst.total for c in every)
    assert least < saved  # a device that holds the smallest layout and no layout as saved
    device = least / MARGIN / GIB * 1.0001
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "plan", fixture_path(source), "--world-size",
                        str(world), "--device-memory", repr(device), "--json", "--", *run_flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    top = json.loads(r.stdout)["candidates"][0]
    assert top["fits"] and top["load"] == "preflight reshards" and top["check"]["verdict"] == "reshard", top
    flags = top["flags"][len(TINY):]  # (run() puts the TINY base flags first itself)
    assert top["flags"][:len(TINY)] == TINY

    probe = tmp_path / "memory_probe.py"
    probe.write_text(MEMORY_PROBE)
    rc, log = run(tmp_path, fixture_path(source), world, *flags, "--preflight", "auto", port=29801,
                  launch=[str(probe)])
    (tmp_path / "run.log").write_text(log)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    measured = [json.loads(doc) for doc in re.findall(r"MEMORY_PROBE (\{[^{}]*\})", log)]
    assert len(measured) == world
    planned = top["memory"]
    for m in measured:  # the layout's ranks all hold what its largest one does here (PP1 or even stages)
        assert (m["params"], m["grads"]) == (planned["params"], planned["grads"]), (m, planned)
        assert abs(m["optimizer"] - planned["optimizer"]) <= 0.02 * planned["optimizer"], (m, planned)

    oracle = [f.replace("torch", "torch_dist") if f == "torch" else f for f in flags]
    rc2, log2 = run(tmp_path, fixture_path(source + "_dist"), world, *oracle, plugin=False, port=29802)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


def test_the_hook_names_the_nearest_layouts_before_it_stops_a_run_that_cannot_run(tmp_path):
    """A run at TP3 on 2 GPUs (4 heads; 2 ranks cannot hold TP3): Megatron's validate_args refuses it before the check
    can run (before torch.distributed is up); the hook's rank 0 names the layouts of 2 GPUs nearest to the run's, with
    their flags, then Megatron's own error ends the job."""
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "3", "--ckpt-format",
                  "torch", "--no-load-rng", "--preflight", "check", port=29803, verify=False)
    assert rc == 1 and "lm loss" not in log, log[-3000:]
    assert "Megatron refuses the run's layout (world size (2) is not divisible" in log, log[-3000:]
    assert "the layouts of 2 GPUs nearest to the run's" in log, log[-3000:]
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" in log


def test_the_hook_names_the_nearest_layouts_when_the_run_does_not_fit_the_device(tmp_path):
    """TP1 on 2 GPUs of a device too small for it (TP1 DP2 needs ~0.78 MiB a rank, TP2 0.44, PP2 0.51; 90 % of the
    0.6 MiB device is 0.54): the check stops the job at start; its memory finding names the nearest layouts that fit."""
    rc, log = run(tmp_path, fixture_path("tp2_torch"), 2, "--tensor-model-parallel-size", "1", "--ckpt-format",
                  "torch", "--no-load-rng", "--preflight", "check", "--preflight-device-memory", "0.0006", port=29804,
                  verify=False)
    assert rc == 1 and "lm loss" not in log, log[-3000:]
    assert "does not fit the device" in log and "the layouts of 2 GPUs that fit the device nearest" in log, log[-3000:]
    assert "TP2 CP1 PP1 DP1 (as saved" in log and "TP1 CP1 PP2 DP1 (preflight reshards" in log
