"""The legacy GroupedMLP's plain-optimizer state (its packed experts.weight1/weight2: one Adam state and one fp32
master per packed tensor) carried to sequential experts, proven with megatron-core's own optimizer.

A real megatron-core 0.16.1 GroupedMLP model (bf16, the CPU stand-in for the CUDA-only ``grouped_gemm`` package:
a per-expert matmul loop) is trained two steps by megatron-core's Float16OptimizerWithFloat16Params (over torch AdamW,
as without apex / TE) and saved in the legacy format with that optimizer's state dict; it then takes a third step.
A sequential-experts model at another expert-parallel size loads our reshard (offline, and in memory as the hook
does) into itself and into its own megatron-core optimizer, and takes the same third step. The oracle is the live
GroupedMLP optimizer: every expert's fp32 master and Adam moments after the load equal the packed ones read as
GroupedMLP's forward reads its experts (``weight1.view(E, hidden, -1)[j]``), bit for bit, and so does the step.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

from megatron_preflight.reshard import TargetLayout, write_resharded
from tests.helpers.mcore_models import Layout, ModelSpec

SPEC = ModelSpec(num_experts=4, swiglu=True, bias=False, grouped_gemm=True, dtype="bfloat16")
SEQUENTIAL = asdict(SPEC) | {"grouped_gemm": False}
FIELDS = ("param", "master", "exp_avg", "exp_avg_sq")


def _merged(results: list[dict], when: str) -> dict:
    out: dict = {}
    for r in results:
        out.update(r[when])
    return out


def _differences(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return [f"{k} {f}" for k in sorted(a) for f in FIELDS if not torch.equal(a[k][f], b[k][f])]


@pytest.fixture(scope="module")
def trained(_training_pools, tmp_path_factory):
    from tests.conftest import training_pool

    root = str(tmp_path_factory.mktemp("grouped") / "ckpt")
    out = training_pool(_training_pools).run("tests.helpers.tasks:train_grouped_and_save", spec=asdict(SPEC), layout=asdict(Layout(ep=2)),
                          root=root)
    return root, _merged(out, "before"), _merged(out, "after")


def test_the_plain_optimizer_state_of_packed_experts_is_carried_offline(training_pool2, tmp_path, trained):
    root, before, after = trained
    out = str(tmp_path / "sequential")
    write_resharded(root, out, TargetLayout(ep=1), verify=True)
    files = {str(r): os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt") for r in range(2)}
    res = training_pool2.run("tests.helpers.tasks:resume_and_step", spec=SEQUENTIAL, layout=asdict(Layout(ep=1)),
                          state=files)
    assert _differences(before, res[0]["before"]) == []  # masters, moments and bf16 weights, every expert
    assert _differences(after, res[0]["after"]) == []  # and the next step (Adam's bias correction continues)


def test_the_plain_optimizer_state_of_packed_experts_is_carried_in_memory(training_pool2, trained):
    root, before, after = trained
    res = training_pool2.run("tests.helpers.tasks:resume_and_step", spec=SEQUENTIAL, layout=asdict(Layout(ep=2)),
                          source=root)
    assert _differences(before, _merged(res, "before")) == []
    assert _differences(after, _merged(res, "after")) == []


def test_without_the_optimizer_state_the_step_differs(training_pool2, trained):
    """The control: the same load with a fresh optimizer (--no-load-optim) takes a different step."""
    root, _, after = trained
    res = training_pool2.run("tests.helpers.tasks:resume_and_step", spec=SEQUENTIAL, layout=asdict(Layout(ep=2)),
                          source=root, with_optimizer=False)
    moved = [d for d in _differences(after, _merged(res, "after")) if d.endswith(" param")]
    assert len(moved) > 20, moved


def test_the_distributed_optimizer_state_of_packed_experts_is_carried(training_pool2, tmp_path):
    """The same with megatron-core's DistributedOptimizer (its distrib_optim.pt: each packed weight one range of the
    buffers), resumed at EP1 by the distributed optimizer, offline and in memory."""
    root = str(tmp_path / "ckpt")
    out = training_pool2.run("tests.helpers.tasks:train_grouped_and_save", spec=asdict(SPEC), layout=asdict(Layout(ep=2)),
                          root=root, distributed=True)
    before, after = _merged(out, "before"), _merged(out, "after")
    assert os.path.isfile(os.path.join(root, "iter_0000002", "mp_rank_00_000", "distrib_optim.pt"))
    dst = str(tmp_path / "sequential")
    write_resharded(root, dst, TargetLayout(ep=1), verify=True)
    files = {str(r): os.path.join(dst, "iter_0000002", "mp_rank_00", "model_optim_rng.pt") for r in range(2)}
    res = training_pool2.run("tests.helpers.tasks:resume_and_step", spec=SEQUENTIAL, layout=asdict(Layout(ep=1)),
                          state=files, distributed=True)
    assert _differences(before, res[0]["before"]) == []
    assert _differences(after, res[0]["after"]) == []

