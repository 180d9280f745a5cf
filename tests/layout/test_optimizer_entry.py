"""Where a saved optimizer entry keeps its parts, param groups and distributed form (real Megatron-LM checkpoints:
plain fp32, fp16 wrapped, distributed legacy, chained MoE, torch_dist common state; megatron-core 0.13's form)."""

import os

import pytest

from megatron_preflight.layout import optimizer_entry
from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path

FSMS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron-core-0.13",
                    "fsms_bf16_tp2dp2_torch_dist")


def _entry(layout):
    head = layout.common_state if layout.common_state is not None else layout.shards[0].meta
    return head["optimizer"]


@pytest.mark.parametrize("name, n_parts", [("tp2_torch", 1), ("fp16_qkln_tp2_torch", 1), ("distopt_tp2dp2_torch", 1),
                                           ("moe_ep2_torch", 2), ("tp2_torch_dist", 1)])
def test_every_form_shows_its_parts_and_groups(name, n_parts):
    entry = _entry(discover(fixture_path(name)))
    assert len(optimizer_entry.parts(entry)) == n_parts
    groups = optimizer_entry.param_groups(entry)
    assert groups and all("lr" in g for g in groups) and len(groups) >= 2 * n_parts


def test_a_chained_optimizer_saved_as_an_int_keyed_dict_and_what_has_no_groups():
    assert optimizer_entry.parts({1: "b", 0: "a"}) == ["a", "b"]
    assert optimizer_entry.param_groups({"state": {}}) is None and optimizer_entry.param_groups(None) is None
    assert optimizer_entry.sharding_kinds(_entry(discover(fixture_path("tp2_torch_dist")))) == set()


def test_the_recorded_distributed_form():
    assert optimizer_entry.sharding_kinds(_entry(discover(FSMS))) == {"fully_sharded_model_space"}
