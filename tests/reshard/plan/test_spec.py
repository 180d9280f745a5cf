"""Layer-spec bridging (local <-> Transformer Engine) and Adam-family conversion (torch <-> fused), on real
Megatron-LM checkpoints of one model saved both ways: ``tp2_torch`` (local spec, torch AdamW) and ``te_tp2_torch``
(TE spec through the CPU stand-in for TE 2.17.1, not TE itself — see LOCAL_FIXTURES.md — with its FusedAdam).

The two were trained separately, so their values differ; their *names, order, shapes and state layout* are what each
spec and each Adam save, and a bridged checkpoint must look exactly like the other one. Values are proven by round
trips (local -> TE -> local is bit-exact, optimizer state included)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.optimizer.family import saved_family
from megatron_preflight.reshard.plan.spec import SpecChange, bridge, layer_order
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.torch_file import TensorRef, TorchFile
from tests.conftest import fixture_path
from tests.reshard.test_roundtrip_real import (
    assert_same_optimizer,
    assert_same_weights,
    model_tensors,
    optimizer_entries,
)


def _rank0(name, target):
    r = open_resharder(fixture_path(name), target)
    return r, r.build(r.plan_for_rank(0, r.tgt.min_world()))


def _inner(opt):
    return opt["optimizer"] if "fp32_from_fp16_params" in opt else opt


def _shape(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


@pytest.mark.parametrize("source, other, impl, family", [
    ("tp2_torch", "te_tp2_torch", "transformer_engine", "fused"),
    ("te_tp2_torch", "tp2_torch", "local", "torch"),
])
def test_a_bridged_state_is_what_the_other_spec_and_adam_save(source, other, impl, family):
    r, ours = _rank0(source, TargetLayout(transformer_impl=impl, optimizer_family=family))
    _, theirs = _rank0(other, TargetLayout())
    assert list(ours["model"]) == list(theirs["model"])  # the same keys in the same module order
    for key, value in ours["model"].items():
        if key.endswith("_extra_state"):
            # local modules save None; a TE module made by the bridge gets None too (no FP8 state to restore, and
            # every TE version's set_extra_state accepts it), one that had an extra state keeps it (TE -> TE)
            assert value is None, key
            continue
        assert _shape(value) == _shape(theirs["model"][key]), key
    assert ours["args"].transformer_impl == impl
    a, b = _inner(ours["optimizer"]), _inner(theirs["optimizer"])
    assert [sorted(k for k in g if k != "params") for g in a["param_groups"]] == \
        [sorted(k for k in g if k != "params") for g in b["param_groups"]]
    assert [len(g["params"]) for g in a["param_groups"]] == [len(g["params"]) for g in b["param_groups"]]
    for idx, state in a["state"].items():  # the state follows the parameter order of the target spec
        assert list(state) == list(b["state"][idx]), idx
        assert {k: _shape(v) for k, v in state.items()} == {k: _shape(v) for k, v in b["state"][idx].items()}
    assert saved_family(ours["optimizer"]) == family and "converted" in r.converted


def test_the_step_carries_over_both_ways():
    """Adam's bias correction continues exactly: torch's per-parameter step becomes the fused groups' step, and back."""
    _, fused = _rank0("tp2_torch", TargetLayout(optimizer_family="fused"))
    groups = _inner(fused["optimizer"])["param_groups"]
    assert all(g["step"] == 2 and g["bias_correction"] is True for g in groups)
    assert all("step" not in s for s in _inner(fused["optimizer"])["state"].values())
    assert not any(k in g for g in groups for k in ("amsgrad", "foreach", "fused"))  # torch's own options gone
    _, plain = _rank0("te_tp2_torch", TargetLayout(optimizer_family="torch"))
    state = _inner(plain["optimizer"])["state"]
    assert all(torch.equal(s["step"], torch.tensor(2.0)) for s in state.values())
    assert not any("bias_correction" in g or "step" in g for g in _inner(plain["optimizer"])["param_groups"])


def test_local_to_te_and_back_is_bit_exact(tmp_path):
    """Every weight, Adam moment and step survives local -> TE (fused Adam) -> local (torch Adam), at TP1 between."""
    mid, back = str(tmp_path / "te"), str(tmp_path / "back")
    write_resharded(fixture_path("tp2_torch"), mid, TargetLayout(tp=1, transformer_impl="transformer_engine"),
                    verify=True)
    with TorchFile(os.path.join(mid, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")) as f:
        meta = f.load_metadata()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in meta["model"]
    assert not any("input_layernorm" in k for k in meta["model"])
    assert saved_family(meta["optimizer"]) == "fused"  # the TE spec runs where TE is: its FusedAdam
    write_resharded(mid, back, TargetLayout(tp=2, transformer_impl="local", optimizer_family="torch"), verify=True)
    assert_same_weights(model_tensors(fixture_path("tp2_torch")), model_tensors(back))
    assert_same_optimizer(optimizer_entries(fixture_path("tp2_torch")), optimizer_entries(back))


def test_the_distributed_optimizer_follows_the_new_parameter_order(tmp_path):
    """The TE spec registers linear_proj before the fused layer norm (local: input_layernorm first): the buffers of
    a distributed optimizer are laid out in the new order, and the round trip restores the old one bit for bit."""
    mid, back = str(tmp_path / "te"), str(tmp_path / "back")
    write_resharded(fixture_path("distopt_tp2dp2_torch"), mid, TargetLayout(transformer_impl="transformer_engine"),
                    verify=True)
    write_resharded(mid, back, TargetLayout(transformer_impl="local", optimizer_family="torch"), verify=True)
    for shard in ("mp_rank_00", "mp_rank_01"):
        with TorchFile(os.path.join(fixture_path("distopt_tp2dp2_torch"), "iter_0000002", shard,
                                    "distrib_optim.pt")) as a, \
                TorchFile(os.path.join(back, "iter_0000002", shard, "distrib_optim.pt")) as b:
            (_, wa), = a.load_metadata()[0].items()
            (_, wb), = b.load_metadata()[0].items()
            for key in ("param", "exp_avg", "exp_avg_sq"):
                x, y = a.tensor(wa[key]), b.tensor(wb[key])
                assert isinstance(wa[key], TensorRef) and torch.equal(x, y), (shard, key)


def test_grouped_and_sequential_experts_are_the_same_tensors():
    """TE grouped experts (experts.linear_fc1.weight{j}, one extra state per grouped linear) <-> sequential ones
    (local_experts.{j}.linear_fc1.weight, one extra state per expert linear): renamed, never re-split."""
    r = open_resharder(fixture_path("moe_ep2_torch"), TargetLayout(transformer_impl="transformer_engine",
                                                                   moe_grouped_gemm=True))
    sd = r.build(r.plan_for_rank(0, 2))["model"]
    grouped = [k for k in sd if ".mlp.experts." in k]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in grouped
    assert "decoder.layers.0.mlp.experts.linear_fc1._extra_state" in grouped
    assert not any("local_experts" in k for k in grouped)
    assert grouped.index("decoder.layers.0.mlp.experts.linear_fc1.weight1") < \
        grouped.index("decoder.layers.0.mlp.experts.linear_fc2.weight0")
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in sd  # a MoE layer keeps its norm module (TENorm)
    assert "decoder.layers.0.pre_mlp_layernorm._extra_state" in sd
    plain = open_resharder(fixture_path("moe_ep2_torch"), TargetLayout())
    before = plain.build(plain.plan_for_rank(0, 2))["model"]
    assert torch.equal(sd["decoder.layers.0.mlp.experts.linear_fc1.weight1"],
                       before["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"])
    back = bridge(r.index, SpecChange("transformer_engine", "local", True, False), swiglu=False)[0]
    assert {k for k in back if k.layer is not None} == {k for k in plain.index if k.layer is not None}


def test_a_local_spec_target_gets_sequential_experts():
    """--moe-grouped-gemm with the local spec: Megatron-LM main builds sequential experts (the legacy GroupedMLP is
    read, never written)."""
    r = open_resharder(fixture_path("moe_ep2_torch"), TargetLayout(moe_grouped_gemm=True))
    assert not r.spec.changes
    sd = r.build(r.plan_for_rank(0, 2))["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in sd


def test_grouped_mlp_weights_unpack_as_transposed_expert_blocks():
    """weight1 [h, E·f] is viewed by GroupedMLP as (E, h, f): expert j's linear_fc1 is block j transposed."""
    import torch

    from megatron_preflight.reshard.plan.spec import unpack_legacy_grouped
    from megatron_preflight.torch_file import StorageRef, TensorRef

    h, f, e = 3, 4, 2
    w1 = torch.arange(h * e * f, dtype=torch.float32).reshape(h, e * f)
    ref = TensorRef("x", StorageRef("0", "float32", w1.numel()), 0, (h, e * f), (e * f, 1))
    views = unpack_legacy_grouped("mlp.experts.weight1", ref, e, "test")
    for j, (suffix, v) in enumerate(views):
        got = w1.reshape(-1).as_strided(v.shape, v.stride, v.offset)
        assert suffix == "linear_fc1.weight" and torch.equal(got, w1.view(e, h, f)[j].t())
    w2 = torch.arange(e * f * h, dtype=torch.float32).reshape(e * f, h)
    ref2 = TensorRef("x", StorageRef("0", "float32", w2.numel()), 0, (e * f, h), (h, 1))
    for j, (suffix, v) in enumerate(unpack_legacy_grouped("mlp.experts.weight2", ref2, e, "test")):
        got = w2.reshape(-1).as_strided(v.shape, v.stride, v.offset)
        assert suffix == "linear_fc2.weight" and torch.equal(got, w2.view(e, f, h)[j].t())


def test_module_order_of_a_te_layer():
    keys = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.core_attention._extra_state",
            "mlp.linear_fc1.layer_norm_weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
            "self_attention.linear_qkv.weight"]
    keys.sort(key=lambda s: layer_order("plain", s))
    assert keys == ["self_attention.core_attention._extra_state", "self_attention.linear_proj.weight",
                    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc2.weight"]


def test_an_mtp_layers_experts_follow_the_expert_form_too():
    """The experts of an MTP layer's MoE layer are renamed as the decoder's (grouped -> sequential and back), with
    their extra states: Megatron's strict load of the other form named each one missing (measured in Megatron-LM
    main: 'Missing key(s) ... mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight0')."""
    src = fixture_path("mtp_moe_te_ep2_torch")  # TE-grouped experts, EP2
    seq = open_resharder(src, TargetLayout(ep=1, transformer_impl="transformer_engine", moe_grouped_gemm=False))
    sd = seq.build(seq.plan_for_rank(0, 1))["model"]
    mtp = [k for k in sd if k.startswith("mtp.") and ".mlp.experts." in k]
    assert "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc1.weight" in mtp
    assert "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc2._extra_state" in mtp
    assert not any(".mlp.experts.linear_fc" in k for k in mtp)
    grouped = open_resharder(src, TargetLayout(ep=1))
    same = grouped.build(grouped.plan_for_rank(0, 1))["model"]
    assert torch.equal(sd["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc1.weight"],
                       same["mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight3"])
    back = bridge(seq.index, SpecChange("transformer_engine", "transformer_engine", False, True), swiglu=False)[0]
    assert {k for k in back if k.layer is None} == {k for k in grouped.index if k.layer is None}
