"""A layout sent from rank 0 to the other ranks as bytes: the same metadata, placeholders included, and the same
resharded state."""

import pytest
import torch

from megatron_preflight.layout import transport
from megatron_preflight.layout.discover import discover
from megatron_preflight.placeholders import Placeholder
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path


@pytest.mark.parametrize("name", ["tp2_torch", "moe_ep2_torch", "bf16_gqa_tp2_torch", "tp2_torch_dist"])
def test_layout_survives_transport(name):
    layout = discover(fixture_path(name))
    back = transport.loads(transport.dumps(layout))
    assert repr(back) == repr(transport.slim(layout))
    placeholders = [v for v in vars(layout.saved_args).values() if isinstance(v, Placeholder)]
    assert placeholders  # the args name Megatron enums: they come back as equal placeholders
    assert [v for v in vars(back.saved_args).values() if isinstance(v, Placeholder)] == placeholders


def test_resharded_state_from_transported_layout_is_identical():
    layout = discover(fixture_path("moe_ep2_torch"))
    a = open_resharder(layout, TargetLayout(ep=1))
    b = open_resharder(transport.loads(transport.dumps(layout)), TargetLayout(ep=1))
    sa, sb = a.build(a.plan_for_rank(0)), b.build(b.plan_for_rank(0))
    assert list(sa["model"]) == list(sb["model"])
    assert all(torch.equal(x, sb["model"][k]) for k, x in sa["model"].items() if isinstance(x, torch.Tensor))


@pytest.mark.parametrize("name", ["tp2_torch", "moe_shared_tp2pp2ep2_torch", "distopt_moe_ep2dp2_torch",
                                  "vpp_qkln_pp2_torch", "tp2_torch_dist", "distopt_dpr_tp2dp2_torch_dist"])
def test_round_trip_equals_the_full_layout_less_rng_state(name):
    layout = discover(fixture_path(name))
    back = transport.loads(transport.dumps(layout))
    assert back == transport.slim(layout)  # every field, every shard's metadata (TensorRefs, args, optimizer)
    for s, b in zip(layout.shards, back.shards, strict=True):
        assert set(s.meta) - set(b.meta) <= set(transport.NOT_SENT)
        assert vars(b.meta["args"]) == vars(s.meta["args"])  # sent as a delta, rebuilt whole


def test_args_that_differ_per_shard_are_sent_as_deltas():
    import copy

    layout = discover(fixture_path("moe_shared_tp2pp2ep2_torch"))
    for i, s in enumerate(layout.shards[1:], 1):
        s.meta["args"] = copy.copy(s.meta["args"])
        s.meta["args"].rank = i
        del s.meta["args"].seed
    back = transport.loads(transport.dumps(layout))
    assert [b.meta["args"].rank for b in back.shards[1:]] == list(range(1, len(layout.shards)))
    assert all(not hasattr(b.meta["args"], "seed") for b in back.shards[1:])
    assert back == transport.slim(layout)


def test_payload_is_compact():
    """Under 2 KiB per shard on the real fixtures (the benchmark measures 1,024 and 8,192 shards)."""
    for name in ("moe_shared_tp2pp2ep2_torch", "distopt_moe_ep2dp2_torch"):
        layout = discover(fixture_path(name))
        assert len(transport.dumps(layout)) / len(layout.shards) < 2048 * 4, name
