"""GPT-OSS-20b as the hub publishes it, hollow (its config.json's keys and values, its tensor table at real shapes:
experts in MXFP4 blocks and scales, everything else bf16; every body sparse): read from metadata, printed as the run's
flags, checked at 32 GPUs with those flags, and planned — the real model's names, shapes and sizes, no tensor read."""

from __future__ import annotations

import json
import os
import shlex
import struct

import pytest

from megatron_preflight.check.hf_model import model_flags
from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.verdict import Verdict
from megatron_preflight.layout.discover import discover

# openai/gpt-oss-20b's config.json (the hub's keys, transformers 4 spellings)
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
ITEM = {"BF16": 2, "U8": 1}


def _table(cfg: dict) -> list[tuple[str, list[int], str]]:
    h, e, i, v = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", [v, h], "BF16"), ("lm_head.weight", [v, h], "BF16"),
           ("model.norm.weight", [h], "BF16")]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", [h], "BF16"), (p + "post_attention_layernorm.weight", [h], "BF16"),
                (p + "self_attn.q_proj.weight", [q, h], "BF16"), (p + "self_attn.q_proj.bias", [q], "BF16"),
                (p + "self_attn.k_proj.weight", [kv, h], "BF16"), (p + "self_attn.k_proj.bias", [kv], "BF16"),
                (p + "self_attn.v_proj.weight", [kv, h], "BF16"), (p + "self_attn.v_proj.bias", [kv], "BF16"),
                (p + "self_attn.o_proj.weight", [h, q], "BF16"), (p + "self_attn.o_proj.bias", [h], "BF16"),
                (p + "self_attn.sinks", [cfg["num_attention_heads"]], "BF16"),
                (p + "mlp.router.weight", [e, h], "BF16"), (p + "mlp.router.bias", [e], "BF16"),
                (p + "mlp.experts.gate_up_proj_blocks", [e, 2 * i, h // 32, 16], "U8"),
                (p + "mlp.experts.gate_up_proj_scales", [e, 2 * i, h // 32], "U8"),
                (p + "mlp.experts.gate_up_proj_bias", [e, 2 * i], "BF16"),
                (p + "mlp.experts.down_proj_blocks", [e, h, i // 32, 16], "U8"),
                (p + "mlp.experts.down_proj_scales", [e, h, i // 32], "U8"),
                (p + "mlp.experts.down_proj_bias", [e, h], "BF16")]
    return out


def _write(path: str, cfg: dict, files: int = 3) -> None:
    os.makedirs(path)
    table = _table(cfg)
    weight_map = {}
    for k in range(files):
        name = f"model-{k:05d}-of-{files - 1:05d}.safetensors"  # (the hub's names for this model)
        header, at = {}, 0
        for t, shape, code in table[k::files]:
            n = ITEM[code]
            for d in shape:
                n *= d
            header[t] = {"dtype": code, "shape": shape, "data_offsets": [at, at + n]}
            weight_map[t] = name
            at += n
        raw = json.dumps(header).encode()
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + at)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hub") / "gpt-oss-20b")
    _write(path, CONFIG)
    return path


def test_the_hub_dir_reads_as_its_megatron_model(hub):
    lay = discover(hub)
    assert lay.problems == [], lay.problems
    a = lay.saved_args
    assert (a.num_layers, a.hidden_size, a.num_experts, a.moe_router_topk, a.kv_channels, a.num_query_groups) == \
        (24, 2880, 32, 4, 64, 8)
    assert (a.window_size, a.window_attn_skip_freq) == ((127, 0), [1, 0] * 12)
    assert (a.position_embedding_type, a.rotary_scaling_factor, a.yarn_correction_range_round_to_int) == \
        ("yarn", 32.0, False)
    assert any("48 stacked expert weights are MXFP4" in n and "dequantized to bfloat16" in n for n in lay.notes)
    # its config.json names no dtype: its weights are bf16 (the experts' scales aside), so the model is a bf16 one
    assert a.bf16 is True and not getattr(a, "fp16", False)
    assert any("names no dtype" in n and "bfloat16" in n for n in lay.notes)
    model = lay.shards[0].meta["model"]
    fc1 = model["decoder.layers.3.mlp.experts.local_experts.31.linear_fc1.weight"]
    assert tuple(fc1.shape) == (2 * 2880, 2880)
    assert tuple(model["decoder.layers.0.self_attention.core_attention.softmax_offset"].shape) == (64,)


def test_its_printed_flags_pass_check_at_32_gpus_and_plan(hub):
    flags = [w for f in model_flags(discover(hub).saved_args) for w in shlex.split(f)]
    assert "--bf16" in flags  # (from the stored dtype: config.json names none)
    run = flags + ["--tensor-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                   "--expert-tensor-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                   "--world-size", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "201087",
                   "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "64"]
    plan = make_plan(hub, from_cli(run))
    assert plan.fatal == [] and plan.verdict == Verdict.RESHARD, [f.message for f in plan.fatal]
    bad = make_plan(hub, from_cli([w for w in run if w != "--quick-geglu"] + ["--swiglu"]))
    assert {"quick_geglu", "swiglu"} <= {f.field for f in bad.fatal}
