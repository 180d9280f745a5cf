"""``diff``: two checkpoints compared by global tensor content, whatever their layouts, formats and optimizer forms
(real Megatron-LM checkpoints and their torch_dist twins, saved by the same run with the same flags)."""

import json
import os
import shutil

import pytest
import torch

from megatron_preflight import pickling
from megatron_preflight.cli.main import main
from megatron_preflight.layout import naming
from megatron_preflight.prove.diff import diff_checkpoints
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.resharder import open_resharder
from tests.conftest import fixture_path
from tests.helpers import ckpt_edit


@pytest.mark.parametrize("legacy, twin", [
    ("tp2_torch", "tp2_torch_dist"),  # plain Adam in both formats
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist"),  # TP2 PP2 EP2, shared experts
    ("vpp_qkln_pp2_torch", "vpp_qkln_pp2_torch_dist"),  # virtual pipeline
    ("bf16_gqa_tp2_torch", "bf16_gqa_tp2_torch_dist"),  # bf16 weights, fp32 masters
    ("distopt_tp2dp2_torch", "distopt_tp2dp2_torch_dist"),  # distrib_optim.pt buffers vs fully_reshardable
    ("te_tp2_torch", "te_tp2_torch_dist"),  # TE spec (the CPU stand-in), fused Adam, TE extra state
    ("mla_te_tp2_torch", "mla_te_tp2_torch_dist"),  # multi-latent attention (TE spec via the stand-in)
    ("mtp_te_tp2pp2_torch", "mtp_te_tp2pp2_torch_dist"),  # MTP: `transformer_layer` in torch_dist
    ("mtp_moe_te_ep2_torch", "mtp_moe_te_ep2_torch_dist"),  # an MoE MTP layer, TE-grouped experts over EP2
])
def test_a_legacy_checkpoint_equals_its_torch_dist_twin(legacy, twin):
    r = diff_checkpoints(fixture_path(legacy), fixture_path(twin))
    assert r.equal, r.render()
    assert any("#exp_avg" in t.name for t in r.tensors) and r.steps == (2.0, 2.0)  # the optimizer was compared
    assert any("padding" in n for n in r.notes)


def test_an_mtp_checkpoint_of_an_older_megatron_keeps_its_names_and_equals_the_newer(tmp_path):
    """Megatron-LM before late 2025 named an MTP layer's transformer layer ``transformer_layer`` in legacy files
    (``mtp_model_layer`` since): a copy renamed so (the real fixture, every shard) reshards under its own names, and
    equals the newer-named original and its twin, weights and Adam state."""
    old = tmp_path / "old"
    shutil.copytree(fixture_path("mtp_te_tp2pp2_torch"), old)
    renamed = 0
    for dirpath, _, files in os.walk(old):
        if naming.MODEL_FILENAME in files:
            path = os.path.join(dirpath, naming.MODEL_FILENAME)
            state = ckpt_edit.load(path)
            state["model"] = {k.replace(".mtp_model_layer.", ".transformer_layer."): v for k, v in state["model"].items()}
            renamed += sum(".transformer_layer." in k for k in state["model"])
            ckpt_edit.save(state, path)
    assert renamed
    out = str(tmp_path / "tp1")
    write_resharded(str(old), out, TargetLayout(tp=1, pp=1))
    keys = [k for s in open_resharder(out, TargetLayout()).layout.shards for k in s.meta["model"] if "mtp." in k]
    assert any(".transformer_layer." in k for k in keys) and not any(".mtp_model_layer." in k for k in keys)
    for other in (fixture_path("mtp_te_tp2pp2_torch"), fixture_path("mtp_te_tp2pp2_torch_dist"), out):
        r = diff_checkpoints(str(old), other)
        assert r.equal and any("mtp.layers.0.mtp_model_layer." in t.name for t in r.tensors), r.render()


def test_two_runs_differ_within_a_tolerance():
    """The dp_reshardable twin was saved by another run (CPU reductions differ by <= 4.2e-8): different bit for bit,
    equal within 1e-6, with per-tensor figures."""
    a, b = fixture_path("distopt_tp2dp2_torch"), fixture_path("distopt_dpr_tp2dp2_torch_dist")
    r = diff_checkpoints(a, b)
    bad = [t for t in r.tensors if t.status == "differs"]
    assert not r.equal and bad and all(0 < t.max_abs < 1e-6 and t.differing > 0 for t in bad)
    assert diff_checkpoints(a, b, atol=1e-6).equal


def test_a_reshard_equals_its_source_at_any_layout(tmp_path):
    out = str(tmp_path / "tp1pp2")
    write_resharded(fixture_path("tp2_torch"), out, TargetLayout(tp=1, pp=2))
    r = diff_checkpoints(fixture_path("tp2_torch"), out)
    assert r.equal, r.render()
    converted = str(tmp_path / "te")  # and across specs and Adams: named and laid out as the first
    write_resharded(fixture_path("tp2_torch"), converted, TargetLayout(transformer_impl="transformer_engine"))
    assert diff_checkpoints(fixture_path("tp2_torch"), converted).equal


def test_a_single_changed_element_is_found_and_located(tmp_path, capsys):
    """A copy of tp2_torch (its state dicts as the resharder builds them, saved with torch) with one element of one
    shard changed by 1e-3."""
    out = str(tmp_path / "copy")
    r = open_resharder(fixture_path("tp2_torch"), TargetLayout())
    for name, coords in naming.shard_writers(r.tgt).items():
        sd = r.build(r.plan_for_coords(coords, name))
        if name == "mp_rank_01":
            sd["model"]["decoder.layers.2.mlp.linear_fc2.weight"][5, 7] += 1e-3
        os.makedirs(os.path.join(out, "iter_0000002", name))
        torch.save(sd, os.path.join(out, "iter_0000002", name, "model_optim_rng.pt"), pickle_module=pickling)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")
    r = diff_checkpoints(fixture_path("tp2_torch"), out)
    bad = [t for t in r.tensors if t.status != "equal"]
    assert [t.name for t in bad] == ["decoder.layers.2.mlp.linear_fc2.weight"]
    assert bad[0].differing == 1 and bad[0].first == (5, 32 + 7)  # row-parallel: TP rank 1 holds columns 32..63
    assert abs(bad[0].max_abs - 1e-3) < 1e-6
    assert main(["diff", fixture_path("tp2_torch"), out, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False and doc["tensors"]
    assert main(["diff", fixture_path("tp2_torch"), out, "--weights-only", "--atol", "1e-2"]) == 0


def test_two_different_models_report_what_is_missing_and_what_differs():
    r = diff_checkpoints(fixture_path("tp2_torch"), fixture_path("moe_ep2_torch"), weights_only=True)
    statuses = {t.status for t in r.tensors}
    assert not r.equal and "missing_in_a" in statuses and "missing_in_b" in statuses
    assert any(f == "num_experts" for f, _, _ in r.args)


def test_equal_tensors_are_compared_in_place_without_assembling(monkeypatch):
    """Equal tensors are shown equal slice against slice from the mapped sources (the speed path): the assembling
    comparison runs only for values that are not tensors; a sign-of-zero change (numerically equal, other bits) is
    not equal in place."""
    from megatron_preflight.prove import diff

    calls = []
    real = diff.compare_tensors
    monkeypatch.setattr(diff, "compare_tensors", lambda name, x, y, *a: calls.append((name, x)) or real(name, x, y, *a))
    r = diff.diff_checkpoints(fixture_path("tp2_torch"), fixture_path("tp2_torch_dist"))
    assert r.equal and all(not isinstance(x, torch.Tensor) for _, x in calls), [n for n, _ in calls][:5]
    assert diff._compare_spans([(0, 2, torch.tensor([0.0, 1.0]))], [(0, 2, torch.tensor([-0.0, 1.0]))], 0, 2, None) \
        is False
    assert diff._compare_spans([(0, 1, torch.tensor([1.0])), (1, 2, torch.tensor([2.0]))],
                               [(0, 2, torch.tensor([1.0, 2.0]))], 0, 2, None) is True


@pytest.mark.parametrize("change,expect", [
    (lambda sd: sd["opt_param_scheduler"].update(num_steps=6), "opt_param_scheduler.num_steps"),
    (lambda sd: sd["optimizer"]["param_groups"][0].update(lr=2e-4), "param group lr"),
    (lambda sd: sd["optimizer"]["param_groups"][1].update(weight_decay=0.1), "param group weight_decay"),
])
def test_a_pair_whose_common_state_a_resume_reads_differs_is_different(tmp_path, capsys, change, expect):
    """A copy of tp2_torch with its tensors equal and one piece of the common state a resume reads changed on every
    shard (the scheduler, a param group's settings): DIFFERENT, naming it; the weights alone equal."""
    out = str(tmp_path / "copy")
    r = open_resharder(fixture_path("tp2_torch"), TargetLayout())
    for name, coords in naming.shard_writers(r.tgt).items():
        sd = r.build(r.plan_for_coords(coords, name))
        change(sd)
        os.makedirs(os.path.join(out, "iter_0000002", name))
        torch.save(sd, os.path.join(out, "iter_0000002", name, "model_optim_rng.pt"), pickle_module=pickling)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")
    report = diff_checkpoints(fixture_path("tp2_torch"), out)
    assert all(t.status == "equal" for t in report.tensors)
    assert not report.equal and any(expect in what for what, _, _ in report.common), report.render()
    assert main(["diff", fixture_path("tp2_torch"), out]) == 1
    assert expect in capsys.readouterr().out
    assert diff_checkpoints(fixture_path("tp2_torch"), out, weights_only=True).equal


def test_an_fsdp_dtensor_save_equals_its_3d_twin_and_a_changed_tensor_is_told_apart(tmp_path):
    """Megatron-FSDP's fsdp_dtensor save and the same training on the 3D path (torch_dist; fixtures fsdp_dp2*): equal,
    optimizer state and common state included (TE's extra states: none saved by Megatron-FSDP, TE's empty values in
    the twin: the same). One weight changed in a legacy copy of the twin: that tensor alone differs."""
    fsdp, twin = fixture_path("fsdp_dp2"), fixture_path("fsdp_dp2_twin_torch_dist")
    report = diff_checkpoints(fsdp, twin)
    assert report.equal and len(report.tensors) > 100, [(t.name, t.status) for t in report.tensors
                                                        if t.status != "equal"]
    assert report.steps == (2, 2)
    out = tmp_path / "legacy"
    write_resharded(twin, str(out), TargetLayout(tp=2, pp=1))
    path = out / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    state = ckpt_edit.load(str(path))
    state["model"]["decoder.layers.2.mlp.linear_fc2.weight"][3, 5] += 1e-3
    ckpt_edit.save(state, str(path))
    report = diff_checkpoints(fsdp, str(out))
    bad = [t for t in report.tensors if t.status != "equal"]
    assert [(t.name, t.differing) for t in bad] == [("decoder.layers.2.mlp.linear_fc2.weight", 1)]


def test_the_end_of_document_row_a_null_tokenizer_adds_is_compared(tmp_path):
    """A NullTokenizer run's --vocab-size 100 has a 101st id (its end of document, up to megatron-core 0.17): the
    Hugging Face export keeps that row, and diff compares it (a change there is found)."""
    pytest.importorskip("safetensors")
    src = fixture_path("bf16_gqa_tp2_torch")
    out = str(tmp_path / "hf")
    assert main(["reshard", src, out, "--ckpt-format", "hf", "--no-progress"]) == 0
    report = diff_checkpoints(src, out, weights_only=True)
    assert report.equal and any("beyond the 101 real rows" in n for n in report.notes), report.notes
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][100] += 1
    save_file(tensors, path, metadata={"format": "pt"})
    assert not diff_checkpoints(src, out, weights_only=True).equal
