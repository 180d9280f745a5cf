"""Megatron-FSDP's fsdp_dtensor checkpoints as a resharder source (real saves of Megatron-LM's pretrain_gpt.py with
the Transformer Engine stand-in ``te_cpu``: see the fixtures' LOCAL_FIXTURES.md).

Oracles: torch DCP's own reader (each fsdp tensor read by its key) for where every piece lands, and the torch_dist
twin of ``fsdp_dp2`` — the same training on the 3D-parallel path (identical losses), saved as torch_dist — whose
reshard to any layout must be the fsdp source's, bit for bit, weights and distributed optimizer state.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.sources.fsdp_dtensor import param_groups
from megatron_preflight.reshard.sources.torch_dist_reader import source_metadata
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path
from tests.helpers import ckpt_edit

FSDP = ("fsdp_dp2", "fsdp_tp2dp2", "fsdp_moe_ep2", "fsdp_dp2_bf16_swiglu", "fsdp_grouped_tp2ep2_bf16",
        "fsdp_gqa_untied_rope", "fsdp_mtp", "fsdp_shared_ep4dp4", "fsdp_v019_bf16_swiglu")


def _iter_dir(name: str) -> str:
    return os.path.join(fixture_path(name), "iter_0000002")


def _dcp(name: str, keys: set[str]) -> dict[str, torch.Tensor]:
    """Tensors of an fsdp_dtensor save read by torch DCP itself (no process group), by key."""
    with pytest.warns(UserWarning, match="single process"):
        nested = _load_state_dict_from_keys(keys=keys, checkpoint_id=_iter_dir(name))
    out: dict[str, torch.Tensor] = {}

    def walk(d: dict, prefix: str) -> None:  # (DCP hands them back nested as the save's planner recorded them)
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else out.__setitem__(f"{prefix}{k}", v)

    walk(nested, "")
    assert set(out) == keys
    return out


def _reshard(name: str, out: str, **sizes) -> str:
    summary = write_resharded(fixture_path(name), out, TargetLayout(**sizes), verify=True)
    assert summary.verified_tensors > 0 and "rng_state" in summary.dropped
    return os.path.join(out, "iter_0000002")


def _model(iter_dir: str, shard: str) -> dict:
    return ckpt_edit.load(os.path.join(iter_dir, shard, "model_optim_rng.pt"))["model"]


@pytest.mark.parametrize("name", FSDP)
def test_discovery_names_the_format_and_reads_the_layout_without_unsafe_pickle(name):
    layout = discover(fixture_path(name))
    assert layout.format.value == "fsdp_dtensor" and layout.ok, [p.to_json() for p in layout.problems]
    assert layout.saved_args.use_megatron_fsdp and layout.iteration == 2
    assert layout.dist_optimizer_sharding == "fsdp_dtensor"
    assert layout.common_state["opt_param_scheduler"]["num_steps"] == 2 * layout.saved_args.global_batch_size
    expected = {"fsdp_tp2dp2": (2, 1), "fsdp_moe_ep2": (1, 2), "fsdp_grouped_tp2ep2_bf16": (2, 2),
                "fsdp_shared_ep4dp4": (1, 4)}.get(name, (1, 1))
    assert (layout.tp, layout.ep) == expected


def test_the_torch_dist_view_stacks_experts_joins_swiglu_halves_and_keeps_the_bytes():
    md = source_metadata(_iter_dir("fsdp_moe_ep2")).state_dict_metadata
    key = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    assert tuple(md[key].size) == (4, 64, 32)
    assert tuple(md[f"optimizer.state.exp_avg.{key}"].size) == (4, 64, 32)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in md
    swiglu = source_metadata(_iter_dir("fsdp_dp2_bf16_swiglu")).state_dict_metadata
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert tuple(swiglu[fc1].size) == (128, 32) and str(swiglu[fc1].properties.dtype).endswith("bfloat16")
    assert str(swiglu[f"optimizer.state.param.{fc1}"].properties.dtype).endswith("float32")  # the fp32 mains
    plain = source_metadata(fixture_path("fsdp_dp2_twin_torch_dist") + "/iter_0000002")
    assert "decoder.layers.self_attention.linear_qkv.weight" in plain.state_dict_metadata  # torch_dist: as it is


def test_param_groups_come_from_the_per_parameter_settings():
    groups = param_groups(_iter_dir("fsdp_dp2"))
    assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0]
    assert all(g["step"] == 2 and g["betas"] == (0.9, 0.999) for g in groups)


def test_a_reshard_of_the_fsdp_source_equals_its_torch_dist_twins_bit_for_bit(tmp_path):
    """The same training saved both ways, resharded to TP2 with the distributed optimizer: every weight and every
    distrib_optim.pt buffer equal (the extra states: the twin's TE values, the fsdp save has none: None)."""
    sizes = dict(tp=2, pp=1, distributed_optimizer=True)
    fsdp = _reshard("fsdp_dp2", str(tmp_path / "fsdp"), **sizes)
    twin = _reshard("fsdp_dp2_twin_torch_dist", str(tmp_path / "twin"), **sizes)
    for shard in ("mp_rank_00", "mp_rank_01"):
        a, b = _model(fsdp, shard), _model(twin, shard)
        weights = [k for k in b if torch.is_tensor(b[k]) and b[k].numel()]
        assert len(weights) > 40 and all(torch.equal(a[k], b[k]) for k in weights)
        assert all(a[k] is None for k in a if k.endswith("_extra_state"))
        da = ckpt_edit.load(os.path.join(fsdp, shard, "distrib_optim.pt"))
        db = ckpt_edit.load(os.path.join(twin, shard, "distrib_optim.pt"))
        for key, world in db[0].items():
            for field in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(da[0][key][field], world[field]), (shard, key, field)


def test_swiglu_halves_and_experts_land_where_the_target_layout_puts_them(tmp_path):
    swiglu = _reshard("fsdp_dp2_bf16_swiglu", str(tmp_path / "s"), tp=2, pp=1)
    w, v = "model.module.decoder.layers.2.mlp.linear_fc1.weight_w", "model.module.decoder.layers.2.mlp.linear_fc1.weight_v"
    full = _dcp("fsdp_dp2_bf16_swiglu", {w, v})
    for rank in (0, 1):
        got = _model(swiglu, f"mp_rank_0{rank}")["decoder.layers.2.mlp.linear_fc1.weight"]
        want = torch.cat([full[w].chunk(2)[rank], full[v].chunk(2)[rank]]).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    moe = _reshard("fsdp_moe_ep2", str(tmp_path / "m"), tp=1, pp=1, ep=4)
    key = "model.module.decoder.layers.3.mlp.experts.local_experts.{}.linear_fc2.weight"
    full = _dcp("fsdp_moe_ep2", {key.format(e) for e in range(4)})
    for e in range(4):
        got = _model(moe, f"mp_rank_00_00{e}")["decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight"]
        assert torch.equal(got, full[key.format(e)])


def test_the_source_is_never_written_to(tmp_path):
    root = fixture_path("fsdp_moe_ep2")
    before = {f: os.stat(os.path.join(dp, f)).st_mtime_ns for dp, _d, fs in os.walk(root) for f in fs}
    _reshard("fsdp_moe_ep2", str(tmp_path / "o"), tp=2, pp=2, ep=1, distributed_optimizer=True)
    after = {f: os.stat(os.path.join(dp, f)).st_mtime_ns for dp, _d, fs in os.walk(root) for f in fs}
    assert before == after
