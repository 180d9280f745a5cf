"""The DeepSeek-V3 structure (tests/helpers/synthetic_dsv3.py: MLA, 3 dense + MoE layers with 256 TE-grouped experts,
a shared expert and the router's expert bias, an MoE MTP layer, uneven first and last pipeline stages), narrowed 64x
so it runs here (and 32 experts): checked at its own layout (load) and another (reshard), resharded PP4·EP8 -> PP2·EP4 and compared
tensor by tensor with the source; the same with the distributed optimizer's files (a chained dense + expert optimizer,
overlapped gradient buckets). What bench_scale.py part F times at the real widths."""

import json
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.layout.dist import read_dcp_metadata
from tests.helpers.synthetic_dsv3 import DSV3, dist_flags, write_legacy, write_torch_dist

SMALL = dict(scale=64, vocab=1024, experts=32)  # (256 experts: ~30k tensors, 80 s here; bench_scale.py part F)


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3") / "pp4ep8"
    m = DSV3(pp=4, ep=8, **SMALL)
    assert write_legacy(str(root), m, hollow=False) == 32
    return root, m


def _check(root, flags):
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "check", str(root), "--json", "--megatron-version",
                        "0.20", "--", *flags], capture_output=True, text=True, timeout=300)
    return json.loads(r.stdout)


def test_its_own_layout_loads_and_another_is_a_reshard(dsv3):
    root, m = dsv3
    assert _check(root, m.flags())["verdict"] == "load"
    other = _check(root, DSV3(pp=2, ep=4, first_stage_layers=30, last_stage_layers=None, **SMALL).flags())
    assert other["verdict"] == "reshard"
    assert {f["field"] for f in other["findings"] if f["severity"] == "fatal"} == set()


def test_a_reshard_to_pp2_ep4_holds_every_tensor(dsv3, tmp_path, capsys):
    root, _ = dsv3
    out = tmp_path / "pp2ep4"
    target = DSV3(pp=2, ep=4, first_stage_layers=30, last_stage_layers=None, **SMALL)
    assert main(["reshard", str(root), str(out), "--no-progress", "--", *target.flags()]) == 0
    assert _check(out, target.flags())["verdict"] == "load"
    capsys.readouterr()
    assert main(["diff", str(root), str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [t["name"] for t in report["tensors"]]
    assert any(".mlp.experts.linear_fc1.weight31" in n for n in names)  # every routed expert, by its global number
    assert any(n.startswith("mtp.layers.0.mtp_model_layer.self_attention.linear_kv_up_proj") for n in names)
    assert any(n.endswith("mlp.router.expert_bias") for n in names)


def _with_dist_optimizer(flags):
    return [f for f in flags if f not in ("--no-load-optim", "--no-load-rng")] + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--no-load-rng"]


@pytest.fixture(scope="module")
def dsv3_optimizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3o") / "pp4ep8"
    m = DSV3(pp=4, ep=8, **SMALL)
    write_legacy(str(root), m, hollow=False, optimizer=True)
    return root, m


def test_the_distributed_optimizer_is_resharded_with_the_weights(dsv3_optimizer, tmp_path, capsys):
    root, m = dsv3_optimizer
    own = _check(root, _with_dist_optimizer(m.flags()))
    assert own["verdict"] == "load" and own["load_optimizer"], own
    target = DSV3(pp=2, ep=4, first_stage_layers=30, last_stage_layers=None, **SMALL)
    flags = _with_dist_optimizer(target.flags())
    other = _check(root, flags)
    assert other["verdict"] == "reshard" and other["load_optimizer"], other
    assert ("optimizer", "reshard") in {(f["field"], f["severity"]) for f in other["findings"]}
    out = tmp_path / "pp2ep4"
    assert main(["reshard", str(root), str(out), "--no-progress", "--", *flags]) == 0
    assert all((out / "iter_0001000" / d / "distrib_optim.pt").is_file() for d in
               ("mp_rank_00_000_000", "mp_rank_00_001_003"))
    assert _check(out, flags)["verdict"] == "load"
    capsys.readouterr()
    assert main(["diff", str(root), str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = {t["name"] for t in report["tensors"]}
    assert report["equal"] and report["optimizer_step"] == [2, 2]
    assert {"embedding.word_embeddings.weight#exp_avg_sq", "decoder.layers.60.mlp.experts.linear_fc2.weight31#exp_avg",
            "mtp.layers.0.mtp_model_layer.mlp.router.weight#exp_avg"} <= names


def test_the_hollow_torch_dist_form_indexes_what_the_real_one_holds(dsv3_optimizer, tmp_path, capsys):
    """bench_scale.py part F's torch_dist DeepSeek-V3 is hollow (sparse data files); here, narrowed, its ``.metadata``
    is the real conversion's (every global tensor, chunk and storage key; lengths within a record header's
    alignment), each routed expert's chunk lies in its EP rank's file, and the check says the same of both."""
    root, m = dsv3_optimizer
    real, hollow = tmp_path / "real", tmp_path / "hollow"
    assert write_torch_dist(str(real), m, str(root), optimizer=True, hollow=False) == 1
    assert write_torch_dist(str(hollow), m, str(root), optimizer=True) == m.pp * m.ep
    a, b = (read_dcp_metadata(str(d / "iter_0001000")) for d in (real, hollow))
    assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data.keys() == b.storage_data.keys()
    assert all(abs(a.storage_data[k].length - b.storage_data[k].length) <= 128 for k in a.storage_data)
    per_rank = m.experts // m.ep
    for key, info in b.storage_data.items():
        if key.fqn == "optimizer.state.exp_avg.decoder.layers.60.mlp.experts.experts.linear_fc1.weight":
            assert info.relative_path == f"__{(m.pp - 1) * m.ep + key.offset[0] // per_rank}_0.distcp"
    assert {p.name for p in (hollow / "iter_0001000").glob("*.distcp")} == {f"__{r}_0.distcp" for r in range(32)}
    flags = dist_flags(DSV3(pp=2, ep=4, first_stage_layers=30, last_stage_layers=None, **SMALL).flags(), True)
    verdicts = [_check(d, flags) for d in (real, hollow)]
    assert [(v["verdict"], v["loader"], v["load_optimizer"]) for v in verdicts] == [("reshard", "reshard", True)] * 2
    assert main(["diff", str(root), str(real), "--json"]) == 0  # the real form holds the legacy checkpoint's values
    assert json.loads(capsys.readouterr().out)["equal"]
