"""The split-rule table: every Megatron-Core GPT key matches exactly one row, with the split Megatron uses."""

import re

import pytest

from megatron_preflight.reshard.plan import rules
from megatron_preflight.reshard.plan.rules import (
    AmbiguousRuleError,
    Rule,
    UnknownKeyError,
    parse_key,
    rule_for,
    segments,
)

# (key, SwiGLU, expected kind, expected group): facts from megatron-core's sharded_state_dict (split dims per layer).
KEYS = [
    ("embedding.word_embeddings.weight", False, "vocab", "tp"),
    ("embedding.position_embeddings.weight", False, "replicated", "tp"),
    ("output_layer.weight", False, "vocab", "tp"),
    ("output_layer._extra_state", False, "extra", "tp"),
    ("decoder.final_layernorm.weight", False, "replicated", "tp"),
    ("decoder.final_layernorm.bias", False, "replicated", "tp"),
    ("decoder.layers.0.input_layernorm.weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_qkv.weight", False, "column", "tp"),
    ("decoder.layers.3.self_attention.linear_qkv.bias", False, "column", "tp"),
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_qkv._extra_state", False, "extra", "tp"),
    ("decoder.layers.3.self_attention.q_layernorm.weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_proj.weight", False, "row", "tp"),
    ("decoder.layers.3.self_attention.linear_proj.bias", False, "replicated", "tp"),
    # multi-latent attention (TE spec): whole heads per rank in the up / plain Q projections, duplicated down ones
    ("decoder.layers.3.self_attention.linear_q_proj.weight", False, "column", "tp"),
    ("decoder.layers.3.self_attention.linear_q_up_proj.weight", False, "column", "tp"),
    ("decoder.layers.3.self_attention.linear_kv_up_proj.weight", False, "column", "tp"),
    ("decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_bias", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_q_down_proj.weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_kv_down_proj.weight", False, "replicated", "tp"),
    ("decoder.layers.3.self_attention.linear_kv_down_proj._extra_state", False, "extra", "tp"),
    ("decoder.layers.3.self_attention.kv_layernorm.weight", False, "replicated", "tp"),
    # multi-token prediction: the MTP layer's own modules, and its transformer layer under either name
    ("mtp.layers.0.enorm.weight", False, "replicated", "tp"),
    ("mtp.layers.0.hnorm.bias", False, "replicated", "tp"),
    ("mtp.layers.1.final_layernorm.weight", False, "replicated", "tp"),
    ("mtp.layers.0.eh_proj.weight", False, "column", "tp"),
    ("mtp.layers.0.eh_proj._extra_state", False, "extra", "tp"),
    ("mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight", False, "column", "tp"),
    ("mtp.layers.0.transformer_layer.self_attention.linear_proj.weight", False, "row", "tp"),
    ("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight", True, "glu", "tp"),
    ("mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.1.linear_fc2.weight", False, "row", "etp"),
    ("decoder.layers.1.mlp.linear_fc1.weight", False, "column", "tp"),
    ("decoder.layers.1.mlp.linear_fc1.weight", True, "glu", "tp"),
    ("decoder.layers.1.mlp.linear_fc1.layer_norm_bias", True, "replicated", "tp"),
    ("decoder.layers.1.mlp.linear_fc2.weight", False, "row", "tp"),
    ("decoder.layers.1.mlp.linear_fc2.bias", False, "replicated", "tp"),
    ("decoder.layers.1.mlp.router.weight", False, "replicated", "tp"),
    ("decoder.layers.1.mlp.router.expert_bias", False, "replicated", "tp"),
    ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", True, "glu", "tp"),
    ("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", False, "row", "tp"),
    ("decoder.layers.1.mlp.shared_experts.gate_weight", False, "replicated", "tp"),
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", True, "glu", "etp"),
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", False, "column", "etp"),
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight", False, "row", "etp"),
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.bias", False, "replicated", "etp"),
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2._extra_state", False, "extra", "tp"),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight3", False, "column", "etp"),
    ("decoder.layers.1.mlp.experts.linear_fc2.weight3", False, "row", "etp"),
    ("decoder.layers.1.mlp.experts.linear_fc1._extra_state", False, "extra", "tp"),
]


@pytest.mark.parametrize("key,swiglu,kind,group", KEYS)
def test_every_key_matches_exactly_one_row(key, swiglu, kind, group):
    info = parse_key(key)
    assert len(rules.matching_rules(info)) == 1
    rule = rule_for(info, swiglu=swiglu)
    assert (rule.kind, rule.group) == (kind, group)


def test_parse_key_places_layers_and_experts():
    info = parse_key("decoder.layers.7.mlp.experts.local_experts.3.linear_fc2.weight")
    assert (info.layer, info.expert, info.style, info.suffix) == (7, 3, "seq_expert", "linear_fc2.weight")
    assert info.render(1, 0) == "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    te = parse_key("decoder.layers.2.mlp.experts.linear_fc1.weight5")
    assert (te.layer, te.expert, te.style) == (2, 5, "te_grouped") and te.render(0, 1).endswith("linear_fc1.weight1")


def test_an_mtp_layer_is_one_global_name_whichever_name_its_source_wrote():
    old, new = (parse_key(f"mtp.layers.1.{inner}.mlp.experts.linear_fc1.weight3")
                for inner in ("transformer_layer", "mtp_model_layer"))
    assert (old.layer, old.expert, old.style, old.suffix) == (None, 3, "te_grouped", "linear_fc1.weight")
    assert old.global_suffix == new.global_suffix == "mtp.layers.1.mtp_model_layer.linear_fc1.weight"
    assert old.render(None, 0) == "mtp.layers.1.transformer_layer.mlp.experts.linear_fc1.weight0"  # as the source
    back = rules.info_of_global(None, 3, "te_grouped", old.global_suffix)
    assert back.render(None, 5) == "mtp.layers.1.mtp_model_layer.mlp.experts.linear_fc1.weight5"
    assert rules.mtp_index("mtp.layers.1.eh_proj.weight") == 1 and rules.mtp_index("decoder.final_norm.weight") is None
    places = [rules.mtp_place(f"mtp.layers.{i}.{m}") for i in (0, 1) for m in
              ("enorm.weight", "hnorm.weight", "eh_proj.weight", "mtp_model_layer.input_layernorm.weight",
               "final_layernorm.weight")]
    assert places == sorted(places) and len(set(places)) == len(places)  # Megatron's module order, layer by layer


def test_an_mtp_key_is_spelled_both_ways():
    key = "mtp.layers.2.transformer_layer.self_attention.linear_qkv.weight"
    assert rules.mtp_layer_name(key) == "transformer_layer" and rules.mtp_layer_name("mtp.layers.0.eh_proj.weight") is None
    assert rules.mtp_spellings(key) == (key, "mtp.layers.2.mtp_model_layer.self_attention.linear_qkv.weight")
    assert rules.mtp_spellings("decoder.layers.0.mlp.linear_fc1.weight") == ("decoder.layers.0.mlp.linear_fc1.weight",)


def test_unknown_key_is_refused_by_name():
    with pytest.raises(UnknownKeyError, match="decoder.layers.0.self_attention.linear_qkv_down_proj.weight"):
        rule_for(parse_key("decoder.layers.0.self_attention.linear_qkv_down_proj.weight"), swiglu=False)


def test_two_matching_rows_are_an_error_not_first_match(monkeypatch):
    table = rules._COMPILED + [(rules.re.compile(r"input_layernorm\.weight$"), Rule("column"))]
    monkeypatch.setattr(rules, "_COMPILED", table)
    rules._rule_of_suffix.cache_clear()  # rules are matched once per suffix; the table changed under the cache
    try:
        with pytest.raises(AmbiguousRuleError, match="matches 2 rows"):
            rule_for(parse_key("decoder.layers.0.input_layernorm.weight"), swiglu=False)
    finally:
        rules._rule_of_suffix.cache_clear()


def test_legacy_grouped_gemm_is_parsed_as_packed_experts():
    info = parse_key("decoder.layers.3.mlp.experts.weight2")
    assert (info.layer, info.expert, info.style, info.suffix) == (3, None, "legacy_grouped", "mlp.experts.weight2")


@pytest.mark.parametrize("kind,n,size,rank,expected", [
    ("column", 8, 2, 1, [(4, 4, 0)]),
    ("row", 6, 3, 2, [(4, 2, 0)]),
    ("glu", 8, 2, 0, [(0, 2, 0), (4, 2, 2)]),  # [gate; up]: rank 0 holds gate[0:2] then up[0:2]
    ("glu", 8, 2, 1, [(2, 2, 0), (6, 2, 2)]),
])
def test_segments(kind, n, size, rank, expected):
    assert segments(Rule(kind), n, size, rank) == expected


def test_segments_of_all_ranks_tile_the_global_tensor():
    for kind in ("column", "glu"):
        for size in (1, 2, 4):
            rows = sorted(r for rank in range(size) for g, n, _ in segments(Rule(kind), 16, size, rank)
                          for r in range(g, g + n))
            assert rows == list(range(16))


@pytest.mark.parametrize("table", ["_TABLE", "_EXPERT_TABLE"])
def test_a_row_matched_as_names_matches_what_its_pattern_matches(table):
    """Rows whose pattern only spells names (dots, words, (a|b) choices) are matched as a set, not compiled: the set
    is what the regular expression matches, no more (near misses included), and every other row stays a pattern."""
    compiled = rules._COMPILED if table == "_TABLE" else rules._EXPERT_COMPILED
    as_names = 0
    for (pattern, _rule), (row, _) in zip(getattr(rules, table), compiled, strict=True):
        regex = re.compile(pattern + "$")
        assert row.pattern == regex.pattern
        if not isinstance(row, rules._Names):
            assert isinstance(row, re.Pattern) and not rules._NAMES_ONLY.fullmatch(pattern)
            continue
        as_names += 1
        expected = 1
        for choice in re.findall(r"\(([^)]*)\)", pattern):
            expected *= len(choice.split("|"))
        assert len(row.names) == expected
        for name in row.names:
            assert regex.match(name) and row.match(name)
            for miss in (name + "x", name[:-1], "x" + name, name.replace(".", "_", 1)):
                assert bool(regex.match(miss)) == row.match(miss), (pattern, miss)
    assert as_names > 0
