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


@pytest.mark.parametrize("bits, weights, form", [
    (4, {"strategy": "group", "group_size": 32}, quant.Form(1, 32, "per-group (32)")),  # (Kimi K2 Thinking's)
    (8, {"strategy": "channel"}, quant.CHANNEL),
])
def test_compressed_tensors_pack_quantized_integers_are_read_with_their_scales(bits, weights, form):
    scheme = quant.scheme_of(compressed(dict(weights, num_bits=bits, type="int"), fmt="pack-quantized"), "c")
    assert scheme.forms == (form,) and scheme.packed == (quant.INT4 if bits == 4 else quant.INT8)
    assert scheme.describe().startswith(f"int{bits} (packed) with ") and "pack-quantized" in scheme.describe()


@pytest.mark.parametrize("cfg, words", [
    (compressed({"strategy": "tensor_group", "num_bits": 4, "type": "float", "group_size": 16},
                fmt="nvfp4-pack-quantized"), ["format 'nvfp4-pack-quantized'", "pack-quantized (INT4 / INT8)"]),
    (compressed({"strategy": "group", "num_bits": 4, "type": "int", "group_size": 128, "symmetric": False},
                fmt="pack-quantized"), ["symmetric: False", "symmetric 4- / 8-bit integers"]),
    (compressed({"strategy": "group", "num_bits": 2, "type": "int", "group_size": 128}, fmt="pack-quantized"),
     ["num_bits: 2"]),
    (compressed({"strategy": "channel", "num_bits": 8, "type": "int"}), ["type: 'int'", "(float-quantized)"]),
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


def test_mixed_value_forms_are_refused():
    cfg = compressed({"strategy": "channel"}, fmt="mixed-precision")
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_0"]["format"] = "float-quantized"
    groups["group_1"] = {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                 "group_size": 32}}
    with pytest.raises(PreflightError) as e:
        quant.scheme_of(cfg, "c")
    assert "float8_e4m3fn and int4 (packed)" in e.value.message


def _t(name, dtype, shape, start=0):
    from megatron_preflight.layout.hf.safetensors import SafeTensor

    n = 1
    for d in shape:
        n *= d
    return SafeTensor(name, "model.safetensors", dtype, tuple(shape), start, start + 4 * n)


def test_a_packed_weight_reads_as_a_virtual_weight_of_its_values():
    scheme = quant.scheme_of(compressed({"strategy": "group", "group_size": 32, "num_bits": 4, "type": "int"},
                                        fmt="pack-quantized"), "c")
    table = {"a.weight_packed": _t("a.weight_packed", "int32", (64, 16), 100),
             "a.weight_scale": _t("a.weight_scale", "bfloat16", (64, 4)),
             "a.weight_shape": _t("a.weight_shape", "int64", (2,))}
    out, errors = quant.expand_packed(table, scheme, "/m")
    assert not errors and "a.weight_packed" not in out and "a.weight_shape" in out
    w = out["a.weight"]
    assert (w.dtype, w.shape, w.start, w.end) == (quant.INT4, (64, 128), 100, 100 + 64 * 16 * 4)


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update({"a.weight_packed": _t("a.weight_packed", "int8", (64, 16))}), ["int8", "int32 matrices"]),
    (lambda t: t.pop("a.weight_shape"), ["no 'a.weight_shape'"]),
    (lambda t: t.update({"a.weight": _t("a.weight", "bfloat16", (64, 128))}), ["'a.weight' and its pack-quantized"]),
])
def test_a_packed_weight_that_does_not_fit_is_named(change, words):
    scheme = quant.scheme_of(compressed({"strategy": "channel", "num_bits": 8, "type": "int"}, fmt="pack-quantized"),
                             "c")
    table = {"a.weight_packed": _t("a.weight_packed", "int32", (64, 16)),
             "a.weight_shape": _t("a.weight_shape", "int64", (2,))}
    change(table)
    _, errors = quant.expand_packed(table, scheme, "/m")
    assert len(errors) == 1 and all(w in errors[0].message for w in words), errors
