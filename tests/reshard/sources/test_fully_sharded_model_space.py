"""The distributed optimizer's ``fully_sharded_model_space`` torch_dist form (each parameter's state flattened by
fragments, the DP ranks' ranges as chunks: megatron-core <= 0.15's default, which megatron-core 0.16 and Megatron-LM
main can no longer load), read from a checkpoint megatron-core 0.13.1 itself wrote on CPU
(tests/fixtures/megatron-core-0.13/make.py: bf16 GQA + SwiGLU GPT trained 2 steps at TP2·DP2).

The oracle is megatron-core 0.13.1's own load of that checkpoint at TP1·DP2 (recorded beside it): every parameter's
weight, fp32 master and Adam moments as its DistributedOptimizer then held them.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_preflight.check.report import render_layout
from megatron_preflight.prove.diff import diff_checkpoints
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors, value_of
from megatron_preflight.reshard import TargetLayout, open_index, write_resharded
from megatron_preflight.reshard.sources.files import SourceFiles

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                    "megatron-core-0.13")
SRC = os.path.join(HERE, "fsms_bf16_tp2dp2_torch_dist")
FIELDS = {"param": "", "master": "#@master", "exp_avg": "#exp_avg", "exp_avg_sq": "#exp_avg_sq"}


@pytest.fixture(scope="module")
def oracle():
    return torch.load(os.path.join(HERE, "fsms_bf16_tp2dp2_oracle_tp1.pt"), weights_only=False)


def test_inspect_names_the_form():
    assert "distributed, fully_sharded_model_space" in render_layout(SRC)


def test_every_global_state_equals_megatron_core_013s_own_load(oracle):
    g = global_resharder(open_index(SRC), True, None)
    assert g.optimizer_problem is None and g.plain_step() == 2.0 == oracle["steps"][0]
    named = named_tensors(global_plan(g), True)
    files = SourceFiles(g.layout.iter_dir)
    try:
        for name, fields in oracle["tensors"].items():
            for field, suffix in FIELDS.items():
                got, want = value_of(named[name + suffix], files), fields[field]
                if name == "embedding.word_embeddings.weight":
                    got = got[:want.shape[0]]
                assert got.dtype == want.dtype and torch.equal(got, want), (name, field)
    finally:
        files.close()
    assert len(oracle["tensors"]) == 4 * 8 + 4  # every parameter: 8 per layer, embeddings, final norm


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "plain"])
def test_a_legacy_reshard_resumes_with_the_state_megatron_core_013_loaded(training_pool2, tmp_path, oracle, distributed):
    out = str(tmp_path / "tp1")
    write_resharded(SRC, out, TargetLayout(tp=1, distributed_optimizer=distributed), verify=True)
    files = {str(r): os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt") for r in range(2)}
    res = training_pool2.run("tests.helpers.tasks:resume_and_step", spec=oracle["spec"], layout={"tp": 1}, state=files,
                          distributed=distributed)
    loaded = {k.split(":", 1)[1]: v for k, v in res[0]["before"].items()}
    bad = [(k, f) for k, v in oracle["tensors"].items() for f in FIELDS if not torch.equal(loaded[k][f], v[f])]
    assert bad == []


def test_a_torch_dist_reshard_holds_it_in_the_form_megatron_main_loads(tmp_path):
    out = str(tmp_path / "dist")
    write_resharded(SRC, out, TargetLayout(tp=1, ckpt_format="torch_dist", distributed_optimizer=True))
    assert "distributed, fully_reshardable" in render_layout(out)
    report = diff_checkpoints(SRC, out)
    assert report.equal and any(t.name.endswith("#@master") for t in report.tensors), report.render()

