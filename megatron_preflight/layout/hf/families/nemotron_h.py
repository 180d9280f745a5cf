"""NemotronH (``NemotronHForCausalLM``): a hybrid of Mamba-2 mixers (``M``), attention without positional embedding
(``*``) and squared-ReLU MLPs (``-``), one pre-norm per layer, as Megatron's HybridModel builds it
(``pretrain_hybrid.py``, the Transformer Engine hybrid stack spec: each layer's norm fused into its first linear).

The layer pattern comes from ``hybrid_override_pattern`` (the hub) or ``layers_block_type`` (transformers 5). A Mamba
mixer's ``in_proj`` rows are ``[z, x, B, C, dt]`` and its ``conv1d`` channels ``[x, B, C]`` in both, its gated norm
normalises groups of ``d_inner / n_groups`` after the gate in both. NemotronH's MoE layers (``E``: Nemotron 3, with a
latent projection) are refused, as is a Mamba convolution other than Megatron's 4 taps."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout.hf.config import REQUIRED, HfConfig, Key
from megatron_preflight.layout.hf.families.rows import Mapping, Rows, hybrid_tail, qkv, te_mlp
from megatron_preflight.layout.hf.families.spec import HYBRID_SPEC, Family, arg, table, traits
from megatron_preflight.parallel import hybrid_layers, hybrid_pattern

CONV = 4  # Megatron's Mamba mixer convolves over 4 positions (no flag sets another)


def _tensors(r: Rows, cfg: HfConfig) -> list[Mapping]:
    """The HybridModel's tensors under the Transformer Engine hybrid stack spec's names, layer by layer."""
    out = [r.copy("embedding.word_embeddings.weight", "backbone.embeddings.weight")]
    for i, kind in enumerate(cfg.hybrid_pattern or ""):
        hf, mg = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        mix, norm = hf + "mixer.", hf + "norm.weight"
        if kind == "M":
            out += [r.copy(mg + "mixer.conv1d_weight", mix + "conv1d.weight"),
                    r.copy(mg + "mixer.conv1d_bias", mix + "conv1d.bias"),
                    r.copy(mg + "mixer.dt_bias", mix + "dt_bias"), r.copy(mg + "mixer.A_log", mix + "A_log"),
                    r.copy(mg + "mixer.D", mix + "D"), r.copy(mg + "mixer.in_proj.layer_norm_weight", norm),
                    r.copy(mg + "mixer.in_proj.weight", mix + "in_proj.weight"),
                    r.extra(mg + "mixer.in_proj._extra_state"), r.copy(mg + "mixer.norm.weight", mix + "norm.weight"),
                    r.copy(mg + "mixer.out_proj.weight", mix + "out_proj.weight"),
                    r.extra(mg + "mixer.out_proj._extra_state")]
        elif kind == "*":
            out += [r.extra(mg + "self_attention.core_attention._extra_state"),
                    r.copy(mg + "self_attention.linear_proj.weight", mix + "o_proj.weight"),
                    r.extra(mg + "self_attention.linear_proj._extra_state"),
                    r.copy(mg + "self_attention.linear_qkv.layer_norm_weight", norm),
                    Mapping(mg + "self_attention.linear_qkv.weight", qkv(mix, "weight", cfg)),
                    r.extra(mg + "self_attention.linear_qkv._extra_state")]
        elif kind == "-":
            out += te_mlp(r, mg, norm, r.copy(mg + "mlp.linear_fc1.weight", mix + "up_proj.weight"),
                          mix + "down_proj.weight")
    return out + hybrid_tail(r, cfg, "backbone.norm_f.weight")


def _args(cfg: HfConfig) -> dict[str, Any]:
    return {"hybrid_layer_pattern": cfg.hybrid_pattern, "is_hybrid_model": True, "spec": list(HYBRID_SPEC),
            "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": cfg.mamba_head_dim,
            "mamba_state_dim": cfg.mamba_state, "mamba_num_groups": cfg.mamba_groups,
            "position_embedding_type": "none", "rotary_base": None, "rotary_percent": None, "swiglu": False,
            "squared_relu": True}


def _refuse(cfg: HfConfig) -> list[str]:
    out = []
    if "E" in (cfg.hybrid_pattern or ""):
        out.append("MoE layers (E in the layer pattern: Nemotron 3's latent experts are not mapped here)")
    if cfg.mamba_conv not in (None, CONV):
        out.append(f"conv_kernel {cfg.mamba_conv} (Megatron's Mamba mixer convolves over {CONV} positions)")
    for key, neutral in (("mamba_proj_bias", False), ("use_bias", False), ("use_conv_bias", True),
                         ("mamba_hidden_act", "silu")):
        value = cfg.raw.get(key, neutral)
        if value != neutral:
            out.append(f"config.json's {key} = {value!r} (Megatron's Mamba mixer has {neutral!r})")
    limit = cfg.raw.get("time_step_limit")
    if limit is not None and [float(x) if isinstance(x, (int, float)) else x for x in limit] not in (
            [0.0, float("inf")], [0.0, {"__float__": "Infinity"}]):
        out.append(f"config.json's time_step_limit = {limit!r} (Megatron's Mamba mixer clamps dt to (0, inf))")
    return out


# what NemotronH's config class holds for its MoE layers (refused above when the pattern has any), its MTP layers
# and its initialisation: read for nothing here
INERT = frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_overlap", "n_group",
                   "topk_group", "routed_scaling_factor", "norm_topk_prob", "mtp_layers_block_type",
                   "num_nextn_predict_layers", "time_step_limit", "time_step_min", "time_step_max", "time_step_floor",
                   "rescale_prenorm_residual", "residual_in_fp32", "mamba_ssm_cache_dtype", "use_mamba_kernels",
                   "num_logits_to_keep", "chunk_size", "expand", "mamba_proj_bias", "use_bias", "use_conv_bias",
                   "mamba_hidden_act", "sliding_window"})


def _expresses(args: Any) -> bool:
    t = traits(args)
    pattern = hybrid_layers(hybrid_pattern(args) or "")  # (its layers: the pipeline cuts and MTP depths aside)
    return t.hybrid and not t.gated and bool(arg(args, "squared_relu", False)) and set(pattern) <= set("M*-") \
        and not (t.moe or t.mla or t.mtp or t.zero_centred)


FAMILY = Family(
    "nemotron_h", ("NemotronHForCausalLM",),
    # (transformers 5 writes no num_hidden_layers: the pattern's length)
    keys=table(Key("num_hidden_layers", "num_layers", None), Key("layer_norm_epsilon", "norm_eps", 1e-5),
               # (the hub's configs name the attention head dim attention_head_dim)
               Key("head_dim", "head_dim", None, ("attention_head_dim",)), Key("mlp_hidden_act", "hidden_act", "relu2"),
               Key("attention_bias", "attention_bias", False), Key("mlp_bias", "mlp_bias", False),
               Key("hybrid_override_pattern", "hybrid_pattern", REQUIRED, ("layers_block_type",)),
               Key("mamba_num_heads", "mamba_heads", REQUIRED), Key("mamba_head_dim", "mamba_head_dim", REQUIRED),
               Key("ssm_state_size", "mamba_state", REQUIRED), Key("n_groups", "mamba_groups", REQUIRED),
               Key("conv_kernel", "mamba_conv", CONV)),
    qkv_bias="never", acts=("relu2",), args=_args, tensors=_tensors, refuse=_refuse, impl="transformer_engine",
    inert=INERT, expresses=_expresses, rank=7,
)
