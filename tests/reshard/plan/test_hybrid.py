"""A GPT checkpoint as a HybridModel's (reshard/plan/hybrid.py): GPT layer i is hybrid layers 2i (attention) and 2i+1
(MLP or MoE), on real Megatron-LM GPT checkpoints. The oracle is the GPT checkpoint resharded without the rename:
every tensor must be the same bytes under its hybrid name."""

import argparse
import os

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.plan.hybrid import gpt_pattern, gpt_to_hybrid_problem, moe_layers
from tests.conftest import fixture_path
from tests.helpers.ckpt_edit import load


def _args(**kw):
    return argparse.Namespace(**{"num_layers": 4, "num_experts": None, **kw})


def test_the_moe_layers_of_every_moe_layer_freq_form():
    assert moe_layers(_args()) == [False] * 4
    assert moe_layers(_args(num_experts=4)) == [True] * 4
    assert moe_layers(_args(num_experts=4, moe_layer_freq=2)) == [True, False, True, False]
    assert moe_layers(_args(num_experts=4, moe_layer_freq=[0, 1, 1, 1])) == [False, True, True, True]
    assert moe_layers(_args(num_experts=4, moe_layer_freq="([0]+[1]*3)")) == [False, True, True, True]
    assert moe_layers(_args(num_experts=4, moe_layer_freq="__import__('os')")) is None  # never evaluated
    assert moe_layers(_args(num_experts=4, moe_layer_freq="[1]*3")) is None  # not one per layer


def test_the_pattern_of_a_gpt_model():
    assert gpt_pattern(_args()) == "*-*-*-*-"
    assert gpt_pattern(_args(num_experts=4, moe_layer_freq="([0]+[1]*3)", mtp_num_layers=1)) == "*-*E*E*E/*E"
    assert gpt_to_hybrid_problem(_args(), "*-*-|*-*-") is None  # pipeline cuts are free
    assert "'*-*-*-*-'" in gpt_to_hybrid_problem(_args(), "*-*-*-*E")
    assert "q/k layer norms" in gpt_to_hybrid_problem(_args(qk_layernorm=True), "*-*-*-*-")
    assert gpt_to_hybrid_problem(_args(), "*-*-*-*-/*-") is not None  # MTP depths are part of the model


def _model(root, shard="mp_rank_00"):
    return load(os.path.join(root, "iter_0000002", shard, "model_optim_rng.pt"))


@pytest.mark.parametrize("name, target, pattern", [
    ("te_tp2_torch", {"tp": 1}, "*-*-*-*-"),  # Transformer Engine spec
    ("tp2_torch", {"tp": 1, "transformer_impl": "transformer_engine"}, "*-*-*-*-"),  # local spec, bridged to TE
    ("mtp_moe_te_ep2_torch", {"tp": 1, "ep": 1}, "*E*E*E*E/*E"),  # TE-grouped experts and an MoE MTP layer
])
def test_a_gpt_checkpoint_renamed_into_hybrid_layers_keeps_every_tensor(tmp_path, name, target, pattern):
    gpt, hybrid = str(tmp_path / "gpt"), str(tmp_path / "hybrid")
    write_resharded(fixture_path(name), gpt, TargetLayout(**target))
    write_resharded(fixture_path(name), hybrid, TargetLayout(**target, hybrid_layer_pattern=pattern), verify=True)
    a, b = _model(gpt), _model(hybrid)
    assert b["args"].hybrid_layer_pattern == pattern and b["args"].num_layers == 8
    mapped = {}
    for key, value in a["model"].items():
        new = key.replace("decoder.final_layernorm.", "decoder.final_norm.")
        if key.startswith("decoder.layers."):
            layer, rest = key[len("decoder.layers."):].split(".", 1)
            new = f"decoder.layers.{2 * int(layer) + (0 if rest.startswith('self_attention.') else 1)}.{rest}"
        elif ".mtp_model_layer." in key:
            head, rest = key.split(".mtp_model_layer.")
            new = f"{head}.mtp_model_layer.layers.{0 if rest.startswith('self_attention.') else 1}.{rest}"
        mapped[new] = value
    assert sorted(mapped) == sorted(b["model"])
    for key, value in mapped.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["model"][key]), key
    # the optimizer state follows its parameters: the same moments in the same order
    oa, ob = a["optimizer"], b["optimizer"]
    sa, sb = (oa.get("optimizer", oa)["state"], ob.get("optimizer", ob)["state"])
    assert len(sa) == len(sb) > 0
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa if isinstance(i, int))


def test_a_gpt_checkpoint_into_another_model_is_refused(tmp_path):
    with pytest.raises(PreflightError, match="cannot load this GPT checkpoint"):
        write_resharded(fixture_path("te_tp2_torch"), str(tmp_path / "x"),
                        TargetLayout(tp=1, hybrid_layer_pattern="*-*-M*-*-"))
    assert not os.path.exists(tmp_path / "x")


def test_a_mamba_conv_of_megatron_0_18_is_renamed_and_moved_for_a_newer_megatron(tmp_path):
    """core_r0.18.0 saved the conv as a module after in_proj (`mixer.conv1d.weight`); 0.19 and later hold it as the
    mixer's first parameters (`mixer.conv1d_weight`): a newer target gets the new names at the new place, and the plain
    optimizer's state follows its parameters (its position is the parameter's)."""
    out = str(tmp_path / "main")
    write_resharded(fixture_path("hyb18_tp2_torch"), out, TargetLayout(mamba_conv_name="conv1d_weight"), verify=True)
    old, new = _model(fixture_path("hyb18_tp2_torch")), _model(out)
    layer0 = [k.split("mixer.", 1)[1] for k in new["model"] if k.startswith("decoder.layers.0.")]
    assert layer0[:5] == ["conv1d_weight", "conv1d_bias", "dt_bias", "A_log", "D"]
    assert torch.equal(new["model"]["decoder.layers.0.mixer.conv1d_weight"],
                       old["model"]["decoder.layers.0.mixer.conv1d.weight"])
    params = [v for k, v in new["model"].items() if isinstance(v, torch.Tensor) and "_extra_state" not in k]
    state = new["optimizer"].get("optimizer", new["optimizer"])
    order = [i for g in state["param_groups"] for i in g["params"]]
    shapes = sorted(tuple(p.shape) for p in params)
    assert sorted(tuple(state["state"][i]["exp_avg"].shape) for i in order) == shapes
    # each group's moments in the model's parameter order (Megatron's groups: weight decay for >1-D non-biases),
    # so the conv's moments sit at the conv's new place
    decayed = [tuple(v.shape) for k, v in new["model"].items() if isinstance(v, torch.Tensor)
               and "_extra_state" not in k and v.dim() > 1 and not k.endswith(".bias")]
    rest = [tuple(v.shape) for k, v in new["model"].items() if isinstance(v, torch.Tensor)
            and "_extra_state" not in k and not (v.dim() > 1 and not k.endswith(".bias"))]
    groups = sorted([tuple(state["state"][i]["exp_avg"].shape) for i in g["params"]] for g in state["param_groups"])
    assert groups == sorted([decayed, rest]) and (48, 1, 4) in decayed[:2]
    back = str(tmp_path / "back")
    write_resharded(out, back, TargetLayout(mamba_conv_name="conv1d.weight"))
    assert list(_model(back)["model"]) == list(old["model"])  # and back: 0.18's names and order
