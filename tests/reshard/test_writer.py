"""Offline writer: atomic, never touches the source, refuses to drop optimizer state silently, verifies."""

import os

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import discover
from megatron_preflight.reshard.api import TargetLayout
from megatron_preflight.reshard.writer import write_resharded
from tests.conftest import fixture_path
from tests.layout.test_problems import _snapshot


def test_refuses_to_drop_optimizer_silently(tmp_path):
    # A distributed optimizer's distrib_optim.pt cannot be resharded: refused unless the user accepts dropping it.
    with pytest.raises(PreflightError) as exc:
        write_resharded(fixture_path("tp2_distopt_torch"), str(tmp_path / "out"), TargetLayout(tp=1))
    assert "--drop-optimizer" in str(exc.value) and "distrib_optim.pt" in str(exc.value)
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_cli_writes_atomically_and_leaves_source_alone(real_fixture, tmp_path, capsys):
    src = real_fixture("pp2_torch")
    before = _snapshot(src)
    dst = tmp_path / "new"
    rc = main(["reshard", src, str(dst), "--pp", "1", "--tp", "2", "--verify", "--drop-optimizer", "--workers", "2",
               "--no-progress"])
    assert rc == 0 and _snapshot(src) == before
    out = capsys.readouterr().out
    assert "verified" in out and "not carried: rng_state" in out and "peak RSS" in out
    layout = discover(str(dst))
    assert layout.ok and (layout.tp, layout.pp) == (2, 1)
    assert sorted(os.listdir(dst)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".new")] == []


def test_existing_destination_and_dst_inside_src_refused(real_fixture, tmp_path, capsys):
    src = real_fixture("tp2_torch")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["reshard", src, str(tmp_path / "full"), "--tp", "1", "--drop-optimizer"]) == 2
    assert main(["reshard", src, os.path.join(src, "inner"), "--tp", "1", "--drop-optimizer"]) == 2
    assert "never written" in capsys.readouterr().err


def test_target_from_megatron_flags(tmp_path):
    dst = tmp_path / "ep1"
    rc = main(["reshard", fixture_path("moe_ep2_torch"), str(dst), "--drop-optimizer", "--no-progress", "--",
               "--expert-model-parallel-size", "1", "--num-experts", "4", "--hidden-size", "32"])
    assert rc == 0 and discover(str(dst)).ep == 1


def test_drop_optimizer_leaves_it_out_and_says_so(tmp_path, capsys):
    dst = tmp_path / "tp1"
    assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--tp", "1", "--drop-optimizer", "--no-progress"]) == 0
    assert "not carried: optimizer" in capsys.readouterr().out
    layout = discover(str(dst))
    assert layout.ok and "optimizer" not in layout.shards[0].meta


def test_plain_optimizer_carried_by_default(tmp_path, capsys):
    dst = tmp_path / "tp1"
    assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--tp", "1", "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "not carried: optimizer" not in out and "not carried: rng_state" in out
    opt = discover(str(dst)).shards[0].meta["optimizer"]
    assert [len(g["params"]) for g in opt["param_groups"]] == [18, 34] and len(opt["state"]) == 52
