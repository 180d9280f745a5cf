"""A sampled verdict (``shards="sample"``/``"auto"``) on a 64-shard checkpoint: the answer of a full read, from a few
parsed files; every shard still listed, sized and its zip trailer checked."""

from __future__ import annotations

import os

import pytest

from megatron_preflight.check.plan import make_plan
from megatron_preflight.layout.discover import SAMPLE_ABOVE, discover
from megatron_preflight.torch_file import zip_trailer_problem
from tests.helpers.synthetic import Model, write_legacy

MODEL = Model(tp=2, pp=4, ep=8, hidden=256, heads=8, ffn=512, moe_ffn=256, vocab=1000, seq=64)
RUN = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "expert_model_parallel_size": 8,
       "num_layers": MODEL.num_layers, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 512,
       "num_experts": 8, "moe_ffn_hidden_size": 256, "seq_length": 64, "max_position_embeddings": 64,
       "vocab_size": 1000, "untie_embeddings_and_output_weights": True, "transformer_impl": "local",
       "add_bias_linear": False, "ckpt_format": "torch", "no_load_optim": True}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("big") / "ckpt")
    assert write_legacy(root, MODEL) == 64 > SAMPLE_ABOVE
    return root


def _parsed(layout):
    return sorted(s.name for s in layout.shards if s.meta is not None)


def test_sample_reads_one_shard_per_stage_and_agrees_with_a_full_read(big):
    full, sampled, auto = (discover(big, shards=m) for m in ("all", "sample", "auto"))
    assert not full.sampled and sampled.sampled and auto.sampled
    assert len(_parsed(full)) == 64
    assert _parsed(sampled) == ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_00_002_000",
                                "mp_rank_00_003_000", "mp_rank_01_003_007"]
    for field in ("format", "iteration", "tp", "pp", "ep", "etp", "dims", "missing_shards", "stray_shards",
                  "problems", "distributed_optimizer", "total_bytes"):
        assert getattr(sampled, field) == getattr(full, field), field
    assert [s.name for s in sampled.shards] == [s.name for s in full.shards]
    assert any(n.startswith("sampled: 5 of 64") for n in sampled.notes)


def test_small_checkpoints_are_read_whole_under_auto():
    from tests.conftest import fixture_path

    layout = discover(fixture_path("moe_shared_tp2pp2ep2_torch"), shards="auto")
    assert not layout.sampled and all(s.meta is not None for s in layout.shards)


def test_sampled_verdicts_equal_full_ones(big):
    for run in (RUN, {**RUN, "tensor_model_parallel_size": 1}, {**RUN, "hidden_size": 512}):
        a, b = make_plan(big, run, shards="all"), make_plan(big, run, shards="sample")
        assert (a.verdict, a.loader) == (b.verdict, b.loader)
        assert [(f.field, f.severity) for f in a.findings] == [(f.field, f.severity) for f in b.findings]


def test_truncated_unparsed_shard_is_caught(big, tmp_path):
    import shutil

    root = str(tmp_path / "ckpt")
    shutil.copytree(big, root, copy_function=shutil.copy)  # real copies: truncating one must not touch the others
    victim = os.path.join(root, "iter_0000100", "mp_rank_01_002_005", "model_optim_rng.pt")
    with open(victim, "r+b") as fh:
        fh.truncate(os.path.getsize(victim) // 2)
    layout = discover(root, shards="sample")
    assert victim not in {os.path.join(s.path, "model_optim_rng.pt") for s in layout.shards if s.meta is not None}
    assert [(p.code, p.path) for p in layout.problems] == [("corrupt_file", victim)]
    assert make_plan(root, RUN, shards="sample").verdict.value == "fail"


def test_missing_unparsed_shard_is_caught(big, tmp_path):
    import shutil

    root = str(tmp_path / "ckpt")
    shutil.copytree(big, root)
    shutil.rmtree(os.path.join(root, "iter_0000100", "mp_rank_01_001_003"))
    layout = discover(root, shards="sample")
    assert layout.missing_shards == ["mp_rank_01_001_003"]


def test_the_resharder_refuses_a_sampled_layout(big):
    from megatron_preflight.reshard import open_resharder
    from megatron_preflight.reshard.target import TargetLayout

    with pytest.raises(ValueError, match="every shard"):
        open_resharder(discover(big, shards="sample"), TargetLayout(tp=1))


def test_zip_trailer(tmp_path):
    import torch

    path = str(tmp_path / "x.pt")
    torch.save({"a": torch.zeros(1000)}, path)
    assert zip_trailer_problem(path) is None
    data = open(path, "rb").read()
    for cut in (len(data) - 1, len(data) - 30, len(data) // 2, 10):
        with open(path, "wb") as fh:
            fh.write(data[:cut])
        assert zip_trailer_problem(path), cut
