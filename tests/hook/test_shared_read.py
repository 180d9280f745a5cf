"""Thousands of shard files: every rank parses its share of the metadata and rank 0 gathers it (gloo, several
processes); the layout every rank ends with is the one rank 0 alone would have read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_preflight.layout import transport
from megatron_preflight.reshard import open_index
from tests.conftest import fixture_path
from tests.helpers.synthetic import Model, write_legacy

WORKER = textwrap.dedent("""
    import json, os, pickle, sys
    import torch.distributed as dist
    rank, world, init, load, out, with_optim = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                sys.argv[5], sys.argv[6] == "1")
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    import megatron_preflight.hook.shared_read as sr
    d = sys.modules["megatron_preflight.layout.discover"]  # the package exports a function of the same name
    parsed = []
    real = d.read_shard
    def counting(shard, trust):
        parsed.append(shard.name)
        return real(shard, trust)
    d.read_shard = sr.read_shard = counting
    import argparse
    from megatron_preflight.hook.legacy_load import shared_index
    from megatron_preflight.layout import transport
    from megatron_preflight.reshard import TargetLayout, index_builds, open_resharder
    index = shared_index(load, None, False, with_optim)
    assert shared_index(load, None, False, with_optim) is index  # once per process
    layout = index.layout
    with open(out % rank, "wb") as fh:
        fh.write(transport.dumps(layout))
    for tp in (1, 2):  # two resharders (the run's layout, another): one index between them
        open_resharder(index, TargetLayout(tp=tp, pp=1, ep=1, etp=1), keep_optimizer=with_optim)
    print(json.dumps({"rank": rank, "parsed": parsed, "builds": index_builds()}), flush=True)
    dist.barrier()  # then leave without teardown, as the hook's exit_job does (gloo may abort in it otherwise)
    sys.stderr.flush()
    os._exit(0)
""")


def run_world(tmp_path, load, world, *, with_optim=False, env=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, **(env or {}))
    out = str(tmp_path / "layout_%d.bin")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(tmp_path / "init"), load, out,
                               "1" if with_optim else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(world)]
    results = []
    for p in procs:
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        results.append(json.loads(so.strip().splitlines()[-1]))
    layouts = [transport.loads(open(out % r, "rb").read()) for r in range(world)]
    return results, layouts


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("big") / "ckpt")
    write_legacy(root, Model(tp=2, pp=4, ep=8, hidden=256, heads=8, ffn=512, moe_ffn=256, vocab=1000, seq=64))
    return root


def test_each_rank_parses_its_share_and_all_get_rank0s_layout(tmp_path, big):
    results, layouts = run_world(tmp_path, big, world=4)
    alone = transport.slim(open_index(big).layout)
    assert all(layout == alone for layout in layouts)
    names = sorted(s.name for s in alone.shards)
    shares = {r["rank"]: r["parsed"] for r in results}
    for rank in (1, 2, 3):
        assert sorted(shares[rank]) == names[rank::4]  # a quarter each, and nothing else
    sample = 5  # rank 0 also read the sample that listed the checkpoint
    assert sorted(shares[0][sample:]) == names[0::4] and len(shares[0]) == 16 + sample


@pytest.mark.parametrize("name", ["distopt_tp2dp2_torch", "moe_shared_tp2pp2ep2_torch"])
def test_small_checkpoints_forced_cooperative_equal_rank0_alone(tmp_path, name):
    """The distributed optimizer's files travel too (forced: every checkpoint counts as big)."""
    load = fixture_path(name)
    results, layouts = run_world(tmp_path, load, world=3, with_optim=True,
                                 env={"MEGATRON_PREFLIGHT_COOPERATIVE_ABOVE": "0"})
    alone = open_index(load).layout
    if alone.distributed_optimizer:
        from megatron_preflight.reshard.optimizer.distributed import read_dist_meta

        for s in alone.shards:
            read_dist_meta(s)
        assert all(s.dist_meta is not None for s in layouts[1].shards)
    assert all(layout == transport.slim(alone) for layout in layouts)
    assert results[2]["parsed"] == [s.name for s in alone.shards][2::3]
    assert [r["builds"] for r in results] == [1, 1, 1]  # one global index per process, whatever the resharders


def test_below_the_threshold_only_rank0_reads(tmp_path):
    results, layouts = run_world(tmp_path, fixture_path("tp2_torch"), world=3)
    assert [r["parsed"] for r in results[1:]] == [[], []]
    assert all(layout == layouts[0] for layout in layouts)
