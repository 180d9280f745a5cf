"""Transformer Engine FP8 extra state (per module and rank: recipe, scales, amax history).

MADE FOR THE TEST, named as such: no TE here runs FP8, so the TE-spec checkpoint te_tp2_torch (written by real
Megatron-LM with the CPU stand-in for TE 2.17.1) gets, in every TE linear's ``_extra_state``, the bytes TE 2.x's
``TransformerEngineBaseModule.get_extra_state`` writes with FP8 on: ``pickle.dumps`` of {"recipe", "scale_fwd",
"amax_history_fwd", "scale_bwd", "amax_history_bwd", "extra_fp8_variables"} as a uint8 tensor (the recipe left None:
TE's DelayedScaling class is not importable here), different on each TP rank (each rank's amax of its own slice).
"""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict

import torch

from megatron_preflight import pickling
from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.report import render_layout
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.layout import naming
from megatron_preflight.reshard import TargetLayout, open_index, write_resharded
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.torch_file import TorchFile
from tests.conftest import fixture_path
from tests.helpers.tiny import MODEL_FLAGS


def fp8_state(rank: int, key: str) -> torch.Tensor:
    seed = sum(map(ord, key)) + 1000 * rank
    g = torch.Generator().manual_seed(seed)
    state = {"recipe": None, "scale_fwd": torch.rand(3, generator=g), "amax_history_fwd": torch.rand(16, 3, generator=g),
             "scale_bwd": torch.rand(2, generator=g), "amax_history_bwd": torch.rand(16, 2, generator=g),
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "global_fp8_buffer_pos_fwd": 0}}
    buf = io.BytesIO()
    pickle.dump(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def make_fp8_checkpoint(root: str) -> None:
    r = open_resharder(fixture_path("te_tp2_torch"), TargetLayout())
    for name, coords in naming.shard_writers(r.tgt).items():
        sd = r.build(r.plan_for_coords(coords, name))
        sd["model"] = OrderedDict(
            (k, fp8_state(coords["tp"], k) if k.endswith("_extra_state") and ".linear_" in k else v)
            for k, v in sd["model"].items())
        os.makedirs(os.path.join(root, "iter_0000002", name))
        torch.save(sd, os.path.join(root, "iter_0000002", name, "model_optim_rng.pt"), pickle_module=pickling)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")


def extra_states(root: str, shard: str) -> dict[str, bytes]:
    with TorchFile(os.path.join(root, "iter_0000002", shard, "model_optim_rng.pt")) as f:
        meta = f.load_metadata()
        return {k: bytes(f.tensor(v).tolist()) for k, v in meta["model"].items()
                if k.endswith("_extra_state") and ".linear_" in k}


def test_inspect_and_check_report_fp8_metadata(tmp_path):
    root = str(tmp_path / "fp8")
    make_fp8_checkpoint(root)
    index = open_index(root)
    assert index.fp8_extra_states == 4 * 4  # linear_qkv, linear_proj, fc1, fc2 in 4 layers
    assert "hold Transformer Engine FP8 metadata" in render_layout(index)
    flags = MODEL_FLAGS + ["--transformer-impl", "transformer_engine"]
    p = make_plan(root, from_cli(flags + ["--tensor-model-parallel-size", "1"]))
    f, = [f for f in p.findings if f.field == "fp8_extra_state"]
    assert "TP rank 0's" in f.message
    same_tp = make_plan(root, from_cli(flags + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                                "2"]))
    assert "fp8_extra_state" not in [f.field for f in same_tp.findings]


def test_a_reshard_that_keeps_each_slice_keeps_each_ranks_scales(tmp_path):
    root, out = str(tmp_path / "fp8"), str(tmp_path / "pp2")
    make_fp8_checkpoint(root)
    write_resharded(root, out, TargetLayout(pp=2))
    for tp in range(2):
        src = extra_states(root, f"mp_rank_{tp:02d}")
        seen = 0
        for stage in range(2):  # stage 1's local layers 0, 1 are global layers 2, 3
            for key, value in extra_states(out, f"mp_rank_{tp:02d}_{stage:03d}").items():
                layer = int(key.split(".")[2])
                assert value == src[key.replace(f"layers.{layer}.", f"layers.{layer + 2 * stage}.")], (tp, key)
                seen += 1
        assert seen == len(src) == 16


def test_a_reshard_that_re_splits_gives_every_rank_tp_rank_0s(tmp_path):
    root, out = str(tmp_path / "fp8"), str(tmp_path / "tp1")
    make_fp8_checkpoint(root)
    write_resharded(root, out, TargetLayout(tp=1))
    assert extra_states(out, "mp_rank_00") == extra_states(root, "mp_rank_00")
