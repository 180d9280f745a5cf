"""``check HF_DIR -- <run flags>``: the flags ``megatron-preflight flags`` prints pass as printed; each wrong model
flag is named, fatal, with the fix that — applied as printed — clears it; the run is told what loads."""

from __future__ import annotations

import shlex

import pytest

from megatron_preflight.check.hf_model import model_flags
from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.verdict import Verdict
from megatron_preflight.reshard import open_index

hf_models = pytest.importorskip("tests.helpers.hf_models")
pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "nemotron_h",
            "nemotron_h_moe", "nemotron_h_latent", "qwen3_next", "gpt_oss", "qwen3_5_moe", "qwen3_5"]
MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "gpt_oss", "qwen3_5_moe", "nemotron_h_moe",
       "nemotron_h_latent")
# (GPT-OSS's MoE biases take expert-tensor-parallel size 1: a Megatron rule, checked as any layout rule)
RUN = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--tokenizer-type",
       "NullTokenizer", "--vocab-size", "127", "--seq-length", "16", "--micro-batch-size", "1",
       "--global-batch-size", "2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: hf_models.write(name, str(root / name), rope_theta=500000.0 if name == "llama" else 10000.0)
            for name in FAMILIES}


def printed(path: str) -> list[str]:
    return [w for f in model_flags(open_index(path).layout.saved_args) for w in shlex.split(f)]


def fatal(path: str, flags: list[str]) -> dict[str, str]:
    plan = make_plan(path, from_cli(flags + RUN))
    return {f.field: f.fix for f in plan.fatal}


def apply(flags: list[str], fix: str) -> list[str]:
    """A fix as printed: ``set --flag V`` / ``add --flag`` / ``remove --flag`` (with its value)."""
    verb, *rest = shlex.split(fix.split(";")[0])
    out = list(flags)
    if verb in ("set", "remove"):
        for flag in [w for w in rest if w.startswith("--")]:
            while flag in out:
                i = out.index(flag)
                del out[i:i + (2 if i + 1 < len(out) and not out[i + 1].startswith("--") else 1)]
    if verb in ("set", "add"):
        out += rest
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_the_printed_flags_pass_and_the_load_is_weights_only(models, name):
    plan = make_plan(models[name], from_cli(printed(models[name]) + RUN))
    assert plan.fatal == [] and plan.verdict == Verdict.RESHARD
    assert not plan.load_optimizer and not plan.load_rng
    assert any(f.field == "hf_model" for f in plan.findings)


# (family, a wrong flag edit, the field named): every model flag an HF config fixes, on each family where it applies
EDITS = [
    ("num_layers", ["--num-layers", "5"]), ("hidden_size", ["--hidden-size", "64"]),
    ("ffn_hidden_size", ["--ffn-hidden-size", "96"]), ("num_attention_heads", ["--num-attention-heads", "8"]),
    ("num_query_groups", ["--num-query-groups", "1"]), ("kv_channels", ["--kv-channels", "4"]),
    ("position_embedding_type", ["--position-embedding-type", "learned_absolute"]),
    ("rotary_base", ["--rotary-base", "1234"]), ("normalization", ["--normalization", "LayerNorm"]),
    ("norm_epsilon", ["--norm-epsilon", "0.001"]), ("use_rope_scaling", ["--use-rope-scaling"]),
]
MOE_EDITS = [("num_experts", ["--num-experts", "6"]), ("moe_ffn_hidden_size", ["--moe-ffn-hidden-size", "40"]),
             ("moe_router_topk", ["--moe-router-topk", "1"]), ("moe_router_pre_softmax", ["--moe-router-pre-softmax"]),
             ("moe_layer_freq", ["--moe-layer-freq", "([0]+[1]*1)"])]
MLA_EDITS = [("q_lora_rank", ["--q-lora-rank", "8"]), ("kv_lora_rank", ["--kv-lora-rank", "8"]),
             ("qk_head_dim", ["--qk-head-dim", "8"]), ("qk_pos_emb_head_dim", ["--qk-pos-emb-head-dim", "4"]),
             ("v_head_dim", ["--v-head-dim", "8"]), ("rope_type", ["--rope-type", "yarn"]),
             ("moe_router_score_function", ["--moe-router-score-function", "softmax"]),
             ("moe_router_num_groups", ["--moe-router-num-groups", "4"]),
             ("moe_router_topk_scaling_factor", ["--moe-router-topk-scaling-factor", "1.0"]),
             ("moe_shared_expert_intermediate_size", ["--moe-shared-expert-intermediate-size", "32"]),
             ("transformer_impl", ["--transformer-impl", "local"])]
MLA_DROPS = [("multi_latent_attention", "--multi-latent-attention"),
             ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias")]
# GLM-4.5's own fields: RoPE on half of each head, its router (sigmoid, bias, groups, scaling), its shared expert
GLM_EDITS = [("rotary_percent", ["--rotary-percent", "1.0"]),
             ("moe_router_score_function", ["--moe-router-score-function", "softmax"]),
             ("moe_router_num_groups", ["--moe-router-num-groups", "4"]),
             ("moe_router_topk_scaling_factor", ["--moe-router-topk-scaling-factor", "1.0"]),
             ("moe_shared_expert_intermediate_size", ["--moe-shared-expert-intermediate-size", "32"])]
GLM_DROPS = [("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias")]
# NemotronH's own fields: its layer pattern and Mamba-2 mixers, its squared-ReLU MLP; it has no RoPE to edit
HYBRID_EDITS = [("hybrid_layer_pattern", ["--hybrid-layer-pattern", "MM*-"]),
                ("mamba_state_dim", ["--mamba-state-dim", "8"]), ("mamba_head_dim", ["--mamba-head-dim", "8"]),
                ("mamba_num_groups", ["--mamba-num-groups", "1"]), ("mamba_num_heads", ["--mamba-num-heads", "2"])]
HYBRID_DROPS = [("squared_relu", "--squared-relu")]
# NemotronH's MoE layers (Nemotron 3): its router (sigmoid, bias, groups, scaling), shared experts, latent width
HYBRID_MOE_EDITS = [("moe_router_score_function", ["--moe-router-score-function", "softmax"]),
                    ("moe_router_topk_scaling_factor", ["--moe-router-topk-scaling-factor", "3.0"]),
                    ("moe_shared_expert_intermediate_size", ["--moe-shared-expert-intermediate-size", "32"])]
HYBRID_MOE_DROPS = [("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias")]
HYBRID_GROUPS = [("moe_router_num_groups", ["--moe-router-num-groups", "4"])]  # (nemotron_h_moe: 2 groups)
HYBRID_LATENT = [("moe_latent_size", ["--moe-latent-size", "8"])]  # (nemotron_h_latent: 16)
# Qwen3-Next's own fields: its layer pattern, gated delta nets, partial RoPE, gates and zero-centred norms
NEXT_EDITS = [("hybrid_layer_pattern", ["--hybrid-layer-pattern", "GE*EGE*E"]),
              ("linear_key_head_dim", ["--linear-key-head-dim", "16"]),
              ("linear_value_head_dim", ["--linear-value-head-dim", "16"]),
              ("linear_num_value_heads", ["--linear-num-value-heads", "2"]),
              ("linear_conv_kernel_dim", ["--linear-conv-kernel-dim", "2"]),
              ("rotary_percent", ["--rotary-percent", "0.5"])]
NEXT_DROPS = [("apply_layernorm_1p", "--apply-layernorm-1p"), ("attention_output_gate", "--attention-output-gate"),
              ("moe_shared_expert_gate", "--moe-shared-expert-gate")]
# GPT-OSS's own fields: YaRN, attention sinks, the sliding window and its layers, the clamped quick GEGLU
OSS_EDITS = [("rotary_scaling_factor", ["--rotary-scaling-factor", "8.0"]),
             ("yarn_original_max_position_embeddings", ["--yarn-original-max-position-embeddings", "2048"]),
             ("yarn_beta_fast", ["--yarn-beta-fast", "16"]), ("yarn_beta_slow", ["--yarn-beta-slow", "2"]),
             ("softmax_type", ["--softmax-type", "vanilla"]), ("window_size", ["--window-size", "7,0"]),
             ("window_attn_skip_freq", ["--window-attn-skip-freq", "[0,1]"]),
             ("glu_linear_offset", ["--glu-linear-offset", "0.0"]),
             ("activation_func_clamp_value", ["--activation-func-clamp-value", "10.0"])]
OSS_DROPS = [("quick_geglu", "--quick-geglu"),
             ("yarn_correction_range_round_to_int", "--no-yarn-correction-range-round-to-int")]
# (its MoE layers are its pattern's E layers; two Megatron layers per HF layer)
NOT_NEXT = ("num_layers", "moe_layer_freq", "use_rope_scaling")
# (no RoPE, no QK norm or QKV bias to edit; its layers are its pattern's, compared as the pattern)
NOT_HYBRID = ("rotary_base", "use_rope_scaling", "qk_layernorm", "add_qkv_bias", "num_layers", "moe_layer_freq")
NOT_MLA = ("num_query_groups", "kv_channels", "group_query_attention")  # MLA has neither groups nor kv channels
DROPS = [("swiglu", "--swiglu"), ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
         ("qk_layernorm", "--qk-layernorm"), ("add_qkv_bias", "--add-qkv-bias"),
         ("add_bias_linear", "--disable-bias-linear"), ("group_query_attention", "--group-query-attention")]


def _cases():
    for name in FAMILIES:
        mla, glm, hyb = name == "deepseek_v3", name == "glm4_moe", name.startswith("nemotron_h")
        nxt = name in ("qwen3_next", "qwen3_5_moe", "qwen3_5")
        oss = name == "gpt_oss"
        # (each model has one of groups and a latent width and not the other: a run that sets the other is named)
        hyb_moe = HYBRID_MOE_EDITS + HYBRID_GROUPS + HYBRID_LATENT if hyb and name in MOE else []
        for field, edit in EDITS + (MOE_EDITS if name in MOE else []) + (MLA_EDITS if mla else []) + (
                GLM_EDITS if glm else []) + (HYBRID_EDITS if hyb else []) + (NEXT_EDITS if nxt else []) + (
                OSS_EDITS if oss else []) + hyb_moe:
            if not (mla and field in NOT_MLA) and not (hyb and field in NOT_HYBRID) and not (nxt and field in NOT_NEXT):
                yield name, field, edit, None
        for field, flag in DROPS + (MLA_DROPS if mla else []) + (GLM_DROPS if glm else []) + (
                HYBRID_DROPS if hyb else []) + (NEXT_DROPS if nxt else []) + (OSS_DROPS if oss else []) + (
                HYBRID_MOE_DROPS if hyb and name in MOE else []):
            if not (mla and field in NOT_MLA) and not (hyb and field in NOT_HYBRID) and not (nxt and field in NOT_NEXT) \
                    and not (name not in MOE and field.startswith("moe_")):  # (an expert flag on a dense model)
                yield name, field, None, flag


@pytest.mark.parametrize("name, field, edit, drop", list(_cases()))
def test_each_wrong_flag_is_named_and_its_fix_clears_it(models, name, field, edit, drop):
    good = printed(models[name])
    if drop is not None and drop not in good:
        bad = good + [drop]  # present in the run, absent from the model
    elif drop is not None:
        bad = [w for w in good if w != drop]
        if drop == "--group-query-attention":
            bad = apply(bad, "remove --num-query-groups")
    else:
        bad = apply(good, "set " + " ".join(edit))
    found = fatal(models[name], bad)
    names = set(found)
    if field == "group_query_attention":
        field = "num_query_groups"  # GQA off means one group per head: the groups differ
    if field == "moe_router_score_function" and name in ("deepseek_v3", "glm4_moe", "nemotron_h_moe",
                                                         "nemotron_h_latent"):
        names.discard("moe_router_enable_expert_bias")  # (an expert bias needs sigmoid: said as well)
    assert field in names, f"{name}: {bad} -> {found}"
    fixed = apply(bad, found[field])
    assert field not in fatal(models[name], fixed), f"{name}: the fix {found[field]!r} did not clear {field}"


def test_a_tokenizer_larger_than_the_model_is_fatal(models):
    found = make_plan(models["llama"], from_cli(printed(models["llama"]) + RUN[:4] + ["--tokenizer-type",
                                                                                       "NullTokenizer",
                                                                                       "--vocab-size", "200"]))
    assert "vocab_size" in {f.field for f in found.fatal}


def test_a_megatron_fsdp_runs_fix_is_run_as_printed(models, tmp_path):
    """A Megatron-FSDP run given an HF dir is fatal (it loads fsdp_dtensor only); the conversion check prints, run as
    printed, writes what that run loads: check then says LOAD."""
    from tests.helpers.advised import advised, follow

    # (the run's vocab from its tokenizer, not --vocab-size: an HF model's saved vocab is its rows, which a
    # NullTokenizer's --vocab-size counts one short of: see the note on issue 52)
    run = [f for i, f in enumerate(RUN) if f not in ("--tokenizer-type", "--vocab-size")
           and RUN[i - 1] not in ("--tokenizer-type", "--vocab-size")]
    flags = printed(models["llama"]) + run + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                              "optim_grads_params", "--ckpt-format", "fsdp_dtensor", "--bf16"]
    verdict, commands = advised(models["llama"], flags)
    assert verdict == "fail" and len(commands) == 1 and "--ckpt-format fsdp_dtensor" in commands[0]
    new = str(tmp_path / "converted")
    done = follow(commands[0], new)
    assert done.returncode == 0, done.stderr
    verdict, _ = advised(new, flags)
    assert verdict == "load"


@pytest.mark.parametrize("extra, release, named", [
    (["--transformer-impl", "local"], "0.16", True), (["--transformer-impl", "local"], "0.14", False),
    (["--transformer-impl", "local", "--expert-model-parallel-size", "2"], "0.16", False),
    (["--transformer-impl", "transformer_engine", "--moe-grouped-gemm"], "0.16", False)])
def test_biased_experts_at_ep1_on_the_local_spec_are_refused_before_megatron(models, extra, release, named):
    """GPT-OSS's expert biases on the local spec at EP 1: Megatron-LM from 0.15 adds them in place on a view and
    autograd refuses the first step (seen on real Megatron-LM main: tests/hook/test_megatron_hf.py); the fix, applied
    as printed, clears it."""
    from megatron_preflight.check import releases

    def found(flags: list[str]) -> dict[str, str]:
        rt = from_cli(flags + RUN)
        releases.apply(rt, releases.facts(releases.parse_version(release)))
        return {f.field: f.fix for f in make_plan(models["gpt_oss"], rt).fatal}

    run = printed(models["gpt_oss"]) + extra
    got = found(run)
    assert ("expert_model_parallel_size" in got) == named, got
    if named:
        assert "expert_model_parallel_size" not in found(apply(run, got["expert_model_parallel_size"]))


def test_a_tokenizer_that_is_the_models_own_code_is_trusted_in_the_printed_flags(models, tmp_path):
    """Kimi K2's tokenizer is its own code (tokenizer_config.json's auto_map: tokenization_kimi.TikTokenTokenizer):
    transformers' AutoTokenizer, which Megatron's HuggingFaceTokenizer calls, refuses it without trust_remote_code.
    flags prints --trust-remote-code; a run without it is fatal, and the fix, applied as printed, clears it; an
    export carries the tokenizer's module and vocabulary with it."""
    import json
    import os
    import shutil

    from megatron_preflight.check.hf_model import tokenizer_flags

    path = str(tmp_path / "kimi")
    shutil.copytree(models["deepseek_v3"], path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                   "tokenizer_class": "TikTokenTokenizer"}, fh)
    for name in ("tokenization_kimi.py", "tiktoken.model"):
        with open(os.path.join(path, name), "w") as fh:
            fh.write("# the model's own tokenizer\n")
    layout = open_index(path).layout
    assert "--trust-remote-code" in tokenizer_flags(layout)
    assert any("tokenization_kimi.TikTokenTokenizer" in n for n in layout.notes)
    run = [w for f in tokenizer_flags(layout) for w in shlex.split(f)] + RUN[:4] + RUN[8:]
    without = [w for w in run if w != "--trust-remote-code"]
    found = {f.field: f for f in make_plan(path, from_cli(printed(path) + without)).fatal}
    assert "tokenization_kimi.TikTokenTokenizer" in found["tokenizer"].message
    fixed = apply(printed(path) + without, found["tokenizer"].fix)
    assert "tokenizer" not in {f.field for f in make_plan(path, from_cli(fixed)).fatal}
    assert "tokenizer" not in {f.field for f in make_plan(path, from_cli(printed(path) + run)).fatal}
    from megatron_preflight.cli.main import main

    out = str(tmp_path / "exported")
    assert main(["reshard", path, out, "--no-progress", "--ckpt-format", "hf"]) == 0
    assert {"tokenization_kimi.py", "tiktoken.model", "tokenizer_config.json"} <= set(os.listdir(out))
