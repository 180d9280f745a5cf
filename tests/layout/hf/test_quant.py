"""What each publisher's quantization_config means (layout/hf/quant.py): the FP8 scale forms it allows, each refusal
naming the field, and each weight's block read from its scale's shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf import quant


def compressed(weights: dict, fmt: str = "float-quantized", **top) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it, one config group."""
    group = {"targets": ["Linear"], "weights": dict({"num_bits": 8, "type": "float", "symmetric": True,
                                                     "dynamic": False}, **weights),
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    return {"quantization_config": dict({"quant_method": "compressed-tensors", "format": fmt,
                                         "config_groups": {"group_0": group}, "sparsity_config": {},
                                         "transform_config": {}}, **top)}


@pytest.mark.parametrize("weights, form", [
    ({"strategy": "tensor"}, quant.TENSOR),
    ({"strategy": "channel"}, quant.CHANNEL),
    ({"strategy": "group", "group_size": 128}, quant.Form(1, 128, "per-group (128)")),
    ({"strategy": "block", "block_structure": [128, 128]}, quant.Form(128, 128, "128x128 block")),
])
def test_compressed_tensors_float_quantized_strategies_are_scale_forms(weights, form):
    scheme = quant.scheme_of(compressed(weights), "config.json")
    assert scheme.forms == (form,) and scheme.suffix == "_scale"
    assert "compressed-tensors float-quantized" in scheme.describe()
    assert scheme.ignores("model.layers.0.mlp.down_proj.input_scale")
    assert not scheme.ignores("model.layers.0.mlp.down_proj.weight_scale")


def test_every_config_group_adds_its_form():
    cfg = compressed({"strategy": "channel"})
    cfg["quantization_config"]["config_groups"]["group_1"] = {
        "targets": ["re:.*down_proj$"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 32]}}
    assert quant.scheme_of(cfg, "c").forms == (quant.CHANNEL, quant.Form(64, 32, "64x32 block"))


@pytest.mark.parametrize("cfg, words", [
    (compressed({"strategy": "group", "num_bits": 4, "type": "int", "group_size": 128}, fmt="pack-quantized"),
     ["format 'pack-quantized'", "float-quantized"]),
    (compressed({"strategy": "channel", "symmetric": False}), ["symmetric: False", "symmetric 8-bit float"]),
    (compressed({"strategy": "channel", "num_bits": 4}), ["num_bits: 4"]),
    (compressed({"strategy": "tensor_group", "group_size": 16}), ["strategy 'tensor_group'"]),
    (compressed({"strategy": "group"}), ["strategy 'group'", "with group_size"]),
    (compressed({"strategy": "channel"}, sparsity_config={"format": "sparse-24-bitmask"}),
     ["sparsity_config", "sparse-24-bitmask"]),
    (compressed({"strategy": "channel"}, transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
     ["transform_config", "rotated"]),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"}},
     ["no config_groups"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, ["quant_algo 'NVFP4'", "FP8"]),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}, ["weight_block_size", "None"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quant_method 'awq'"]),
])
def test_what_is_not_read_is_refused_naming_the_field(cfg, words):
    with pytest.raises(PreflightError) as e:
        quant.scheme_of(cfg, "/m/config.json")
    assert e.value.code == "hf_quantized" and all(w in e.value.message for w in words), e.value.message
    assert "bf16" in e.value.fix


def test_modelopt_fp8_is_a_per_tensor_scale_at_the_top_or_nested():
    for q in ({"quant_method": "modelopt", "quant_algo": "FP8"},
              {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}):
        scheme = quant.scheme_of({"quantization_config": q}, "c")
        assert scheme.forms == (quant.TENSOR,) and scheme.suffix == "_scale"
    channel = quant.scheme_of({"quantization_config": {"quant_method": "modelopt",
                                                       "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}, "c")
    assert channel.forms == (quant.CHANNEL,)


def _scale(shape, dtype="float32"):
    return SimpleNamespace(shape=tuple(shape), dtype=dtype, file="model.safetensors")


@pytest.mark.parametrize("forms, stored, block", [
    ((quant.TENSOR,), (), (300, 200)),
    ((quant.TENSOR,), (1,), (300, 200)),
    ((quant.CHANNEL,), (300, 1), (1, 200)),
    ((quant.CHANNEL,), (300,), (1, 200)),
    ((quant.Form(1, 64, "g"),), (300, 4), (1, 64)),  # (a partial last group)
    ((quant.Form(128, 128, "b"),), (3, 2), (128, 128)),
    ((quant.Form(512, 512, "b"),), (1, 1), (300, 200)),  # (a block larger than the weight: the whole weight)
    ((quant.CHANNEL, quant.Form(128, 128, "b")), (3, 2), (128, 128)),  # (the form whose shape the scale has)
])
def test_a_weights_block_is_read_from_its_scales_shape(forms, stored, block):
    scheme = quant.ScaledFp8(forms, "_scale", "compressed-tensors float-quantized")
    assert quant.scale_block("w.weight", (300, 200), _scale(stored), scheme, "/m") == block


def test_a_scale_no_form_explains_is_named_with_the_shapes_that_would():
    scheme = quant.ScaledFp8((quant.CHANNEL,), "_scale", "compressed-tensors float-quantized")
    e = quant.scale_block("w.weight", (300, 200), _scale((1, 300)), scheme, "/m")
    assert isinstance(e, PreflightError) and "'w.weight_scale'" in e.message and "[300, 1] (per-channel)" in e.message
    e = quant.scale_block("w.weight", (300, 200), _scale((300, 1), "float8_e4m3fn"), scheme, "/m")
    assert isinstance(e, PreflightError) and "float8_e4m3fn" in e.message


def test_a_scale_two_forms_explain_differently_is_refused():
    # (two groups: 100-row blocks and 128-row blocks give the same [3, 1] scale of a 300 x 64 weight)
    scheme = quant.ScaledFp8((quant.Form(100, 64, "a"), quant.Form(128, 64, "b")), "_scale", "ct")
    e = quant.scale_block("w.weight", (300, 64), _scale((3, 1)), scheme, "/m")
    assert isinstance(e, PreflightError) and "more than one scale form" in e.message
    # two forms that mean the same blocks are one
    same = quant.ScaledFp8((quant.TENSOR, quant.Form(512, 512, "b")), "_scale", "ct")
    assert quant.scale_block("w.weight", (300, 64), _scale((1,)), same, "/m") == (300, 64)
