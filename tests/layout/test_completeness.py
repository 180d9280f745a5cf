"""A checkpoint that lost one tensor of a pair the model always has together (QKV / output projection, fc1 / fc2),
found from key names only: in a legacy file and in a torch_dist .metadata (real Megatron-LM checkpoints, edited)."""

import os
import shutil

from megatron_preflight.layout import completeness
from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path
from tests.helpers import ckpt_edit


def test_pairs_are_matched_per_layer_and_per_expert_form():
    keys = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.1.self_attention.linear_qkv.weight",
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
            "decoder.layers.mlp.experts.experts.linear_fc2.weight", "embedding.word_embeddings.weight",
            "decoder.layers.2.mlp.experts.linear_fc1.weight0", "decoder.layers.2.mlp.experts.linear_fc2.weight1"]
    assert completeness.unpaired(keys) == [
        (None, "mlp.experts.experts.linear_fc2.weight", "mlp.experts.experts.linear_fc1.weight"),
        ("1", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")]
    # multi-latent attention: an output projection and no linear_qkv (not a broken pair)
    assert completeness.unpaired(["decoder.layers.0.self_attention.linear_q_proj.weight",
                                  "decoder.layers.0.self_attention.linear_proj.weight"]) == []


def test_a_legacy_file_without_a_layers_output_projection_is_a_problem(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture_path("tp2_torch"), dst)
    path = os.path.join(dst, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    state = ckpt_edit.load(path)
    del state["model"]["decoder.layers.2.self_attention.linear_proj.weight"]
    ckpt_edit.save(state, path)
    layout = discover(dst)
    p, = [p for p in layout.problems if p.code == "missing_tensor"]
    assert p.path == path and "without self_attention.linear_proj.weight (layer 2)" in p.message
    assert not [p for p in discover(fixture_path("tp2_torch")).problems if p.code == "missing_tensor"]


def test_a_torch_dist_metadata_without_a_tensor_is_a_problem(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture_path("moe_ep2_torch_dist"), dst)
    assert ckpt_edit.drop_from_dcp_metadata(os.path.join(dst, "iter_0000002"), "mlp.experts.experts.linear_fc2.weight")
    layout = discover(dst)
    p, = [p for p in layout.problems if p.code == "missing_tensor"]
    assert "without mlp.experts.experts.linear_fc2.weight (every layer)" in p.message and p.path.endswith(".metadata")
