"""Forward equivalence on real megatron-core GPT models (gloo, 4 CPU processes).

A model at layout A writes a legacy checkpoint and its torch_dist twin. At layout B, every rank loads the state dict
our resharder builds in memory (``load_state_dict(strict=True)``) into a real model; its tensors must equal, bit for
bit, what megatron-core's own torch_dist resharding loads at B, and (PP = 1) its logits must match A's.

These run on a 2-process world: with 4 processes on 2 cores, gloo's busy-polling collectives inside torch_dist
saves and loads slow to minutes or stall. TP 1 -> 4 needs 4 processes and is checked by logits only.
"""

from dataclasses import asdict

import pytest
import torch

from tests.helpers.mcore_models import Layout, ModelSpec

DENSE = ModelSpec()
MOE = ModelSpec(num_experts=4)
GQA_SWIGLU = ModelSpec(heads=4, query_groups=2, swiglu=True, ffn=64, bias=False)
UNTIED = ModelSpec(tie=False)
MOE_SWIGLU = ModelSpec(num_experts=4, swiglu=True, bias=False)

CASES = [
    ("dense tp2->tp1", DENSE, Layout(tp=2), Layout(tp=1)),
    ("dense tp1->tp2", DENSE, Layout(tp=1), Layout(tp=2)),
    ("dense pp2->pp1", DENSE, Layout(pp=2), Layout(pp=1)),
    ("dense pp1->pp2", DENSE, Layout(pp=1), Layout(pp=2)),
    ("moe ep2->ep1", MOE, Layout(ep=2), Layout(ep=1)),
    ("moe ep1->ep2", MOE, Layout(ep=1), Layout(ep=2)),
    ("moe tp2ep2etp1->tp1ep1", MOE, Layout(tp=2, ep=2, etp=1), Layout(tp=1, ep=1)),
    ("moe swiglu tp2etp2->tp1", MOE_SWIGLU, Layout(tp=2, etp=2), Layout(tp=1)),
    ("gqa swiglu tp2->tp1", GQA_SWIGLU, Layout(tp=2), Layout(tp=1)),
    ("gqa swiglu tp1->tp2", GQA_SWIGLU, Layout(tp=1), Layout(tp=2)),
    ("vpp2 -> none", DENSE, Layout(pp=2, vpp=2), Layout(pp=1)),
    ("untied pp2->tp2", UNTIED, Layout(pp=2), Layout(tp=2)),
]
# The legacy GroupedMLP (experts.weight1/weight2; megatron-core 0.16.1 with a STAND-IN for the CUDA-only
# grouped_gemm package, see tests/helpers/cpu_compat.py) read into sequential experts at another layout: the
# reference is megatron-core's own load of the GroupedMLP model's torch_dist twin into the sequential model.
GROUPED_CASES = [
    ("grouped ep2->sequential ep1", ModelSpec(num_experts=4, bias=False, grouped_gemm=True), Layout(ep=2),
     Layout(ep=1)),
    ("grouped swiglu tp2etp2->sequential tp1 ep2", ModelSpec(num_experts=4, swiglu=True, bias=False,
                                                             grouped_gemm=True), Layout(tp=2, etp=2), Layout(ep=2)),
]


@pytest.mark.parametrize("name, spec, src, dst", GROUPED_CASES, ids=[c[0] for c in GROUPED_CASES])
def test_legacy_grouped_mlp_reads_as_sequential_experts(mcore_pool2, tmp_path, name, spec, src, dst):
    legacy, dist = str(tmp_path / "legacy"), str(tmp_path / "dist")
    mcore_pool2.run("tests.helpers.tasks:write_both", spec=asdict(spec), layout=asdict(src), legacy_root=legacy,
                    dist_root=dist)
    from megatron_preflight.layout.discover import discover
    from megatron_preflight.reshard.plan.index import has_legacy_grouped

    layout = discover(legacy)
    assert has_legacy_grouped(layout) and "decoder.layers.0.mlp.experts.weight1" in layout.shards[0].meta["model"]
    from megatron_preflight.check.report import render_layout

    assert "experts     legacy GroupedMLP" in render_layout(legacy)  # inspect says what it is
    sequential = asdict(spec) | {"grouped_gemm": False}
    out = mcore_pool2.run("tests.helpers.tasks:reshard_and_compare", spec=sequential, layout=asdict(dst),
                          legacy_root=legacy, dist_root=dist)
    assert all(r["param_order_ok"] for r in out)
    assert all(r["max_tensor_diff"] == 0.0 for r in out), [r["max_tensor_diff"] for r in out]
    assert (out[0]["logits"] - out[0]["ref_logits"]).abs().max().item() == 0.0
    # the check calls it a reshard (was: not mapped); the plain optimizer's state is carried (no --no-load-optim)
    from megatron_preflight.check.plan import Verdict, make_plan
    from megatron_preflight.check.runtime_args import from_cli

    flags = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "100",
             "--make-vocab-size-divisible-by", "16", "--num-experts", "4", "--disable-bias-linear",
             "--transformer-impl", "local", "--expert-model-parallel-size", str(dst.ep), "--world-size", "2",
             *(["--swiglu"] if spec.swiglu else [])]
    plan = make_plan(legacy, from_cli(flags))
    f, = [f for f in plan.findings if f.field == "moe_grouped_gemm"]
    assert plan.verdict == Verdict.RESHARD and f.severity.value == "reshard" and "--no-load-optim" not in f.fix, \
        [x.to_json() for x in plan.findings if x.severity.value != "info"]
    # the same flags as saved: a Megatron without GroupedMLP (the hook asks megatron.core) needs the reshard; one
    # that still builds it loads as is; unknown (offline): said, not decided
    at = flags.index("--expert-model-parallel-size")
    saved = flags[:at] + flags[at + 2:] + [
        "--tensor-model-parallel-size", str(src.tp), "--expert-model-parallel-size", str(src.ep),
        "--expert-tensor-parallel-size", str(src.etp or src.tp), "--moe-grouped-gemm"]  # the checkpoint's layout
    for builds, verdict in ((False, Verdict.RESHARD), (True, Verdict.LOAD), (None, Verdict.LOAD)):
        rt = from_cli(saved)
        rt.builds_grouped_mlp = builds
        assert make_plan(legacy, rt).verdict == verdict, builds


# Cases where megatron-core's torch_dist load (the tensor reference) is very slow or stalls under gloo with 4
# processes on 2 cores; there the logits against the source model are the check (the target is PP = 1).
NO_DIST_REFERENCE: set[str] = set()


@pytest.mark.parametrize("name, spec, src, dst", CASES, ids=[c[0] for c in CASES])
def test_resharded_model_matches(mcore_pool2, tmp_path, name, spec, src, dst):
    mcore_pool = mcore_pool2
    legacy, dist = str(tmp_path / "legacy"), str(tmp_path / "dist")
    logits_a = mcore_pool.run("tests.helpers.tasks:write_both", spec=asdict(spec), layout=asdict(src),
                              legacy_root=legacy, dist_root=dist)[0]
    reference = name not in NO_DIST_REFERENCE
    out = mcore_pool.run("tests.helpers.tasks:reshard_and_compare", spec=asdict(spec), layout=asdict(dst),
                         legacy_root=legacy, dist_root=dist, reference=reference)
    # Parameters come out in the target model's named_parameters() order (what the optimizer state is numbered by).
    assert all(r["param_order_ok"] for r in out)
    if reference:
        assert all(r["max_tensor_diff"] == 0.0 for r in out), [r["max_tensor_diff"] for r in out]
    else:
        assert dst.pp == 1 and logits_a is not None
    if out[0]["logits"] is not None and reference:
        assert (out[0]["logits"] - out[0]["ref_logits"]).abs().max().item() <= 1e-5
        if logits_a is not None:
            diff = (out[0]["logits"] - logits_a).abs().max().item()
            assert diff <= 1e-5, diff
            assert torch.isfinite(out[0]["logits"]).all()


def test_dense_tp1_to_tp4_logits(mcore_pool, tmp_path):
    """TP 1 -> 4 on a 4-process world: logits against the source model (no torch_dist round, see module doc)."""
    spec, legacy = DENSE, str(tmp_path / "legacy")
    logits_a = mcore_pool.run("tests.helpers.tasks:write_checkpoint", spec=asdict(spec), layout=asdict(Layout(tp=1)),
                              root=legacy)[0]
    out = mcore_pool.run("tests.helpers.tasks:reshard_and_compare", spec=asdict(spec), layout=asdict(Layout(tp=4)),
                         legacy_root=legacy, dist_root="", reference=False)
    assert (out[0]["logits"] - logits_a).abs().max().item() <= 1e-5


def test_rope_model_roundtrip(mcore_pool, tmp_path):
    """RoPE (no position-embedding weights): a real PP2 checkpoint to TP2·PP1 and back, bit-exact."""
    from megatron_preflight.reshard import write_resharded
    from megatron_preflight.reshard.target import TargetLayout
    from tests.reshard.test_roundtrip_real import assert_same_weights, model_tensors

    spec = ModelSpec(position="rope", tie=False)
    src = str(tmp_path / "src")
    mcore_pool.run("tests.helpers.tasks:write_checkpoint", spec=asdict(spec), layout=asdict(Layout(pp=2)), root=src)
    write_resharded(src, str(tmp_path / "mid"), TargetLayout(tp=2, pp=1))
    write_resharded(str(tmp_path / "mid"), str(tmp_path / "back"), TargetLayout(tp=1, pp=2))
    a = model_tensors(src)
    assert not any("position_embeddings" in k[2] for k in a)
    assert_same_weights(a, model_tensors(str(tmp_path / "back")))
