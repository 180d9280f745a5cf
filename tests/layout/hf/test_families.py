"""The family declarations (megatron_preflight/layout/hf/families/): every family's config table round-trips
(config.json -> Megatron args -> config.json -> the same model), each family reads only what it declares (a key that
changes the model but that the family does not read is refused; a neutral one passes), a field the config leaves out
takes the family's own default, and nothing outside a family's module branches on its name."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import pytest

from megatron_preflight.layout.hf import families
from megatron_preflight.layout.hf.config import load_raw

hf_models = pytest.importorskip("tests.helpers.hf_models")
pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("fam")
    return {name: hf_models.write(name, str(root / name)) for name in hf_models.configs()}


def _read(path: str, raw: dict | None = None):
    raw0, cpath = load_raw(path)
    raw = raw0 if raw is None else raw
    family = families.family_for(raw["architectures"][0], cpath)
    return family, families.read_config(family, raw, cpath)


def _fields(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("path", "raw")}


def test_every_family_has_a_tiny_model_here():
    covered = {families.family_for(type(c).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM"),
                                   "").name
               for c in hf_models.configs().values()}
    assert covered == {f.name for f in families.FAMILIES}


@pytest.mark.parametrize("name", sorted(hf_models.configs()))
def test_the_config_table_round_trips(written, name):
    """config.json -> HfConfig -> Megatron args -> HfConfig -> config.json -> HfConfig: the same model."""
    family, cfg = _read(written[name])
    args = families.megatron_args(family, cfg)
    if cfg.mtp_layers:  # (as layout discovery sets it when the files hold the MTP layers)
        args["mtp_num_layers"] = cfg.mtp_layers
    back = families.config_from_args(family, argparse.Namespace(**args), "x", cfg.architecture)
    again = families.read_config(family, json.loads(json.dumps(families.config_json(family, back))), "x")
    want, got = _fields(cfg), _fields(again)
    # (Megatron's GPT model attends over the whole sequence: a sliding window is a note on import, none on export)
    want["sliding_window"] = got["sliding_window"]
    assert {k: (want[k], got[k]) for k in want if want[k] != got[k]} == {}
    assert {**families.megatron_args(family, again), "mtp_num_layers": args.get("mtp_num_layers")} == \
        {**args, "mtp_num_layers": args.get("mtp_num_layers")}
    assert family in families.fitting_families(argparse.Namespace(**args))
    # (the one it was read from, where several express the model: Qwen3-Next and Qwen3.5)
    chosen = families.family_for_args(argparse.Namespace(**args, hf_architecture=cfg.architecture), None, "x")
    assert chosen == (family, cfg.architecture)


@pytest.mark.parametrize("name, key, value, words", [
    ("llama", "partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5"),
    ("llama", "hidden_activation", "gelu_pytorch_tanh", "hidden_activation"),
    ("qwen2", "final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("mixtral", "n_shared_experts", 1, "n_shared_experts = 1"),
    ("qwen3", "use_qk_norm", True, "use_qk_norm"),
    ("qwen3", "layer_types", ["sliding_attention", "full_attention"], "layer_types"),
])
def test_a_key_the_family_does_not_read_is_refused(written, tmp_path, name, key, value, words):
    raw, _ = load_raw(written[name])
    family, cfg = _read(written[name], {**raw, key: value})
    reasons = families.refusals(family, cfg)
    assert any(words in r and "does not read it" in r for r in reasons), reasons


@pytest.mark.parametrize("name, key, value", [
    ("qwen2", "sliding_window", 4096), ("qwen3", "layer_types", ["full_attention", "full_attention"]),
    ("llama", "pretraining_tp", 1), ("llama", "partial_rotary_factor", 1.0), ("mixtral", "n_shared_experts", 0),
])
def test_a_neutral_value_of_an_unread_key_passes(written, name, key, value):
    raw, _ = load_raw(written[name])
    raw = {**raw, key: value}
    if key == "sliding_window":
        raw["use_sliding_window"] = False
    family, cfg = _read(written[name], raw)
    assert families.refusals(family, cfg) == []


def test_a_field_left_out_takes_the_familys_own_default(written):
    """Mixtral's RoPE base is 1e6 and GLM-4.5 rotates half of each head when config.json does not say (transformers'
    defaults for their config classes), never another family's value."""
    raw, _ = load_raw(written["mixtral"])
    raw = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling")}
    assert _read(written["mixtral"], raw)[1].rope_theta == 1e6
    raw, _ = load_raw(written["glm4_moe"])
    raw = {k: v for k, v in raw.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    assert _read(written["glm4_moe"], raw)[1].rotary_percent == 0.5


def test_a_required_field_left_out_is_named(written):
    raw, path = load_raw(written["glm4_moe"])
    raw = {k: v for k, v in raw.items() if k != "n_routed_experts"}
    family = families.family_for("Glm4MoeForCausalLM", path)
    with pytest.raises(Exception, match="no n_routed_experts"):
        families.read_config(family, raw, path)


def test_no_branch_on_a_familys_name_outside_its_module():
    names = "|".join(re.escape(f.name) for f in families.FAMILIES)
    pattern = re.compile(rf"""(==|!=|\bin\b)\s*[(\[]?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = []
    pkg = os.path.join(REPO, "megatron_preflight")
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or os.path.dirname(path) == os.path.join(pkg, "layout", "hf", "families"):
                continue
            with open(path) as fh:
                for n, line in enumerate(fh, 1):
                    if pattern.search(line):
                        found.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert found == []


def test_infinity_in_a_config_is_taken_where_a_limit_is_unbounded_and_refused_where_a_number_is_used(written,
                                                                                                   tmp_path):
    """transformers 4 writes NemotronH's time_step_limit as [0.0, Infinity]: the config reads; an Infinity where a
    number is used (a RoPE base) is refused, naming the field; NaN anywhere stays refused (test_files.py)."""
    import shutil

    from megatron_preflight.layout.hf.discover import discover_hf

    nem = tmp_path / "nem"
    shutil.copytree(written["nemotron_h"], nem)
    text = (nem / "config.json").read_text().rstrip().rstrip("}")
    (nem / "config.json").write_text(text.replace('"time_step_limit"', '"old_time_step_limit"')
                                     + ', "time_step_limit": [0.0, Infinity]}')
    layout = discover_hf(str(nem))
    assert [p.message for p in layout.problems] == []
    llama = tmp_path / "llama"
    shutil.copytree(written["llama"], llama)
    raw = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": float("inf")}))  # (json writes Infinity)
    assert "Infinity" in (llama / "config.json").read_text()
    with pytest.raises(Exception, match="rms_norm_eps is inf: it must be a finite number"):
        _read(str(llama))


def test_the_hubs_spellings_read_as_transformers_5s(written, tmp_path):
    """GLM-4.5's config.json as the hub writes it (transformers 4: partial_rotary_factor and rope_theta at the top) and
    NemotronH's (hybrid_override_pattern, attention_head_dim, time_step_limit with Infinity, the Mamba flags of its
    remote code) describe the same models as transformers 5's spellings of them."""
    for name, edit in (("glm4_moe", _glm_hub), ("nemotron_h", _nemotron_hub)):
        raw, path = load_raw(written[name])
        family = families.family_for(raw["architectures"][0], path)
        hub = edit(dict(raw))
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hub).replace('"INF"', "Infinity"))
        hub_raw, _ = load_raw(str(tmp_path / name))
        a, b = families.read_config(family, raw, path), families.read_config(family, hub_raw, path)
        assert {k: v for k, v in _fields(a).items() if _fields(b)[k] != v} == {}, name
        assert families.refusals(family, b) == [], name


def _glm_hub(raw: dict) -> dict:
    params = raw.pop("rope_parameters")
    return {**raw, "rope_theta": params["rope_theta"], "partial_rotary_factor": params["partial_rotary_factor"],
            "rope_scaling": None}


def _nemotron_hub(raw: dict) -> dict:
    kinds = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
    pattern = "".join(kinds[k] for k in raw.pop("layers_block_type"))
    head_dim = raw.pop("head_dim")
    raw.pop("time_step_limit", None)
    return {**raw, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern),
            "attention_head_dim": head_dim, "time_step_limit": [0.0, "INF"], "use_bias": False,
            "use_conv_bias": True, "mamba_hidden_act": "silu", "rescale_prenorm_residual": True}


def test_grouped_routing_megatron_ranks_otherwise_is_refused(written):
    """DeepSeek-V3's and NemotronH's routers rank an expert group by its top 2 scores; Megatron by its top
    topk // group_topk: a model where those differ is refused, naming both."""
    raw, _ = load_raw(written["deepseek_v3"])
    family, cfg = _read(written["deepseek_v3"], {**raw, "num_experts_per_tok": 4, "n_group": 2, "topk_group": 1})
    reasons = families.refusals(family, cfg)
    assert any("top 2 scores, Megatron by its top num_experts_per_tok // topk_group = 4" in r for r in reasons)
    family, cfg = _read(written["deepseek_v3"], {**raw, "num_experts_per_tok": 4, "n_group": 2, "topk_group": 2})
    assert not any("grouped routing" in r for r in families.refusals(family, cfg))
