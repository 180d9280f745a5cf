"""A Hugging Face model dir read as a checkpoint: each family's config and names, both config spellings, refusals and
damage named (metadata only)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.hf import families
from megatron_preflight.layout.hf.config import load_raw
from megatron_preflight.layout.model import Format

hf_models = pytest.importorskip("tests.helpers.hf_models")
pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]  # (DeepSeek-V3: its own tests below)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: hf_models.write(name, str(root / name)) for name in FAMILIES + ["deepseek_v3"]}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_reads_as_a_tp1_release_checkpoint(models, name):
    lay = discover(models[name])
    assert lay.format == Format.HF and lay.problems == []
    assert (lay.iteration, lay.tp, lay.pp, lay.ep) == ("release", 1, 1, 1)
    args = lay.saved_args
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups) == (2, 32, 4, 2)
    assert args.group_query_attention and args.swiglu and args.normalization == "RMSNorm"
    assert args.add_qkv_bias == (name == "qwen2") and args.qk_layernorm == name.startswith("qwen3")
    assert args.untie_embeddings_and_output_weights == (name != "qwen2")
    model = lay.shards[0].meta["model"]
    qkv = model["decoder.layers.0.self_attention.linear_qkv.weight"]
    head_dim = args.kv_channels
    assert qkv.shape == ((4 + 2 * 2) * head_dim, 32)  # q heads + a k and a v head per group
    if args.num_experts:
        assert model["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == \
            (2 * args.moe_ffn_hidden_size, 32)
        assert "decoder.layers.0.mlp.router.weight" in model
    else:
        assert model["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 64, 32)


def test_qkv_rows_are_grouped_per_query_group(models):
    """Group 1's rows of the fused QKV: its two q heads, then its k head, then its v head."""
    lay = discover(models["llama"])
    ref = lay.shards[0].meta["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    from megatron_preflight.layout.hf.safetensors import tensor_table

    t = tensor_table(models["llama"]).tensors
    row = 32 * 4
    q, k, v = (t[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    group1 = [r for r in ref.runs if 4 * 8 * row <= r.dst < 8 * 8 * row]
    assert [(r.start, r.nbytes) for r in group1] == [(q.start + 2 * 8 * row, 2 * 8 * row), (k.start + 8 * row, 8 * row),
                                                      (v.start + 8 * row, 8 * row)]


def test_transformers_4_spellings_read_alike(models, tmp_path):
    """The hub's config.json (transformers 4): rope_theta and rope_scaling at the top, Qwen3-MoE's num_experts."""
    raw, path = load_raw(models["qwen3_moe"])
    old = dict(raw)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params["rope_theta"]
    old["num_experts"] = old.pop("num_local_experts")
    old["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
    family = families.family_for(raw["architectures"][0], path)
    new, old_cfg = families.read_config(family, raw, path), families.read_config(family, old, path)
    assert old_cfg.num_experts == new.num_experts == 4 and old_cfg.rope_theta == new.rope_theta
    assert old_cfg.rope_scaling.kind == "llama3" and old_cfg.rope_scaling.factor == 8.0


def _edit_config(src: str, dst: str, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as fh:
        raw = json.load(fh)
    raw.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(raw, fh)
    return dst


def test_an_unsupported_architecture_is_refused_naming_what_is(models, tmp_path):
    lay = discover(_edit_config(models["llama"], str(tmp_path / "g"), architectures=["Gemma2ForCausalLM"]))
    assert lay.format == Format.HF and [p.code for p in lay.problems] == ["hf_unsupported"]
    assert "Gemma2ForCausalLM" in lay.problems[0].message and "LlamaForCausalLM" in lay.problems[0].fix


def test_an_activation_megatron_cannot_express_is_refused(models, tmp_path):
    lay = discover(_edit_config(models["llama"], str(tmp_path / "a"), hidden_act="gelu"))
    assert any(p.code == "hf_unsupported" and "gelu" in p.message for p in lay.problems)


def test_weights_that_do_not_fit_the_config_are_named(models, tmp_path):
    lay = discover(_edit_config(models["llama"], str(tmp_path / "n"), num_hidden_layers=3))
    assert any(p.code == "missing_tensor" and "model.layers.2." in p.message for p in lay.problems)
    lay = discover(_edit_config(models["llama"], str(tmp_path / "h"), num_key_value_heads=1))
    assert any(p.code == "hf_shape" and "k_proj" in p.message for p in lay.problems)
    lay = discover(_edit_config(models["llama"], str(tmp_path / "l"), num_hidden_layers=1))
    assert any(p.code == "unmapped_tensor" and "model.layers.1." in p.message for p in lay.problems)


def test_deepseek_v3_reads_under_the_te_specs_names(models):
    """MLA exists in Megatron under the Transformer Engine spec only: the fused q/kv up-projection norms (with
    --qk-layernorm), a separate input norm, the router's expert bias, shared experts, a dense first layer."""
    lay = discover(models["deepseek_v3"])
    assert lay.problems == []
    args, model = lay.saved_args, lay.shards[0].meta["model"]
    assert args.transformer_impl == "transformer_engine" and args.multi_latent_attention and args.qk_layernorm
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == \
        (24, 16, 16, 8, 16)
    assert args.moe_layer_freq == [0, 1, 1] and args.moe_shared_expert_intermediate_size == 16
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert not getattr(args, "mtp_num_layers", None)  # transformers drops the MTP layer on save: said in a note
    assert any("multi-token prediction" in n for n in lay.notes)
    layer0, layer1 = "decoder.layers.0.", "decoder.layers.1."
    assert model[layer0 + "mlp.linear_fc1.layer_norm_weight"].shape == (32,)  # dense first layer
    assert model[layer1 + "self_attention.linear_q_up_proj.layer_norm_weight"].shape == (24,)
    assert model[layer1 + "self_attention.linear_kv_down_proj.weight"].shape == (16 + 8, 32)
    assert model[layer1 + "mlp.router.expert_bias"].shape == (8,)
    assert model[layer1 + "mlp.shared_experts.linear_fc1.weight"].shape == (32, 32)
    assert model[layer1 + "input_layernorm._extra_state"] is None


def test_rotary_rows_rotating_halves_are_interleaved_for_megatrons_mla(tmp_path):
    """Megatron's MLA rotates interleaved pairs (as DeepSeek stores them); a model that rotates halves has its rotary
    rows interleaved on the way: row 2i from i, row 2i + 1 from i + d/2 (the real-Megatron test proves the loss)."""
    lay = discover(hf_models.write("deepseek_v3", str(tmp_path / "h"), rope_interleave=False))
    down = lay.shards[0].meta["model"]["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    row = 32 * 4
    first = down.runs[0].start  # the kv_lora_rank rows, as they are
    assert [(r.start - first) // row for r in down.runs[1:]] == [16, 20, 17, 21, 18, 22, 19, 23]
    assert lay.problems == []


def test_an_mtp_layer_in_the_files_is_read_as_megatrons(models, tmp_path):
    import shutil

    path = hf_models.add_mtp(shutil.copytree(models["deepseek_v3"], str(tmp_path / "mtp")))
    lay = discover(path)
    assert lay.problems == [] and lay.saved_args.mtp_num_layers == 1
    model = lay.shards[0].meta["model"]
    for key in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                "mtp.layers.0.final_layernorm.weight",
                "mtp.layers.0.mtp_model_layer.self_attention.linear_q_up_proj.weight",
                "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.7.linear_fc2.weight"):
        assert key in model, key
    assert model["mtp.layers.0.eh_proj.weight"].shape == (32, 64)


def test_a_dequantized_copy_that_kept_its_quantization_config_reads_as_stored(models, tmp_path):
    """DeepSeek's fp8_cast_bf16.py leaves config.json's quantization_config behind (NeMo-RL's guide removes it with
    jq): bf16 weights under an FP8 config are read as stored, and said so (the FP8 form itself: test_hf_fp8.py)."""
    lay = discover(_edit_config(models["deepseek_v3"], str(tmp_path / "q"),
                                quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                     "weight_block_size": [128, 128]}))
    assert lay.problems == []
    assert any("no weight is stored quantized" in n for n in lay.notes)


def test_deepseek_yarn_reads_as_megatrons_mla_yarn(models, tmp_path):
    """DeepSeek-V3's RoPE is YaRN: --rope-type yarn with its factor and both attention scales; what Megatron's MLA
    cannot be told (its original context 4096, beta 32 / 1 are fixed) is refused when the model differs."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    lay = discover(_edit_config(models["deepseek_v3"], str(tmp_path / "y"), rope_scaling=yarn, rope_parameters=None))
    assert lay.problems == []
    args = lay.saved_args
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    other = dict(yarn, original_max_position_embeddings=8192)
    lay = discover(_edit_config(models["deepseek_v3"], str(tmp_path / "o"), rope_scaling=other, rope_parameters=None))
    assert any(p.code == "hf_unsupported" and "original_max_position_embeddings 8192" in p.message
               for p in lay.problems)


def test_yarn_on_a_gqa_model_reads_as_megatrons_gpt_yarn(models, tmp_path):
    """YaRN on a GQA model (Megatron-LM main's --position-embedding-type yarn): the factor, original context, betas
    and rounding as given; the attention scale from the factor (transformers divides the mscales only when both are
    set); an attention_factor config.json fixes to another value than that is refused, naming it."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
            "beta_slow": 2, "truncate": False}
    lay = discover(_edit_config(models["llama"], str(tmp_path / "l"), rope_scaling=yarn, rope_parameters=None))
    assert lay.problems == []
    a = lay.saved_args
    assert (a.position_embedding_type, a.rotary_scaling_factor, a.yarn_original_max_position_embeddings,
            a.yarn_beta_fast, a.yarn_beta_slow, a.yarn_correction_range_round_to_int, a.mscale, a.mscale_all_dim) == \
        ("yarn", 8.0, 2048, 16.0, 2.0, False, 1.0, 0.0)
    fixed = dict(yarn, attention_factor=1.0)
    lay = discover(_edit_config(models["llama"], str(tmp_path / "f"), rope_scaling=fixed, rope_parameters=None))
    assert any(p.code == "hf_unsupported" and "attention_factor 1.0" in p.message for p in lay.problems)


def test_llama3_rope_scaling_megatron_cannot_set_is_refused(models, tmp_path):
    """Megatron's --use-rope-scaling takes only the factor (low / high frequency factors 1 and 4 and an original
    context of 8,192 are fixed): Llama 3.1's values load; another original context would change every rotary
    frequency silently, so it is refused, naming the value."""
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    lay = discover(_edit_config(models["llama"], str(tmp_path / "a"), rope_scaling=llama3, rope_parameters=None))
    assert lay.problems == [] and (lay.saved_args.use_rope_scaling, lay.saved_args.rope_scaling_factor) == (True, 32.0)
    for name, value in (("original_max_position_embeddings", 4096), ("high_freq_factor", 2.0)):
        other = dict(llama3, **{name: value})
        lay = discover(_edit_config(models["llama"], str(tmp_path / name), rope_scaling=other, rope_parameters=None))
        assert [p.code for p in lay.problems] == ["hf_unsupported"], lay.problems
        assert f"{name} {value}" in lay.problems[0].message


def test_kimi_k2_reads_as_the_deepseek_v3_it_is(models, tmp_path):
    """Kimi K2's config.json: DeepseekV3ForCausalLM under model_type kimi_k2 with its own code (auto_map), no
    scoring_func: the same model as DeepSeek-V3's config describes (transformers' DeepseekV3 router is sigmoid)."""
    auto = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    kimi = _edit_config(models["deepseek_v3"], str(tmp_path / "k"), model_type="kimi_k2", auto_map=auto)
    with open(os.path.join(kimi, "config.json")) as fh:
        assert "scoring_func" not in json.load(fh)
    lay, ref = discover(kimi), discover(models["deepseek_v3"])
    assert lay.problems == []
    assert vars(lay.saved_args) | {"tokenizer_model": None} == vars(ref.saved_args) | {"tokenizer_model": None}
    assert lay.saved_args.moe_router_score_function == "sigmoid"


@pytest.fixture(scope="module")
def expert_models(models, tmp_path_factory):
    """MoE models in each form the experts' layer-at-a-time read takes (plain, FP8 blocks, FP8 per channel) and those
    it leaves to the expert-by-expert read (INT4 packed; GPT-OSS's experts, with biases, stacked in its files)."""
    root = tmp_path_factory.mktemp("experts")
    return {"qwen3_moe": models["qwen3_moe"], "deepseek_v3": models["deepseek_v3"], "mixtral": models["mixtral"],
            "glm4_moe": hf_models.write("glm4_moe", str(root / "glm")),
            "gpt_oss": hf_models.write("gpt_oss", str(root / "oss")),
            "qwen3_next": hf_models.write("qwen3_next", str(root / "next")),
            "deepseek_v3_fp8": hf_models.write_fp8(models["deepseek_v3"], str(root / "fp8"), (24, 20))[0],
            "qwen3_moe_channel": hf_models.write_compressed_fp8(models["qwen3_moe"], str(root / "ch"), "channel")[0],
            "deepseek_v3_int4": hf_models.write_compressed_int(models["deepseek_v3"], str(root / "int4"), 4, 8)[0]}


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "mixtral", "glm4_moe", "qwen3_next", "deepseek_v3_fp8",
                                  "qwen3_moe_channel", "deepseek_v3_int4", "gpt_oss"])
def test_experts_read_a_layer_at_a_time_are_the_refs_read_expert_by_expert(expert_models, name, monkeypatch):
    """A MoE layer's routed experts are built a layer at a time (a DeepSeek-V3 has 58 x 256): the same refs, in the
    same order, as the expert-by-expert read, which a layer that is not regular takes (sequential experts, and a
    hybrid model's Transformer Engine grouped linears: Qwen3-Next)."""
    from megatron_preflight.layout.hf import discover as hf_discover

    taken = []
    grouped = hf_discover._Refs.experts
    monkeypatch.setattr(hf_discover._Refs, "experts", lambda self, g: taken.append(grouped(self, g)) or taken[-1])
    fast = discover(expert_models[name])
    monkeypatch.setattr(hf_discover._Refs, "experts", lambda self, g: None)
    slow = discover(expert_models[name])
    assert fast.problems == slow.problems == []
    assert list(fast.shards[0].meta["model"].items()) == list(slow.shards[0].meta["model"].items())
    by_expert = name.endswith("int4") or name == "gpt_oss"
    assert taken and all((t is None) == by_expert for t in taken)


def test_an_expert_that_differs_from_its_layer_is_read_expert_by_expert(models, tmp_path):
    """One expert's tensor missing (named), or of another shape than its layer's others (read as stored, for the
    index to hold against the args): the expert-by-expert read of that layer."""
    from tests.helpers.safetensors_edit import edit_header

    for kind in ("missing", "shape"):
        path = shutil.copytree(models["qwen3_moe"], str(tmp_path / kind))
        name = "model.layers.1.mlp.experts.2.down_proj.weight"

        def damage(header, body, name=name, kind=kind):
            if kind == "missing":
                del header[name]
            else:  # (the same bytes as a matrix of another shape)
                rows, cols = header[name]["shape"]
                header[name]["shape"] = [rows * 2, cols // 2]

        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        [target] = [f for f in files if name.encode() in open(os.path.join(path, f), "rb").read(1 << 20)]
        edit_header(os.path.join(path, target), damage)
        if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            os.remove(os.path.join(path, "model.safetensors.index.json"))
        lay = discover(path)
        if kind == "missing":
            assert [p.code for p in lay.problems] == ["missing_tensor"] and name in lay.problems[0].message
            continue
        model = lay.shards[0].meta["model"]
        shapes = {model[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"].shape for j in (1, 2)}
        assert lay.problems == [] and len(shapes) == 2
