"""The planner's per-rank bytes at every layout equal check's memory prediction for that layout (which plans the
rank with the resharder, and is proven against real allocations in tests/hook/test_megatron_lm.py)."""

from __future__ import annotations

import pytest

from megatron_preflight import fit, reshard
from megatron_preflight.check.memory import predict
from megatron_preflight.fit.choose import with_sizes
from tests.conftest import fixture_path
from tests.helpers.run_flags import model_flags

CASES = [  # (fixture, world, extra run flags): dense, MoE, MTP (TE stand-in fixtures), MLA, hybrid, uneven, VPP, bf16
    ("tp2_torch", 8, []),
    ("moe_ep2_torch", 8, ["--num-experts", "4"]),
    ("moe_shared_tp2pp2ep2_torch", 8, []),
    ("bf16_gqa_tp2_torch", 4, ["--use-distributed-optimizer"]),
    ("acct_emb_pp2_torch", 4, ["--account-for-embedding-in-pipeline-split"]),
    ("mtp_moe_te_ep2_torch", 4, []),
    ("mtp_te_tp2pp2_torch_dist", 4, []),
    ("mla_te_tp2_torch", 4, []),
    ("hyb_distopt_pp2ep2_torch", 4, []),
    ("distopt_vpp_pp2dp2_torch", 4, ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("fsdp_moe_ep2", 4, []),
]


@pytest.mark.parametrize("name, world, extra", CASES)
def test_every_layout_has_the_memory_check_predicts_for_it(name, world, extra):
    index = reshard.open_index(fixture_path(name))
    argv = model_flags(fixture_path(name)) + ["--micro-batch-size", "1", "--global-batch-size", "8"] + extra
    argv = [a for a in argv if a != "--use-megatron-fsdp"]
    rt = fit.run_args(index.layout.saved_args, argv)
    plan = fit.plan_layouts(index, rt, argv, world)
    assert len(plan.candidates) >= 4, [c.describe() for c in plan.candidates]
    for cand in plan.candidates:
        want = max(predict(index, with_sizes(rt, cand.layout, world)), key=lambda m: m.total)
        got = cand.worst
        assert (got.params, got.grads, got.optimizer, got.activations) == \
            (want.params, want.grads, want.optimizer, want.activations), (cand.describe(), got, want)


def test_the_profile_reads_a_sampled_checkpoint_like_a_full_one(tmp_path):
    """A large legacy checkpoint is read from a sample of its shards (one per stage): the profile is the same."""
    from megatron_preflight.fit.profile import profile_of

    full = profile_of(reshard.open_index(fixture_path("moe_shared_tp2pp2ep2_torch"), shards="all"))
    sampled_index = reshard.open_index(fixture_path("moe_shared_tp2pp2ep2_torch"), shards="sample")
    assert sampled_index.layout.sampled
    sampled = profile_of(sampled_index)
    assert sampled.layers == full.layers and (sampled.first, sampled.last) == (full.first, full.last)
