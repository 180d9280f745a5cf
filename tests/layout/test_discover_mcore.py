"""Layout discovery on checkpoints written by real megatron-core GPT models (gloo, 4 CPU processes)."""

from dataclasses import asdict

import pytest

from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format
from megatron_preflight.layout.naming import expected_shards
from megatron_preflight.parallel import ParallelLayout
from tests.helpers.mcore_models import Layout, ModelSpec

LAYOUTS = [
    Layout(tp=1), Layout(tp=2), Layout(tp=4), Layout(pp=2), Layout(tp=2, pp=2), Layout(ep=2),
    Layout(tp=2, ep=2, etp=1), Layout(pp=2, ep=2), Layout(tp=2, pp=2, ep=2, etp=1), Layout(pp=2, vpp=2),
]


def _id(lay):
    return f"tp{lay.tp}pp{lay.pp}ep{lay.ep}" + (f"etp{lay.etp}" if lay.etp else "") + (f"vpp{lay.vpp}" if lay.vpp else "")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("lay", LAYOUTS, ids=_id)
def test_generated_checkpoint_layout(mcore_pool, tmp_path, lay, fmt):
    spec = ModelSpec(num_experts=4 if lay.ep > 1 else None)
    root = str(tmp_path / "ckpt")
    mcore_pool.run("tests.helpers.tasks:write_checkpoint", spec=asdict(spec), layout=asdict(lay), root=root, fmt=fmt)
    layout = discover(root)
    assert layout.problems == [], layout.problems
    assert layout.format == (Format.TORCH if fmt == "torch" else Format.TORCH_DIST)
    assert (layout.tp, layout.pp, layout.ep, layout.vpp) == (lay.tp, lay.pp, lay.ep, lay.vpp)
    assert layout.etp == (lay.etp if lay.etp is not None else lay.tp)
    assert layout.iteration == 10
    if fmt == "torch":
        want = expected_shards(ParallelLayout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp))
        assert [s.name for s in layout.shards] == sorted(want)
        assert layout.dims == ("3D" if lay.ep > 1 else "2D" if lay.pp > 1 else "1D")
        for s in layout.shards:
            assert (s.tp_rank, s.pp_rank, s.ep_rank) == want[s.name]
            chunks = [k for k in s.meta if k.startswith("model")]
            assert chunks == (["model"] if not lay.vpp else [f"model{i}" for i in range(lay.vpp)])


def test_generated_distributed_optimizer_checkpoint(mcore_pool, tmp_path):
    root = str(tmp_path / "ckpt")
    mcore_pool.run("tests.helpers.tasks:write_checkpoint", spec=asdict(ModelSpec()), layout=asdict(Layout(tp=2)),
                   root=root, fmt="torch", dist_opt=True)
    layout = discover(root)
    assert layout.ok and layout.distributed_optimizer is True
    assert all("distrib_optim.pt" in s.files for s in layout.shards)
