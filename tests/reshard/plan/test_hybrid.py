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
