"""Transformer Engine-spec torch_dist sources (fixtures made with the CPU stand-in for TE 2.17.1, not TE itself; see
tests/fixtures/megatron-lm/LOCAL_FIXTURES.md): each module's ``_extra_state`` is a sharded object holding a uint8
tensor. It is read in place and carried as a tensor (once it was a reference to a deleted temp file, and every TE
torch_dist reshard failed with 'cannot read the file ... tmp<random>.pt')."""

from __future__ import annotations

import os

import torch

from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.torch_file import TensorRef, TorchFile
from tests.conftest import fixture_path
from tests.reshard.test_roundtrip_real import model_tensors, optimizer_entries


def test_te_torch_dist_to_legacy_equals_the_legacy_twins_reshard(tmp_path):
    ours, twin = tmp_path / "from_dist", tmp_path / "from_legacy"
    s = write_resharded(fixture_path("te_tp2_torch_dist"), str(ours), TargetLayout(tp=1), drop_optimizer=True,
                        verify=True)
    assert s.verified_tensors > 0
    write_resharded(fixture_path("te_tp2_torch"), str(twin), TargetLayout(tp=1), drop_optimizer=True)
    a, b = model_tensors(str(ours)), model_tensors(str(twin))
    extra = [k for k in a if k[2].endswith("_extra_state") and not k[2].startswith("output_layer.")]
    assert extra and all(isinstance(a[k][0], torch.Tensor) and a[k][0].dtype == torch.uint8 for k in extra)
    for key, (value, _) in a.items():  # every entry torch_dist holds equals the legacy twin's, bit for bit
        other = b[key][0]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and value.shape == other.shape and torch.equal(value, other), key
        else:
            assert value == other, key
    assert set(a) == set(b)  # TE's attention extra state too (torch_dist does not hold it: made as TE makes it)


def test_the_production_default_reshards_with_its_optimizer_state(tmp_path):
    """TE spec + fused Adam + the distributed optimizer + torch_dist (dp_reshardable) -> legacy TP1, state carried."""
    out = tmp_path / "tp1"
    s = write_resharded(fixture_path("te_distopt_tp2dp2_torch_dist"), str(out), TargetLayout(tp=1), verify=True)
    assert "optimizer" not in s.dropped and s.verified_tensors > 0
    shard = out / "iter_0000002" / "mp_rank_00"
    assert os.path.exists(shard / "distrib_optim.pt")
    with TorchFile(str(shard / "model_optim_rng.pt")) as f:
        groups = f.load_metadata()["optimizer"]["optimizer"]["param_groups"]
    assert groups and all("step" in g and "bias_correction" in g for g in groups)  # fused Adam's groups
    with TorchFile(str(shard / "distrib_optim.pt")) as f:
        meta = f.load_metadata()
        world = meta[0]
        (_, tensors), = world.items()
        assert all(isinstance(tensors[k], TensorRef) for k in ("param", "exp_avg", "exp_avg_sq"))


def test_fused_adam_state_in_model_space_equals_the_legacy_twins_reshard(tmp_path):
    """TE's FusedAdam keeps one step per param group (no common_step, no per-parameter step): the torch_dist twin's
    model-space state, resharded to TP1, equals the legacy twin's resharded state entry for entry (resumed by real
    Megatron-LM with the stand-in, both give the losses of Megatron's own load of the torch_dist twin)."""
    ours, twin = tmp_path / "from_dist", tmp_path / "from_legacy"
    s = write_resharded(fixture_path("te_tp2_torch_dist"), str(ours), TargetLayout(tp=1), verify=True)
    assert "optimizer" not in s.dropped
    write_resharded(fixture_path("te_tp2_torch"), str(twin), TargetLayout(tp=1))
    a, b = optimizer_entries(str(ours)), optimizer_entries(str(twin))
    assert a.keys() == b.keys() and a
    steps = [path for path in a if path[-1] == "step"]
    assert steps and all("param_groups" in path for path in steps)  # one step per group, none per parameter
    for key, (value, _) in a.items():
        other = b[key][0]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and value.shape == other.shape and torch.equal(value, other), key
        else:
            assert value == other, key
