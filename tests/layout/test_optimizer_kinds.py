"""The optimizer kinds table: names, routing, and a field no kind names is an error."""

from __future__ import annotations

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import optimizer_kinds as ok


@pytest.mark.parametrize("name, kind", [(None, "adam"), ("adam", "adam"), ("sgd", "sgd"), ("muon", "muon"),
                                        ("dist_muon", "muon"), ("adaptive_muon", "adaptive_muon"), ("lion", "lion"),
                                        ("soap", "soap")])
def test_every_megatron_optimizer_name_has_a_kind(name, kind):
    assert ok.kind_named(name).name == kind


def test_an_unknown_optimizer_or_field_is_refused_with_the_way_on():
    with pytest.raises(PreflightError) as e:
        ok.kind_named("psgd")
    assert "psgd" in e.value.message and "--no-load-optim" in e.value.fix
    with pytest.raises(PreflightError) as e:
        ok.KINDS["muon"].rule("exp_avg_sq", "x.pt")
    assert "exp_avg_sq" in e.value.message and "momentum_buffer" in e.value.message


@pytest.mark.parametrize("key, shape, primary, scalar", [
    ("decoder.layers.0.self_attention.linear_qkv.weight", (48, 32), "muon", False),
    ("embedding.position_embeddings.weight", (32, 32), "muon", False),  # a matrix, not flagged embedding/output
    ("embedding.word_embeddings.weight", (128, 32), "muon", True),
    ("output_layer.weight", (128, 32), "lion", True),
    ("decoder.layers.0.self_attention.linear_qkv.bias", (48,), "soap", True),
    ("decoder.layers.0.mixer.in_proj.weight", (64, 32), "muon", True),  # use_muon=False
    ("decoder.layers.0.mixer.in_proj.weight", (64, 32), "soap", False),  # (only Muon honours it)
    ("decoder.layers.0.self_attention.linear_qkv.bias", (48,), "adam", False),  # no chain
])
def test_what_an_emerging_optimizer_hands_to_its_scalar_one(key, shape, primary, scalar):
    assert ok.goes_to_scalar(key, shape, ok.kind_named(primary)) is scalar


def test_a_chain_is_described_by_kind_and_a_scalar_group_names_its_optimizer():
    groups = [{"lr": 1.0}, {"optimizer": "adam", "wd_mult": 0.0}]
    assert ok.describe_chain({"optimizer": "muon"}, groups) == \
        "muon (momentum_buffer) for the weight matrices + adam (step, exp_avg, exp_avg_sq) for the rest"
    assert [k.name for k in ok.kinds_of(groups, ok.kind_named("lion"))] == ["lion", "adam"]
    assert ok.describe_chain(None, None) == "adam (step, exp_avg, exp_avg_sq)"
    assert ok.layer_wise({"optimizer": "dist_muon"}) and not ok.layer_wise({"optimizer": "muon"})
