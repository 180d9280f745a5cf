"""Generalized tensor parallelism (Megatron-LM main's --tensor-parallel-num-weight-shards) on either side.

No GTP checkpoint can be written on this machine (Megatron-LM asserts Transformer Engine >= 2.19 for GTP; the CPU
stand-in is 2.17.1), so the source here is a real TP2 fixture whose saved args are edited to say GTP2 (a FAKE for the
args only): the check must stop any layout change with the saved split as the fix, and reshard must refuse it."""

from __future__ import annotations

import glob
import json
import shutil

from megatron_preflight.cli.main import main
from megatron_preflight.parallel import gtp_sizes
from tests.conftest import fixture_path
from tests.helpers import ckpt_edit
from tests.helpers.tiny import FLAGS as TINY


def _gtp_copy(tmp_path) -> str:
    dst = tmp_path / "gtp"
    shutil.copytree(fixture_path("tp2_torch"), dst)
    for path in glob.glob(str(dst / "iter_*" / "mp_rank_*" / "model_optim_rng.pt")):
        state = ckpt_edit.load(path)
        state["args"].tensor_parallel_num_weight_shards = 4
        ckpt_edit.save(state, path)
    return str(dst)


def _check(capsys, path, *flags):
    rc = main(["check", path, "--json", "--", *TINY, "--ckpt-format", "torch", *flags])
    return rc, {f["field"]: f for f in json.loads(capsys.readouterr().out)["findings"]}


def test_the_gtp_sizes_follow_megatrons_rule():
    assert gtp_sizes({"tensor_parallel_num_weight_shards": 2}, 2, 2) == (1, 1)  # (no GTP: shards = TP)
    assert gtp_sizes({"tensor_parallel_num_weight_shards": 8, "expert_tensor_parallel_num_weight_shards": 4}, 2, 1) \
        == (4, 4)
    assert gtp_sizes({}, 4, 4) == (1, 1)


def test_a_gtp_checkpoint_at_another_layout_stops_with_the_saved_split_and_reshard_refuses(tmp_path, capsys):
    src = _gtp_copy(tmp_path)
    rc, found = _check(capsys, src, "--tensor-model-parallel-size", "1")
    gtp = found["tensor_parallel_num_weight_shards"]
    assert rc == 1 and gtp["severity"] == "fatal" and "GTP2" in gtp["checkpoint"]
    assert "--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 4" in gtp["fix"]
    rc, found = _check(capsys, src, "--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "4",
                       "--world-size", "4")
    assert found["tensor_parallel_num_weight_shards"]["severity"] == "info"  # as saved: Megatron loads it
    assert main(["reshard", src, str(tmp_path / "out"), "--tp", "1"]) == 1
    assert "generalized tensor parallelism" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_gtp_run_from_a_plain_checkpoint_is_named(capsys):
    rc, found = _check(capsys, fixture_path("tp2_torch"), "--tensor-model-parallel-size", "2",
                       "--tensor-parallel-num-weight-shards", "4")
    assert rc == 1 and found["tensor_parallel_num_weight_shards"]["severity"] == "fatal"
