"""The cost of a reshard predicted from its plans (no tensor bytes) against what the reshard then does."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.layout import naming
from megatron_preflight.reshard import cost, write_resharded
from megatron_preflight.reshard.execute.executor import build_tree
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets.zip_writer import TorchZipWriter, zip_size
from tests.conftest import fixture_path

CASES = [
    ("tp2_torch", TargetLayout(tp=1)),
    ("moe_shared_tp2pp2ep2_torch", TargetLayout(tp=1, pp=1, ep=4)),
    ("distopt_tp2dp2_torch", TargetLayout(tp=1)),  # the distributed optimizer's distrib_optim.pt too
    ("vpp_qkln_pp2_torch", TargetLayout(pp=1)),
    ("bf16_gqa_tp2_torch", TargetLayout(tp=1, distributed_optimizer=True)),  # plain -> distributed
    ("tp2_torch_dist", TargetLayout(tp=1)),  # a torch_dist source
]


def _disk(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("name, target", CASES, ids=[c[0] for c in CASES])
def test_offline_prediction_matches_the_run(tmp_path, name, target):
    src = fixture_path(name)
    p = cost.predict_offline(open_resharder(src, target), workers=2, bandwidth=100 * 2**20)
    summary = write_resharded(src, str(tmp_path / "out"), target, workers=1)
    assert p.bytes_read == summary.bytes_read  # the slices the writer copies, counted the same way
    on_disk = _disk(str(tmp_path / "out"))
    # the same pickled tree and zip records: a pickle memo of a repeated value apart (tens of bytes a file)
    assert abs(p.bytes_written - on_disk) <= max(256 * summary.shards, on_disk // 1000), (p.bytes_written, on_disk)
    assert sum(w.bytes_read for w in p.workers) == p.bytes_read
    assert sum(w.bytes_written for w in p.workers) == p.bytes_written - len("2")  # and the tracker (iteration 2)
    assert sorted(s for w in p.workers for s in w.shards) == sorted(os.listdir(tmp_path / "out" / "iter_0000002"))
    assert p.estimated_seconds >= p.bytes_read / (100 * 2**20)
    assert p.peak_rss_bytes >= cost.rss_now() // 2


@pytest.mark.parametrize("name, target", CASES[:5], ids=[c[0] for c in CASES[:5]])
def test_in_memory_prediction_is_what_each_rank_reads_and_builds(name, target):
    r = open_resharder(fixture_path(name), target)
    p = cost.predict_in_memory(r, bandwidth=2**30)
    assert [c.name for c in p.ranks] == list(naming.shard_writers(r.tgt))
    for c in p.ranks:
        plan = r.plan_for_coords(naming.shard_writers(r.tgt)[c.name], c.name)
        files = SourceFiles(r.layout.iter_dir)
        try:
            state = r.build(plan, files)
            if plan.dist_optimizer is not None:  # the distributed optimizer's state (DP rank 0 of each part builds it)
                state["optimizer_dist"] = build_tree(plan.dist_optimizer, files)
            read = files.bytes_read
        finally:
            files.close()
        built = sum(t.numel() * t.element_size() for t in _tensors({k: v for k, v in state.items()
                                                                    if k.startswith(("model", "optimizer"))}))
        assert c.bytes_read + _header_bytes(r) == read
        assert c.bytes_built == built
    assert p.peak_rss_bytes == max(c.bytes_built for c in p.ranks)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def _header_bytes(r) -> int:
    files = SourceFiles(r.layout.iter_dir)
    try:
        r.header(files)
        return files.bytes_read
    finally:
        files.close()


def test_dry_run_writes_nothing_and_prints_json(tmp_path, capsys):
    dst = tmp_path / "out"
    rc = main(["reshard", fixture_path("moe_ep2_torch"), str(dst), "--ep", "1", "--dry-run", "--json",
               "--bandwidth", "500", "--workers", "2"])
    assert rc == 0 and not dst.exists()
    j = json.loads(capsys.readouterr().out)
    assert {"bytes_read", "bytes_written", "peak_rss_bytes", "estimated_seconds", "workers"} <= set(j)
    assert j["bandwidth_from"] == "given" and j["bandwidth_bytes_per_s"] == 500 * 2**20
    assert j["workers"] and all({"shards", "bytes_read", "peak_rss_bytes", "files_opened"} <= set(w)
                                for w in j["workers"])


def test_dry_run_refuses_what_the_run_refuses(tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "x").write_text("x")
    assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--tp", "1", "--dry-run"]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", [[0], [1, 2, 3], [5000, 17, 1, 64, 63, 65], list(range(0, 3000, 97))])
def test_zip_size_is_the_written_size(tmp_path, sizes):
    records = [(f"data/{i}", n) for i, n in enumerate(sizes)]
    path = str(tmp_path / "x.pt")
    with TorchZipWriter(path, "x") as zw:
        for name, n in records:
            zw.write(name, b"\1" * n)
    assert zip_size(records, "x") == os.path.getsize(path)


def test_a_check_plans_the_representative_ranks_of_a_large_target(monkeypatch):
    """Above SAMPLE_ABOVE target dirs the check plans each stage's first and last TP rank at EP rank 0: the worst
    rank's read and built bytes are the full prediction's (the ranks between hold slices of the same sizes)."""
    r = open_resharder(fixture_path("moe_shared_tp2pp2ep2_torch"), TargetLayout(tp=2, pp=2, ep=4))
    full = cost.predict_in_memory(r)
    assert len(full.ranks) == 16 and full.of_ranks == 0 and "read in all" in full.render()
    monkeypatch.setattr(cost, "SAMPLE_ABOVE", 4)
    sampled = cost.predict_in_memory(r, sample=True)
    coords = naming.shard_writers(r.tgt)
    assert sorted((coords[c.name]["pp"], coords[c.name]["tp"], coords[c.name]["ep"]) for c in sampled.ranks) == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert sampled.of_ranks == 16 and "4 of 16 shard dirs planned" in sampled.render()
    assert max(c.bytes_read for c in sampled.ranks) == max(c.bytes_read for c in full.ranks)
    assert sampled.peak_rss_bytes == full.peak_rss_bytes
    assert cost.predict_in_memory(r).of_ranks == 0  # (not asked to sample: every rank)


def test_representative_ranks_keep_the_last_tp_rank_where_ep_spans_the_tp_ranks():
    """TP2·EP2 with ETP1: the TP rank 1 dir is at EP rank 1 (expert ranks run over the TP ranks); it is kept."""
    from megatron_preflight.parallel import ParallelLayout

    sizes = ParallelLayout(tp=2, pp=2, ep=2, etp=1)
    coords = naming.shard_writers(sizes)
    picked = cost.representative_ranks(sizes)
    assert sorted((coords[n]["pp"], coords[n]["tp"]) for n in picked) == [(0, 0), (0, 1), (1, 0), (1, 1)]
