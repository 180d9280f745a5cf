"""A layout sent from rank 0 to the other ranks as bytes: the same metadata, placeholders included, and the same
resharded state."""

import pytest
import torch

from megatron_preflight.layout import discover, transport
from megatron_preflight.reshard.api import TargetLayout, open_resharder
from megatron_preflight.safe_pickle import Placeholder
from tests.conftest import fixture_path


@pytest.mark.parametrize("name", ["tp2_torch", "moe_ep2_torch", "bf16_gqa_tp2_torch", "tp2_torch_dist"])
def test_layout_survives_transport(name):
    layout = discover(fixture_path(name))
    back = transport.loads(transport.dumps(layout))
    assert repr(back) == repr(layout)
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
