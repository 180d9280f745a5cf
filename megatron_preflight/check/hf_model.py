"""A Hugging Face model against the run: every model flag the HF ``config.json`` fixes (through the family table,
:mod:`megatron_preflight.layout.hf.families`), compared all at once, and the flags a run copies to build the model.

The shapes (layers, hidden, FFN, heads, groups, kv channels, experts, tied head, biases, QK norm, SwiGLU,
normalization) are compared for every checkpoint (:mod:`.compare`); what a Megatron checkpoint may legitimately change
but an HF model fixes — RoPE base and scaling, the norm epsilon, the router's top-k and softmax order, the MoE layer
pattern — is compared here: the weights would load and train another model, silently."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Format, Layout

FATAL, INFO = Severity.FATAL, Severity.INFO

# (field, what it changes); compared only when the HF model fixes it (its value in the saved args is not None)
FUNCTION_FIELDS = (
    ("rotary_base", "RoPE's base (rope_theta)"),
    ("rotary_percent", "the share of each head RoPE rotates"),
    ("use_rope_scaling", "llama3 RoPE frequency scaling"),
    ("rope_scaling_factor", "llama3 RoPE scaling's factor"),
    ("rotary_seq_len_interpolation_factor", "linear RoPE position interpolation"),
    ("norm_epsilon", "the RMSNorm epsilon"),
    ("add_qkv_bias", "the QKV projection's bias"),
    ("moe_router_topk", "how many experts each token is routed to"),
    ("moe_router_pre_softmax", "whether the router's softmax is taken over all experts before top-k"),
    ("moe_router_score_function", "the router's score function"),
    ("moe_layer_freq", "which layers are MoE layers"),
    ("moe_shared_expert_intermediate_size", "the shared experts' size"),
    ("moe_router_enable_expert_bias", "the router's expert bias (DeepSeek-V3's e_score_correction_bias)"),
    ("moe_router_num_groups", "the router's expert groups"),
    ("moe_router_group_topk", "how many expert groups each token may use"),
    ("moe_router_topk_scaling_factor", "the routed experts' scaling factor"),
    ("moe_latent_size", "the latent width the experts compute in (NemotronH's fc1/fc2_latent_proj)"),
    ("rope_type", "the rotary embedding's kind (MLA takes yarn unless told)"),
    ("rotary_scaling_factor", "YaRN's scaling factor"),
    ("mscale", "YaRN's attention scale (mscale)"),
    ("mscale_all_dim", "YaRN's attention scale over all dims (mscale_all_dim)"),
    ("apply_layernorm_1p", "zero-centred norm weights (each norm computes with 1 + its weight)"),
    ("attention_output_gate", "the attention output's sigmoid gate"),
    ("moe_shared_expert_gate", "the shared expert's sigmoid gate"),
    ("linear_key_head_dim", "the gated delta nets' key head dim"),
    ("linear_value_head_dim", "the gated delta nets' value head dim"),
    ("linear_num_key_heads", "the gated delta nets' key heads"),
    ("linear_num_value_heads", "the gated delta nets' value heads"),
    ("linear_conv_kernel_dim", "the gated delta nets' convolution taps"),
    ("position_embedding_type", "the position embedding (YaRN: rotary frequencies and an attention scale)"),
    ("yarn_original_max_position_embeddings", "YaRN's original context"),
    ("yarn_beta_fast", "YaRN's beta_fast"), ("yarn_beta_slow", "YaRN's beta_slow"),
    ("yarn_correction_range_round_to_int", "whether YaRN rounds its correction range (transformers' truncate)"),
    ("softmax_type", "the attention softmax (learnable: a sink logit per head)"),
    ("window_size", "the sliding attention window"),
    ("window_attn_skip_freq", "which layers attend over the sliding window"),
    ("quick_geglu", "the MLP's activation (quick GELU, gated)"),
    ("glu_linear_offset", "the offset added to the GLU's linear half"),
    ("activation_func_clamp_value", "the clamp of the GLU's halves"),
)

# fields whose unset value in the model's args means the feature is off (this value, where a run may also write it):
# a run that sets one otherwise computes another model (the fix: remove the flag)
OFF_WHEN_UNSET: dict[str, Any] = {"rotary_seq_len_interpolation_factor": None, "moe_router_topk_scaling_factor": 1.0,
                                  "moe_latent_size": None, "moe_router_num_groups": 1}

# the model flags of a run, in the order a launch script lists them: (field, flag); a bool is the flag alone
MODEL_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("group_query_attention", "--group-query-attention"),
    ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("position_embedding_type", "--position-embedding-type"), ("rotary_base", "--rotary-base"),
    ("rotary_percent", "--rotary-percent"), ("use_rope_scaling", "--use-rope-scaling"),
    ("rope_scaling_factor", "--rope-scaling-factor"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor"),
    ("normalization", "--normalization"), ("norm_epsilon", "--norm-epsilon"), ("swiglu", "--swiglu"),
    ("add_bias_linear", "--disable-bias-linear"), ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"), ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("multi_latent_attention", "--multi-latent-attention"), ("q_lora_rank", "--q-lora-rank"),
    ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"), ("v_head_dim", "--v-head-dim"), ("rope_type", "--rope-type"),
    ("rotary_scaling_factor", "--rotary-scaling-factor"), ("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("num_experts", "--num-experts"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_router_topk", "--moe-router-topk"), ("moe_router_score_function", "--moe-router-score-function"),
    ("moe_router_pre_softmax", "--moe-router-pre-softmax"), ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("moe_router_num_groups", "--moe-router-num-groups"), ("moe_router_group_topk", "--moe-router-group-topk"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"), ("moe_router_dtype", "--moe-router-dtype"),
    ("moe_latent_size", "--moe-latent-size"),
    ("mtp_num_layers", "--mtp-num-layers"), ("transformer_impl", "--transformer-impl"),
    # a HybridModel (pretrain_hybrid.py): its layer spec, pattern and Mamba-2 mixers; its squared-ReLU MLP
    ("spec", "--spec"), ("hybrid_layer_pattern", "--hybrid-layer-pattern"), ("mamba_num_heads", "--mamba-num-heads"),
    ("mamba_head_dim", "--mamba-head-dim"), ("mamba_state_dim", "--mamba-state-dim"),
    ("mamba_num_groups", "--mamba-num-groups"), ("squared_relu", "--squared-relu"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"), ("attention_output_gate", "--attention-output-gate"),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate"), ("linear_conv_kernel_dim", "--linear-conv-kernel-dim"),
    ("linear_key_head_dim", "--linear-key-head-dim"), ("linear_value_head_dim", "--linear-value-head-dim"),
    ("linear_num_key_heads", "--linear-num-key-heads"), ("linear_num_value_heads", "--linear-num-value-heads"),
    # YaRN on a GPT model (Megatron-LM main); GPT-OSS's sinks, sliding window and clamped quick GEGLU
    ("yarn_original_max_position_embeddings", "--yarn-original-max-position-embeddings"),
    ("yarn_beta_fast", "--yarn-beta-fast"), ("yarn_beta_slow", "--yarn-beta-slow"),
    ("yarn_correction_range_round_to_int", "--no-yarn-correction-range-round-to-int"),
    ("softmax_type", "--softmax-type"), ("window_size", "--window-size"),
    ("window_attn_skip_freq", "--window-attn-skip-freq"), ("quick_geglu", "--quick-geglu"),
    ("glu_linear_offset", "--glu-linear-offset"), ("activation_func_clamp_value", "--activation-func-clamp-value"),
    ("bf16", "--bf16"), ("fp16", "--fp16"),
)
# fields that mean something only with multi-latent attention (Megatron's args hold their defaults without it), only
# with rotary embeddings, only in a HybridModel: printed only where they do
_MLA_ONLY = frozenset({"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type"})
_YARN = frozenset({"rotary_scaling_factor", "mscale", "mscale_all_dim"})  # MLA's, or a GPT model's YaRN
_GPT_YARN_ONLY = frozenset({"yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                            "yarn_correction_range_round_to_int"})
_ROTARY_ONLY = frozenset({"rotary_base", "rotary_percent", "rotary_seq_len_interpolation_factor"})
_HYBRID_ONLY = frozenset({"spec", "hybrid_layer_pattern", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim",
                          "mamba_num_groups", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                          "linear_num_value_heads", "linear_conv_kernel_dim"})


def _render(field: str, flag: str, value: Any) -> str | None:
    if field == "add_bias_linear":
        return None if value else flag  # --disable-bias-linear
    if field == "yarn_correction_range_round_to_int":
        return None if value in (None, True) else flag  # --no-yarn-correction-range-round-to-int (default: round)
    if field == "softmax_type" and value in (None, "vanilla"):
        return None
    if field == "window_size" and value:
        return f"{flag} " + (value if isinstance(value, str) else ",".join(str(int(v)) for v in value))
    if field == "spec" and isinstance(value, (list, tuple)) and value:
        return f"{flag} " + " ".join(str(v) for v in value)  # (a module and a name: two words)
    if isinstance(value, bool):
        return flag if value else None
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        value = "[" + ",".join(str(v) for v in value) + "]"
    text = str(value)
    return f"{flag} '{text}'" if any(c in text for c in "()[], ") else f"{flag} {text}"


def model_flags(args: Any) -> list[str]:
    """The ``pretrain_gpt.py`` flags that build the model of ``args`` (a Namespace or mapping of Megatron names)."""
    raw = args.get if isinstance(args, dict) else lambda k: getattr(args, k, None)

    def get(field: str) -> Any:  # (a Megatron-LM main checkpoint saves --norm-epsilon as layernorm_epsilon)
        value = raw(field)
        return raw("layernorm_epsilon") if value is None and field == "norm_epsilon" else value

    out = []
    for field, flag in MODEL_FLAGS:
        value = get(field)
        if field in ("use_rope_scaling", "rope_scaling_factor") and not get("use_rope_scaling"):
            continue
        if field.startswith("moe_") and not get("num_experts"):
            continue
        if field == "num_query_groups" and not get("group_query_attention"):
            continue
        if field == "transformer_impl" and not get("multi_latent_attention"):
            continue  # any spec builds the others; MLA is built with Transformer Engine's only
        if field in _MLA_ONLY and not get("multi_latent_attention"):
            continue
        if field in _YARN and not (get("multi_latent_attention") or get("position_embedding_type") == "yarn"):
            continue
        if field in _GPT_YARN_ONLY and (get("multi_latent_attention") or get("position_embedding_type") != "yarn"):
            continue
        if field in _ROTARY_ONLY and get("position_embedding_type") not in ("rope", "yarn", "mrope"):
            continue
        if field in _HYBRID_ONLY and not (get("hybrid_layer_pattern") or get("hybrid_override_pattern")):
            continue
        if field == "hybrid_layer_pattern" and value is None:
            value = get("hybrid_override_pattern")  # (its older name: main takes both)
        rendered = _render(field, flag, value)
        if rendered is not None:
            out.append(rendered)
    return out


def tokenizer_flags(layout: Layout) -> list[str]:
    """The tokenizer flags a run of the checkpoint's model needs. A Hugging Face model: its own tokenizer when its dir
    holds the tokenizer's files, else NullTokenizer with the ``--vocab-size`` that gives the model's embedding rows
    (NullTokenizer adds an end-of-document id: rows - 1). A Megatron checkpoint: the tokenizer it was saved with."""
    saved = layout.saved_args
    if layout.format == Format.HF:
        if getattr(saved, "tokenizer_model", None):
            return ["--tokenizer-type HuggingFaceTokenizer", f"--tokenizer-model {shlex.quote(layout.path)}",
                    *(["--trust-remote-code"] if getattr(saved, "trust_remote_code", False) else [])]
        return ["--tokenizer-type NullTokenizer", f"--vocab-size {int(saved.vocab_size) - 1}"]
    kind = getattr(saved, "tokenizer_type", None)
    if not kind:
        return []
    out = [f"--tokenizer-type {kind}"]
    for field in ("tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(saved, field, None)
        if value:
            out.append(f"--{field.replace('_', '-')} {shlex.quote(str(value))}")
    if kind in ("NullTokenizer", "NullMultimodalTokenizer") and getattr(saved, "vocab_size", None):
        out.append(f"--vocab-size {int(saved.vocab_size)}")
    return out


def _flag_of(field: str) -> str:
    return dict(MODEL_FLAGS).get(field, "--" + field.replace("_", "-"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return str(a) == str(b) if not isinstance(a, bool) else bool(a) == bool(b)


def _moe_layers(saved: Any, freq: Any) -> Any:
    """``--moe-layer-freq`` as the 0/1 per layer Megatron makes of it (the value itself when it cannot be read)."""
    if isinstance(freq, str) and freq.strip().isdigit():
        freq = int(freq)
    layers = reshard.moe_layers(argparse.Namespace(num_layers=getattr(saved, "num_layers", None),
                                                   num_experts=getattr(saved, "num_experts", None),
                                                   moe_layer_freq=freq))
    return [int(m) for m in layers] if layers is not None else freq


def _windowed(saved: Any, freq: Any) -> Any:
    """``--window-attn-skip-freq`` as the 0/1 per layer Megatron makes of it (an int N: every N-th layer full
    attention; None: every layer windowed); the value itself when it is a pattern expression."""
    layers = int(getattr(saved, "num_layers", 0) or 0)
    if freq is None:
        return [1] * layers
    if isinstance(freq, (list, tuple)):
        return [int(x) for x in freq]
    text = str(freq)
    if text.isdigit():
        return [int((i + 1) % int(text) != 0) for i in range(layers)]
    parts = text.split(",")
    return [int(x) for x in parts] if all(x.isdigit() for x in parts) else text


def hf_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """For a Hugging Face source: each model-function flag of the run that differs from the model's (fatal, with the
    flag that fixes it), the run's vocab against the model's rows, and what loads (weights only)."""
    saved = layout.saved_args
    if saved is None:
        return []
    arch = getattr(saved, "hf_architecture", "the model")
    out = [Finding("hf_model", arch, "load", INFO,
                   "a Hugging Face model: Megatron-LM alone would not load it (it warns 'could not find the metadata "
                   "file' and trains from random weights); megatron-preflight builds each rank's weights from the "
                   "safetensors, as a release checkpoint: iteration 0, no optimizer or RNG state", "")]
    if getattr(saved, "rope_type", None) == "yarn":
        out.append(Finding("rope_type", "yarn", rt.rope_type, INFO,
                           "YaRN RoPE as Megatron's multi-latent attention applies it (the factor and both attention "
                           "scales from config.json; its original context 4,096 and betas 32 / 1 are Megatron's "
                           "fixed values): mapped, not measured against transformers here (Megatron's YaRN embedding "
                           "needs an accelerator)", ""))
    moe = bool(getattr(saved, "num_experts", None))
    for field, what in FUNCTION_FIELDS:
        ck = getattr(saved, field, None)
        if field.startswith("moe_") and not moe:
            continue
        if field == "rope_scaling_factor" and not getattr(saved, "use_rope_scaling", False):
            continue
        run = getattr(rt, field, None)
        if ck is None and (field not in OFF_WHEN_UNSET or run is None or _same(OFF_WHEN_UNSET[field], run)):
            continue
        if field == "moe_layer_freq":  # compared as the layers it makes MoE layers
            ck, run = _moe_layers(saved, ck), _moe_layers(saved, 1 if run is None else run)
        if field == "window_attn_skip_freq":  # compared as the layers it makes windowed
            ck, run = _windowed(saved, ck), _windowed(saved, run)
        if field == "window_size" and ck is not None:
            ck = ",".join(str(int(v)) for v in ck)
        if ck is None and run is None:
            continue
        if not _same(ck, run):
            fix = _render(field, _flag_of(field), ck)
            fix = f"set {fix}" if fix else f"remove {_flag_of(field)}"
            out.append(Finding(field, ck, run, FATAL, f"{what} differs from the Hugging Face model's "
                               f"({arch}): model {ck}, run {run}; the weights would load and compute another model",
                               fix))
    if getattr(saved, "multi_latent_attention", False) and rt.transformer_impl == "local":
        out.append(Finding("transformer_impl", "transformer_engine", "local", FATAL,
                           "Megatron builds multi-latent attention with the Transformer Engine spec only",
                           "set --transformer-impl transformer_engine"))
    rows = getattr(saved, "vocab_size", None)
    ids = rt.tokenizer_ids() if rt.vocab_size else None  # (NullTokenizer's end-of-document id where it adds one)
    if ids and rows and ids > rows:
        out.append(Finding("vocab_size", rows, ids, FATAL,
                           f"the run's tokenizer has {ids} token ids, the model's embedding {rows} rows",
                           "use the flags `megatron-preflight flags` prints for it: "
                           + " ".join(tokenizer_flags(layout))))
    elif rt.padded_vocab_size and rows and rt.padded_vocab_size != rows:
        out.append(Finding("padded_vocab_size", rows, rt.padded_vocab_size, INFO,
                           f"the run pads its vocab to {rt.padded_vocab_size} rows, the model has {rows}: "
                           + (f"rows from {rt.padded_vocab_size} on are ids the run's tokenizer never produces "
                              "(dropped)" if rt.padded_vocab_size < rows else
                              f"rows {rows}..{rt.padded_vocab_size - 1} are zero padding; their logits enter the "
                              "softmax, so the loss differs a little from the model's own"),
                           "" if rt.padded_vocab_size < rows else
                           "set --make-vocab-size-divisible-by to a divisor of the model's rows over TP to keep "
                           "the model's function exactly"))
    return out
