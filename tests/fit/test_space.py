"""Every layout the planner lists is one Megatron accepts: megatron-core builds its process groups over a world of N
ranks and validates its model config (tests/helpers/megatron_accepts.py); and the layouts it leaves out are ones
Megatron refuses or the model cannot hold."""

from __future__ import annotations

import pytest

from megatron_preflight import fit, reshard
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.fit.space import stage_split
from tests.conftest import fixture_path
from tests.helpers.megatron_accepts import accepts
from tests.helpers.run_flags import model_flags

pytest.importorskip("megatron.core")


def _case(rt, cand, world):
    lay = cand.layout
    model = {"num_layers": rt.num_layers, "hidden_size": rt.hidden_size, "num_attention_heads": rt.num_attention_heads,
             "num_query_groups": rt.num_query_groups, "ffn_hidden_size": rt.ffn_hidden_size,
             "kv_channels": rt.kv_channels}
    if rt.num_experts:
        model.update(num_moe_experts=rt.num_experts, moe_ffn_hidden_size=rt.moe_ffn_hidden_size,
                     add_bias_linear=rt.add_bias_linear)
    return {"world": world, "model": model,
            "layout": {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp_eff, "vpp": lay.vpp,
                       "first": lay.first_stage_layers, "last": lay.last_stage_layers,
                       "embedding_in_split": lay.embedding_in_split, "loss_in_split": lay.loss_in_split}}


@pytest.mark.parametrize("name, world, extra", [
    ("moe_ep2_torch", 8, ["--num-experts", "4", "--disable-bias-linear"]),  # (no biases: ETP > 1 allowed)
    ("acct_emb_pp2_torch", 6, []),  # 5 layers: uneven stages
    ("distopt_vpp_pp2dp2_torch", 8, ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("bf16_gqa_tp2_torch", 16, []),
])
def test_megatron_accepts_every_listed_layout(name, world, extra):
    index = reshard.open_index(fixture_path(name))
    argv = model_flags(fixture_path(name)) + extra
    rt = fit.run_args(index.layout.saved_args, argv)
    plan = fit.plan_layouts(index, rt, argv, world)
    assert plan.candidates
    answers = accepts([_case(rt, c, world) for c in plan.candidates])
    for cand, ans in zip(plan.candidates, answers, strict=True):
        assert ans["ok"], (cand.describe(), ans["error"])
        assert ans["dp"] == cand.dp, cand.describe()  # the data-parallel size the plan's memory divides by


def test_a_deepseek_v3_shape_on_1024_gpus_lists_only_layouts_megatron_accepts(tmp_path):
    """The DeepSeek-V3 structure (61 layers, 3 dense, 256 experts, MLA, MTP; widths narrowed 64x, the sizes that decide
    divisibility kept: 128 heads, 256 experts), saved at PP4 EP8: planned for 1,024 GPUs; the top layouts and a spread
    of the rest built by megatron-core over 1,024 ranks."""
    from tests.helpers.synthetic_dsv3 import DSV3, write_legacy

    m = DSV3(pp=4, ep=8, scale=64, first_stage_layers=16, last_stage_layers=15)
    write_legacy(str(tmp_path / "dsv3"), m)
    index = reshard.open_index(str(tmp_path / "dsv3"))
    rt = fit.run_args(index.layout.saved_args, [])
    plan = fit.plan_layouts(index, rt, None, 1024)
    cands = plan.candidates
    assert len(cands) > 50
    assert {c.layout.pp for c in cands} >= {1, 2, 4, 8, 16, 32}  # 61 layers: uneven splits where PP does not divide
    assert all(c.layout.tp <= 8 for c in cands)  # TP inside a node of 8
    picked = cands[:8] + cands[8::max(1, len(cands) // 12)]
    answers = accepts([_case(rt, c, 1024) for c in picked])
    for cand, ans in zip(picked, answers, strict=True):
        assert ans["ok"], (cand.describe(), ans["error"])
        assert ans["dp"] == cand.dp


def test_what_the_planner_leaves_out_megatron_refuses():
    """Sizes the planner skips for the tiny MoE model (TP 8 over 4 heads, ETP 2 with expert biases) are refused by
    megatron-core too (EP over more ranks than experts and CP over too short a sequence are Megatron-LM's argument
    rules: see the test against validate_args below)."""
    world = 16
    model = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 4,
             "ffn_hidden_size": 64, "kv_channels": 8, "num_moe_experts": 4, "moe_ffn_hidden_size": 64,
             "add_bias_linear": True}
    base = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "vpp": None, "first": None, "last": None}
    bad = [dict(base, tp=8, etp=8), dict(base, tp=2, etp=2)]
    answers = accepts([{"world": world, "model": model, "layout": lay} for lay in bad])
    assert [a["ok"] for a in answers] == [False, False], answers
    index = reshard.open_index(fixture_path("moe_ep2_torch"))
    argv = model_flags(fixture_path("moe_ep2_torch"))
    listed = {(c.layout.tp, c.layout.ep, c.layout.etp_eff) for c in
              fit.plan_layouts(index, fit.run_args(index.layout.saved_args, argv), argv, world).candidates}
    assert not listed & {(8, 1, 8), (1, 8, 1), (2, 1, 2)}


@pytest.mark.parametrize("layers, pp, want", [
    (61, 16, (3, 2)), (61, 8, (7, 6)), (5, 2, (3, None)), (8, 4, (None, None)), (61, 64, None), (4, 1, (None, None)),
    (61, 32, (16, 15)),  # no even middle fits 61 layers better: 16 + 30 x 1 + 15 (valid; ranked by its memory)
])
def test_stage_split_is_the_most_balanced_megatron_accepts(layers, pp, want):
    split = stage_split(layers, pp, RuntimeArgs(), hybrid=False)
    assert (None if split is None else (split.first, split.last)) == want


VALIDATE = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
from megatron.training.arguments import parse_args, validate_args
out = []
for world, flags in json.loads(sys.argv[1]):
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        validate_args(parse_args())
        out.append("")
    except BaseException as exc:  # an assert, or argparse's exit
        out.append(f"{type(exc).__name__}: {exc}" or type(exc).__name__)
print("VALIDATED " + json.dumps(out), flush=True)
"""


def test_megatron_lm_validate_args_accepts_every_listed_layouts_flags():
    """Each listed layout's flags (the run's flags at that layout, as printed) pass Megatron-LM's own parse_args +
    validate_args at the world size (real Megatron-LM: skipped unless MEGATRON_LM_ROOT is set); and a size the planner
    leaves out (EP over more ranks than experts, CP over too short a sequence) fails there."""
    import json
    import os
    import subprocess
    import sys

    root = os.environ.get("MEGATRON_LM_ROOT")
    if not root:
        pytest.skip("MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here")
    from tests.helpers.tiny import MODEL_FLAGS

    run = [*MODEL_FLAGS, "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-4",
           "--mock-data", "--disable-bias-linear", *os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split()]
    cases = []
    for name, world, extra in (("moe_ep2_torch", 8, ["--num-experts", "4"]), ("acct_emb_pp2_torch", 4, []),
                               ("distopt_vpp_pp2dp2_torch", 8, ["--num-layers-per-virtual-pipeline-stage", "1"])):
        index = reshard.open_index(fixture_path(name))
        argv = [*run, *extra, *(["--num-layers", "5"] if name == "acct_emb_pp2_torch" else [])]
        rt = fit.run_args(index.layout.saved_args, argv)
        cases += [(world, c.flags) for c in fit.plan_layouts(index, rt, argv, world).candidates]
    moe = [*run, "--num-experts", "4"]
    refused = [(16, [*moe, "--expert-model-parallel-size", "8"]), (16, [*run, "--context-parallel-size", "32"])]
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("MEGATRON_LM_PYTHONPATH", ""), root) if p))
    r = subprocess.run([python, "-c", VALIDATE, json.dumps(cases + refused)], env=env, capture_output=True, text=True,
                       timeout=900, cwd=root)
    line = next((x for x in r.stdout.splitlines() if x.startswith("VALIDATED ")), None)
    assert line, (r.stdout[-2000:], r.stderr[-3000:])
    errors = json.loads(line[len("VALIDATED "):])
    assert len(cases) > 30
    for (world, flags), error in zip(cases, errors, strict=False):
        assert not error, (world, flags, error)
    assert all(errors[len(cases):]), errors[len(cases):]


def test_divisors_by_trial_division_equal_the_plain_count():
    from megatron_preflight.fit.space import divisors

    for n in [*range(1, 400), 1024, 16384, 100000, 360360]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert len(divisors(1_000_000_000)) == 100  # 2^9 x 5^9: (9+1)^2 — found from 31,623 trials, not 10^9
