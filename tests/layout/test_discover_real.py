"""Layout discovery on the real checkpoints written by Megatron-LM's own pretrain_gpt.py (tests/fixtures)."""

import pytest

from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format
from tests.conftest import fixture_path

CASES = {
    "tp1_torch": dict(format=Format.TORCH, tp=1, pp=1, ep=1, dims="1D", shards=["mp_rank_00"], dopt=False),
    "tp2_torch": dict(format=Format.TORCH, tp=2, pp=1, ep=1, dims="1D", shards=["mp_rank_00", "mp_rank_01"],
                      dopt=False),
    "pp2_torch": dict(format=Format.TORCH, tp=1, pp=2, ep=1, dims="2D", shards=["mp_rank_00_000", "mp_rank_00_001"],
                      dopt=False),
    "moe_ep2_torch": dict(format=Format.TORCH, tp=1, pp=1, ep=2, dims="3D",
                          shards=["mp_rank_00_000", "mp_rank_00_001"], dopt=False),
    "tp2_distopt_torch": dict(format=Format.TORCH, tp=2, pp=1, ep=1, dims="1D", shards=["mp_rank_00", "mp_rank_01"],
                              dopt=True),
    "tp2_torch_dist": dict(format=Format.TORCH_DIST, tp=2, pp=1, ep=1, dims=None, shards=[], dopt=False),
    "moe_ep2_torch_dist": dict(format=Format.TORCH_DIST, tp=1, pp=1, ep=2, dims=None, shards=[], dopt=False),
    # bf16: the optimizer's fp32 master copies are pickled with their TP attributes (_rebuild_from_type_v2 over
    # torch.Tensor), which the safe reader must accept without running anything.
    "bf16_gqa_tp2_torch": dict(format=Format.TORCH, tp=2, pp=1, ep=1, dims="1D", shards=["mp_rank_00", "mp_rank_01"],
                               dopt=False),
    "bf16_gqa_tp2_torch_dist": dict(format=Format.TORCH_DIST, tp=2, pp=1, ep=1, dims=None, shards=[], dopt=False),
    # Megatron-LM core_r0.14 (2025-10): its torch_dist .metadata is megatron-core's MCoreMetadata subclass
    "v14_tp2_torch": dict(format=Format.TORCH, tp=2, pp=1, ep=1, dims="1D", shards=["mp_rank_00", "mp_rank_01"],
                          dopt=False),
    "v14_tp2pp2_torch": dict(format=Format.TORCH, tp=2, pp=2, ep=1, dims="2D", dopt=False,
                             shards=["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    "v14_tp2_torch_dist": dict(format=Format.TORCH_DIST, tp=2, pp=1, ep=1, dims=None, shards=[], dopt=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_fixture_layout(name):
    want = CASES[name]
    layout = discover(fixture_path(name))
    assert layout.problems == []
    assert layout.ok
    assert layout.format == want["format"]
    assert (layout.tp, layout.pp, layout.ep) == (want["tp"], want["pp"], want["ep"])
    assert layout.dims == want["dims"]
    assert [s.name for s in layout.shards] == want["shards"]
    assert layout.iteration == 2
    assert layout.distributed_optimizer is want["dopt"]
    assert layout.saved_args.num_layers == 4
    assert layout.vpp is None


def test_pp2_and_ep2_same_names_told_apart():
    pp = discover(fixture_path("pp2_torch"))
    ep = discover(fixture_path("moe_ep2_torch"))
    assert [s.name for s in pp.shards] == [s.name for s in ep.shards]
    assert [(s.pp_rank, s.ep_rank) for s in pp.shards] == [(0, 0), (1, 0)]
    assert [(s.pp_rank, s.ep_rank) for s in ep.shards] == [(0, 0), (0, 1)]


def test_pp2_vs_ep2_told_apart_without_args(real_fixture):
    """Strip the args: the keys (expert keys present or not) still tell PP from EP."""
    import os

    import torch

    for name, want in (("pp2_torch", (1, 2, 1)), ("moe_ep2_torch", (1, 1, 2))):
        root = real_fixture(name)
        for shard in ("mp_rank_00_000", "mp_rank_00_001"):
            path = os.path.join(root, "iter_0000002", shard, "model_optim_rng.pt")
            sd = _load_model_only(path)
            torch.save(sd, path)
        layout = discover(root)
        assert layout.sizes_from == "names+keys"
        assert (layout.tp, layout.pp, layout.ep) == want, name


def _load_model_only(path):
    """Rebuild a file with only model tensors (no args), using our own lazy reader for the values."""
    from megatron_preflight.torch_file import TensorRef, TorchFile

    with TorchFile(path) as f:
        meta = f.load_metadata()
        model = {k: (f.tensor(v).clone() if isinstance(v, TensorRef) else v) for k, v in meta["model"].items()}
    return {"iteration": 2, "checkpoint_version": 3.0, "model": model}


def test_dist_reads_common_state_without_common_pt():
    layout = discover(fixture_path("tp2_torch_dist"))
    assert layout.common_state["iteration"] == 2
    assert layout.dist_tensors["embedding.word_embeddings.weight"] == ((256, 32), "torch.float32")


def test_iteration_dir_given_directly():
    layout = discover(fixture_path("tp2_torch") + "/iter_0000002")
    assert layout.ok and layout.tp == 2 and layout.iteration == 2


def test_json_fields():
    j = discover(fixture_path("moe_ep2_torch")).to_json()
    for key in ("format", "iteration", "tp", "pp", "ep", "etp", "vpp", "dims", "shards", "missing_shards",
                "problems", "saved_args"):
        assert key in j
    assert j["format"] == "torch" and j["dims"] == "3D" and j["vpp"] is None
    assert j["shards"][1] == {"name": "mp_rank_00_001", "tp_rank": 0, "pp_rank": 0, "ep_rank": 1,
                              "files": ["model_optim_rng.pt"], "bytes": j["shards"][1]["bytes"]}
    assert j["saved_args"]["expert_model_parallel_size"] == 2
    assert j["saved_args"]["params_dtype"] == "torch.float32"
    import json

    json.dumps(j)
