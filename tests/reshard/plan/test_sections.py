"""HybridModel's sectioned projections (reshard/plan/sections.py) and its layer pattern, on real pretrain_hybrid.py
checkpoints (tests/fixtures/megatron-lm/LOCAL_FIXTURES.md: written with the CPU stand-ins te_cpu and mamba_cpu, not
Transformer Engine, mamba_ssm or fla).

The oracle is each fixture's torch_dist twin, saved by Megatron from the same run: there every section of a Mamba or
gated-delta-net projection is a global tensor of its own (``in_proj.weight.z``, ``conv1d.weight.x``, …) and every
layer has its global number, so a TP1·PP1 reshard of the legacy checkpoint must equal it tensor by tensor, bit for bit.
"""

import os

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import ParallelLayout, from_args, hybrid_segments, repipe
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.plan.rules import Rule, parse_key, rule_for, segments
from tests.conftest import fixture_path
from tests.helpers.ckpt_edit import load

PAIRS = [("hyb_tp2_torch", "hyb_tp2_torch_dist"), ("hyb_vpp_pp2_torch", "hyb_vpp_pp2_torch_dist"),
         ("hyb_distopt_pp2ep2_torch", "hyb_distopt_pp2ep2_torch_dist")]

# the twin's section names, per sectioned legacy tensor (megatron-core's sharded_state_dict of each mixer)
SECTIONS = {
    "mixer.in_proj.weight": ("mixer.in_proj.weight", ("z", "x", "B", "C", "dt")),
    "mixer.conv1d_weight": ("mixer.conv1d.weight", ("x", "B", "C")),
    "mixer.conv1d_bias": ("mixer.conv1d.bias", ("x", "B", "C")),
    "self_attention.in_proj.weight": ("self_attention.in_proj.weight", ("query", "key", "value", "z", "beta", "alpha")),
    "self_attention.conv1d.weight": ("self_attention.conv1d.weight", ("query", "key", "value")),
}


def _twin_tensors(iter_dir: str, keys: set[str]) -> dict[str, torch.Tensor]:
    """The twin's global tensors ``keys``, read by torch's own DCP reader (not ours)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(iter_dir)
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _twin_names(key: str) -> tuple[list[str], int | None]:
    """The twin's global tensors that make up legacy ``key`` (TP1·PP1 names), and an expert index into the first."""
    for suffix, (name, parts) in SECTIONS.items():
        if key.endswith(suffix):
            base = key[: -len(suffix)] + name
            return [f"{base}.{p}" for p in parts], None
    if ".mlp.experts.linear_fc" in key:  # TE-grouped: experts stacked along dim 0 in torch_dist
        head, param = key.rsplit(".", 1)
        number = param.lstrip("weight")
        return [head.replace(".mlp.experts.", ".mlp.experts.experts.") + ".weight"], int(number)
    return [key], None


@pytest.mark.parametrize("legacy, twin", PAIRS)
def test_a_tp1_pp1_reshard_equals_the_torch_dist_twin_bit_for_bit(tmp_path, legacy, twin):
    out = str(tmp_path / "tp1")
    write_resharded(fixture_path(legacy), out, TargetLayout(tp=1, pp=1, ep=1), verify=True)
    model = load(os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))["model"]
    wanted = {k: _twin_names(k) for k, v in model.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    theirs = _twin_tensors(os.path.join(fixture_path(twin), "iter_0000002"),
                           {n for names, _ in wanted.values() for n in names})
    sectioned = 0
    for key, (names, expert) in wanted.items():
        ref = torch.cat([theirs[n] for n in names]) if expert is None else theirs[names[0]][expert]
        ours = model[key]
        if key.endswith(("word_embeddings.weight", "output_layer.weight")):  # vocab padding rows are re-made
            ours, ref = ours[:100], ref[:100]
        assert ours.shape == ref.shape and torch.equal(ours, ref), key
        sectioned += len(names) > 1
    assert sectioned >= {"hyb_tp2_torch": 5, "hyb_vpp_pp2_torch": 5, "hyb_distopt_pp2ep2_torch": 8}[legacy]


def test_every_section_of_a_tp2_rank_is_its_share_of_that_section():
    """TP2's rank 1 holds the second half of each section, not the second half of the tensor."""
    rule = Rule("sections", parts=(64, 64, 16, 16, 8))
    assert segments(rule, 168, 2, 1) == [(32, 32, 0), (96, 32, 32), (136, 8, 64), (152, 8, 72), (164, 4, 80)]
    with pytest.raises(PreflightError, match="do not add up"):
        segments(rule, 170, 2, 0)
    with pytest.raises(PreflightError, match="not known here"):  # a family never resolved: refused, not guessed
        segments(rule_for(parse_key("decoder.layers.0.mixer.in_proj.weight"), swiglu=False), 168, 2, 0)


def test_tp2_rank_files_hold_each_section_split():
    """The fixture itself: rank 0's Mamba in_proj is [z_0 | x_0 | B_0 | C_0 | dt_0] of the twin's sections."""
    rank0 = load(os.path.join(fixture_path("hyb_tp2_torch"), "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    names, _ = _twin_names("decoder.layers.0.mixer.in_proj.weight")
    theirs = _twin_tensors(os.path.join(fixture_path("hyb_tp2_torch_dist"), "iter_0000002"), set(names))
    halves = torch.cat([theirs[n][: theirs[n].shape[0] // 2] for n in names])
    assert torch.equal(rank0["model"]["decoder.layers.0.mixer.in_proj.weight"], halves)
    assert not torch.equal(halves, torch.cat([theirs[n] for n in names])[: halves.shape[0]])  # not a plain split


def test_a_pipeline_reshard_and_back_is_the_identity(tmp_path):
    """TP2 -> TP1·PP2 with unequal '|' segments and the MTP depth on the last stage -> TP1·PP1: every tensor as a
    direct TP1·PP1 reshard writes it."""
    direct, piped, back = (str(tmp_path / n) for n in ("direct", "piped", "back"))
    write_resharded(fixture_path("hyb_tp2_torch"), direct, TargetLayout(tp=1, pp=1))
    write_resharded(fixture_path("hyb_tp2_torch"), piped, TargetLayout(tp=1, pp=2, hybrid_layer_pattern="MG|*-E/*-"))
    stage1 = load(os.path.join(piped, "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt"))
    assert stage1["args"].hybrid_layer_pattern == "MG|*-E/*-"
    assert "decoder.layers.2.mlp.experts.linear_fc1.weight0" in stage1["model"]  # global layer 4, stage-local 2
    write_resharded(piped, back, TargetLayout(pp=1))
    a = load(os.path.join(direct, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    b = load(os.path.join(back, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    assert list(a["model"]) == list(b["model"]) and b["args"].hybrid_layer_pattern == "MG*-E/*-"
    for key, value in a["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["model"][key]), key


def test_layers_follow_the_patterns_segments():
    """The stage of (PP rank p, virtual stage v) is segment v·PP + p; VPP is derived from the segment count."""
    args = {"hybrid_layer_pattern": "M*|G-|E*E|M-/*-", "pipeline_model_parallel_size": 2, "num_layers": 99}
    lay = from_args(args)
    assert (lay.num_layers, lay.vpp) == (9, 2) and hybrid_segments(args["hybrid_layer_pattern"]) == (2, 2, 3, 2)
    assert lay.chunk_layer_counts() == [[2, 2], [3, 2]]
    assert [lay.place_layer(g) for g in (0, 2, 4, 6, 7)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 2), (1, 1, 0)]
    assert from_args({**args, "hybrid_layer_pattern": "M*G-E*EM-"}).vpp is None
    with pytest.raises(PreflightError, match="pipeline segments"):
        ParallelLayout(pp=3, num_layers=9, hybrid_pattern="M*|G-|E*E|M-").chunk_layer_counts()


def test_a_target_pattern_is_the_same_layers_recut():
    assert repipe("M*|G-/*-", None, 1, None, keep=False) == "M*G-/*-"
    assert repipe("M*G-E*", None, 3, None, keep=False) == "M*|G-|E*"
    assert repipe("M*G-", "M|*G-", 2, None, keep=False) == "M|*G-"
    with pytest.raises(PreflightError, match="another model"):
        repipe("M*G-", "M*G*", 1, None, keep=False)
    with pytest.raises(PreflightError, match="another model"):  # MTP depths are part of the model
        repipe("M*G-/*-", "M*G-", 1, None, keep=False)
    with pytest.raises(PreflightError, match="do not split evenly"):
        repipe("M*G-E", None, 2, None, keep=False)
