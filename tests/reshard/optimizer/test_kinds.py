"""Every optimizer Megatron-LM main trains with, on its real checkpoints (tests/fixtures/megatron-lm/LOCAL_FIXTURES.md,
"Megatron-LM main's other optimizers"): inspect, check and reshard agree; the state follows the layout by its kind's
split rules; the legacy and torch_dist twins give the same state bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.layout.discover import discover
from megatron_preflight.prove.diff import diff_checkpoints
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.torch_file import TensorRef, TorchFile
from megatron_preflight.tree import map_leaves
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS as TINY

FIXTURES = ["muon_tp2_torch", "muon_tp2_torch_dist", "lion_tp2_torch", "lion_tp2_torch_dist", "sgd_tp2_torch",
            "sgd_tp2_torch_dist", "soap_tp2_torch", "muon_moe_ep2_torch", "muon_moe_ep2_torch_dist"]


def _opt(name: str) -> str:
    return name.split("_", 1)[0]


def _inspect(capsys, name: str) -> dict:
    assert main(["inspect", fixture_path(name), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["optimizer"]["describe"]


def _check(capsys, name: str, *flags: str) -> dict:
    fmt = "torch_dist" if name.endswith("_dist") else "torch"
    main(["check", fixture_path(name), "--json", "--", *TINY, "--ckpt-format", fmt, "--optimizer", _opt(name),
          *flags])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", FIXTURES)
def test_inspect_check_and_reshard_agree(tmp_path, capsys, name):
    """At TP1: inspect names the kind; where it says the state carries only at the same TP (SOAP), check stops the
    run and reshard refuses (exit 1, the same reason); elsewhere check reshards the optimizer and reshard writes it."""
    opt = _inspect(capsys, name)
    assert _opt(name) in opt and "not reshardable" not in opt
    local = "carried only where each parameter's shard stays the same" in opt
    assert local == (_opt(name) == "soap")
    moe = ["--num-experts", "4", "--moe-router-topk", "2"] if "moe" in name else []
    found = {f["field"]: f for f in _check(capsys, name, "--tensor-model-parallel-size", "1", *moe)["findings"]}
    rc = main(["reshard", fixture_path(name), str(tmp_path / "out"), "--tp", "1", "--ep", "1", "--no-progress"])
    err = capsys.readouterr().err
    if local:
        assert found["optimizer"]["severity"] == "fatal" and "SOAP's preconditioners" in found["optimizer"]["message"]
        assert rc == 1 and "SOAP's preconditioners" in err and "--drop-optimizer" in err
        assert not (tmp_path / "out").exists()
    else:
        f = found.get("optimizer")
        # legacy: resharded with the weights; torch_dist: Megatron's own load reshards it (no finding), but not SGD's,
        # which Megatron cannot load at all, nor across an EP change (both served in memory)
        if name.endswith("_torch") or name in ("sgd_tp2_torch_dist", "muon_moe_ep2_torch_dist"):
            assert f is not None and f["severity"] == "reshard", f
        else:
            assert f is None, f
        assert rc == 0, err
        out = discover(str(tmp_path / "out"))
        assert _opt(name) in _inspect(capsys, str(tmp_path / "out")) and out.tp == 1 and (out.ep or 1) == 1


@pytest.mark.parametrize("opt", ["muon", "lion", "sgd"])
def test_the_legacy_and_torch_dist_twins_reshard_to_the_same_state(tmp_path, opt):
    """Both forms of the same save, to TP1 legacy: every weight and every state field equal bit for bit; and the
    torch_dist writer's output read back gives it again."""
    a, b, c = (str(tmp_path / n) for n in ("from_legacy", "from_dist", "via_dist"))
    write_resharded(fixture_path(f"{opt}_tp2_torch"), a, TargetLayout(tp=1), verify=True)
    write_resharded(fixture_path(f"{opt}_tp2_torch_dist"), b, TargetLayout(tp=1), verify=True)
    report = diff_checkpoints(a, b)
    assert report.equal, report.render()
    write_resharded(fixture_path(f"{opt}_tp2_torch"), c + "_dist", TargetLayout(tp=2, ckpt_format="torch_dist"))
    write_resharded(c + "_dist", c, TargetLayout(tp=1), verify=True)
    report = diff_checkpoints(a, c)
    assert report.equal, report.render()


def _parts(path) -> list:
    return [[(g.get("optimizer"), g["is_expert_parallel"], g["wd_mult"], len(g["params"])) for g in part["param_groups"]]
            for part in _load(path)["optimizer"]]


def test_a_muon_chain_with_experts_is_rebuilt_as_megatron_builds_it(tmp_path):
    """EP2 as saved (four parts: Muon dense, Muon expert, Adam dense, Adam expert) from both twins, equal to the
    source file's chain; EP1 merges the experts into the dense parts (two parts)."""
    src = fixture_path("muon_moe_ep2_torch/iter_0000002/mp_rank_00_001/model_optim_rng.pt")
    want = _parts(src)
    assert [[g[:2] for g in p] for p in want] == [[(None, False)], [(None, True)], [("adam", False)] * 2,
                                                  [("adam", True)]]
    for name in ("muon_moe_ep2_torch", "muon_moe_ep2_torch_dist"):
        out = tmp_path / name
        write_resharded(fixture_path(name), str(out), TargetLayout(ep=2))
        assert _parts(out / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt") == want
        write_resharded(fixture_path(name), str(out) + "_ep1", TargetLayout(ep=1))
        merged = _parts(tmp_path / f"{name}_ep1" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
        assert [[g[:2] for g in p] for p in merged] == [[(None, False)], [("adam", False)] * 2]
    assert diff_checkpoints(str(tmp_path / "muon_moe_ep2_torch_ep1"), str(tmp_path / "muon_moe_ep2_torch_dist_ep1")).equal


def test_a_muon_chain_keeps_megatrons_parts_and_each_parameter_its_optimizer(tmp_path):
    """TP2 -> TP1: part 0 is Muon's (momentum per weight matrix, split like it), part 1 Adam's (its groups say so);
    the momentum of the TP1 qkv weight is the two TP2 shards' momenta, by the qkv split rule."""
    out = tmp_path / "tp1"
    write_resharded(fixture_path("muon_tp2_torch"), str(out), TargetLayout(tp=1))
    ours = _load(out / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    src = [_load(fixture_path(f"muon_tp2_torch/iter_0000002/mp_rank_0{r}/model_optim_rng.pt")) for r in (0, 1)]
    muon, adam = ours["optimizer"]
    assert all("optimizer" not in g for g in muon["param_groups"])
    assert all(g["optimizer"] == "adam" for g in adam["param_groups"])
    assert {tuple(s) for s in map(dict.keys, muon["state"].values())} == {("momentum_buffer",)}
    assert {tuple(s) for s in map(dict.keys, adam["state"].values())} == {("step", "exp_avg", "exp_avg_sq")}
    assert sum(len(g["params"]) for g in muon["param_groups"]) == 17  # 16 layer matrices + the position embedding
    # the first layer's qkv weight: per TP rank [q; k; v] per head group, rows interleaved by the split rule; its
    # momentum must follow the weight exactly: compare through the weights' own placement
    keys = [k for k in ours["model"] if k.endswith("linear_qkv.weight")]
    w = ours["model"][keys[0]]
    pieces = [s["model"][keys[0]] for s in src]
    rows = [next(i for i in range(w.shape[0]) if torch.equal(w[i], p[j])) for p in pieces for j in range(p.shape[0])]
    idx = {k: i for i, k in enumerate(k for k in ours["model"] if _is_muon(k, ours["model"][k]))}
    src_idx = {k: i for i, k in enumerate(k for k in src[0]["model"] if _is_muon(k, src[0]["model"][k]))}
    m = muon["state"][idx[keys[0]]]["momentum_buffer"]
    src_m = [s["optimizer"][0]["state"][src_idx[keys[0]]]["momentum_buffer"] for s in src]
    assert torch.equal(m[rows], torch.cat(src_m))


def _load(path) -> dict:
    """A legacy file's content, read by the safe reader (its args pickle megatron classes: never executed)."""
    with TorchFile(str(path)) as f:
        return map_leaves(f.load_metadata(), lambda v, _p: f.tensor(v).clone() if isinstance(v, TensorRef) else v)


def _is_muon(key: str, value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and "word_embeddings" not in key and \
        not key.endswith("_extra_state")


def test_soaps_preconditioners_follow_a_pipeline_change_as_they_are(tmp_path):
    """TP2 -> TP2 PP2: each matrix's L / R / Q_L / Q_R are its source shard's, byte for byte."""
    out = tmp_path / "pp2"
    write_resharded(fixture_path("soap_tp2_torch"), str(out), TargetLayout(tp=2, pp=2), verify=True)
    src = _load(fixture_path("soap_tp2_torch/iter_0000002/mp_rank_01/model_optim_rng.pt"))
    dst = _load(out / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt")
    src_l = [s["L"] for s in src["optimizer"][0]["state"].values()]
    dst_l = [s["L"] for s in dst["optimizer"][0]["state"].values()]
    assert dst_l and len(dst_l) == 8  # the second stage's two layers x four matrices
    assert all(any(torch.equal(d, s) for s in src_l[-8:]) for d in dst_l)
    assert [d.shape for d in dst_l] == [s.shape for s in src_l[-8:]]


def test_check_names_the_runs_other_optimizer_and_predicts_its_memory(capsys):
    found = {f["field"]: f for f in _check(capsys, "muon_tp2_torch", "--tensor-model-parallel-size", "2")["findings"]}
    assert "optimizer" not in found or found["optimizer"]["severity"] != "fatal"
    main(["check", fixture_path("muon_tp2_torch"), "--json", "--", *TINY, "--ckpt-format", "torch", "--optimizer",
          "adam", "--tensor-model-parallel-size", "2"])
    j = json.loads(capsys.readouterr().out)
    bad = next(f for f in j["findings"] if f["field"] == "optimizer")
    assert bad["severity"] == "fatal" and "--optimizer muon" in bad["fix"] and j["verdict"] == "fail"
    mem = {}
    for opt in ("adam", "muon", "sgd"):
        main(["check", fixture_path("muon_tp2_torch"), "--json", "--", *TINY, "--ckpt-format", "torch", "--optimizer",
              opt, "--tensor-model-parallel-size", "2", "--no-load-optim"])
        found = next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["field"] == "memory")
        mem[opt] = found["runtime"]
    assert len(set(mem.values())) == 3  # Adam 8 bytes per element, Muon 4 for the matrices + Adam's, SGD 4


def test_an_optimizer_the_table_does_not_know_loads_as_saved_and_stops_only_a_reshard(tmp_path, capsys):
    """--optimizer laprop (an emerging-optimizers registry name Megatron-LM main accepts; saved args edited on a
    real fixture — a FAKE of the name only): at the saved layout the check lets Megatron load it; at another it
    stops with the reason, and reshard refuses (exit 1)."""
    import glob
    import shutil

    from tests.helpers import ckpt_edit

    src = tmp_path / "laprop"
    shutil.copytree(fixture_path("sgd_tp2_torch"), src)
    for path in glob.glob(str(src / "iter_*" / "mp_rank_*" / "model_optim_rng.pt")):
        state = ckpt_edit.load(path)
        state["args"].optimizer = "laprop"
        ckpt_edit.save(state, path)
    flags = ["--ckpt-format", "torch", "--world-size", "2"]
    assert main(["check", str(src), "--json", "--", *TINY, *flags, "--tensor-model-parallel-size", "2"]) == 0
    capsys.readouterr()
    assert main(["check", str(src), "--json", "--", *TINY, *flags, "--tensor-model-parallel-size", "1"]) == 1
    found = {f["field"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "laprop" in found["optimizer"]["message"] and found["optimizer"]["severity"] == "fatal"
    assert main(["reshard", str(src), str(tmp_path / "out"), "--tp", "1", "--no-progress"]) == 1
    assert "laprop" in capsys.readouterr().err
