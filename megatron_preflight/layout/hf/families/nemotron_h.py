"""NemotronH (``NemotronHForCausalLM``, Nemotron-H and Nemotron 3): a hybrid of Mamba-2 mixers (``M``), attention
without positional embedding (``*``), squared-ReLU MLPs (``-``) and MoE layers (``E``), one pre-norm per layer, as
Megatron's HybridModel builds it (``pretrain_hybrid.py``, the Transformer Engine hybrid stack spec: each layer's norm
fused into its first linear, a MoE layer's its own ``pre_mlp_layernorm``).

The layer pattern comes from ``hybrid_override_pattern`` (the hub) or ``layers_block_type`` (transformers 5). A Mamba
mixer's ``in_proj`` rows are ``[z, x, B, C, dt]`` and its ``conv1d`` channels ``[x, B, C]`` in both, its gated norm
normalises groups of ``d_inner / n_groups`` after the gate in both. A MoE layer: a sigmoid router in fp32 with its
expert bias (``e_score_correction_bias``), expert groups and a scaling factor (DeepSeek-V3's); squared-ReLU experts
without a gate, one by one in the files, Transformer Engine's grouped linears in Megatron's; shared experts beside
them; with ``moe_latent_size`` (Nemotron 3 Super) the experts compute in the latent width between
``fc1_latent_proj`` and ``fc2_latent_proj`` (Megatron's ``--moe-latent-size``). A Mamba convolution other than
Megatron's 4 taps is refused; the files' MTP layers (``mtp.``) are not loaded, said in a note."""

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
        elif kind == "E":
            out += _moe(r, cfg, mix, mg, norm)
    return out + hybrid_tail(r, cfg, "backbone.norm_f.weight")


def _moe(r: Rows, cfg: HfConfig, mix: str, mg: str, norm: str) -> list[Mapping]:
    """A MoE layer under the hybrid stack spec's names: its norm, the router and its expert bias, the latent
    projections (where the model has them), the experts as Transformer Engine's grouped linears (the hybrid layer
    specs build no other), the shared experts; each Transformer Engine module's extra state."""
    m = mg + "mlp."
    out = [r.copy(mg + "pre_mlp_layernorm.weight", norm), r.extra(mg + "pre_mlp_layernorm._extra_state"),
           r.copy(m + "router.weight", mix + "gate.weight"),
           r.copy(m + "router.expert_bias", mix + "gate.e_score_correction_bias")]
    if cfg.moe_latent:
        for proj in ("fc1_latent_proj", "fc2_latent_proj"):
            out += [r.copy(f"{m}{proj}.weight", f"{mix}{proj}.weight"), r.extra(f"{m}{proj}._extra_state")]
    for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
        out += [r.copy(f"{m}experts.{fc}.weight{j}", f"{mix}experts.{j}.{proj}.weight")
                for j in range(cfg.num_experts or 0)]
        out.append(r.extra(f"{m}experts.{fc}._extra_state"))
    for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
        out += [r.copy(f"{m}shared_experts.{fc}.weight", f"{mix}shared_experts.{proj}.weight"),
                r.extra(f"{m}shared_experts.{fc}._extra_state")]
    return out


def _args(cfg: HfConfig) -> dict[str, Any]:
    out = {"hybrid_layer_pattern": cfg.hybrid_pattern, "is_hybrid_model": True, "spec": list(HYBRID_SPEC),
           "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": cfg.mamba_head_dim,
           "mamba_state_dim": cfg.mamba_state, "mamba_num_groups": cfg.mamba_groups,
           "position_embedding_type": "none", "rotary_base": None, "rotary_percent": None, "swiglu": False,
           "squared_relu": True}
    if cfg.moe:  # (the pattern places the MoE layers; the shared experts have their own size)
        out.update(moe_layer_freq=1, moe_shared_expert_intermediate_size=cfg.shared_expert_size or None)
        if cfg.moe_latent:
            out["moe_latent_size"] = cfg.moe_latent
    return out


def _back(values: dict[str, Any], args: Any) -> dict[str, Any]:
    values.update(shared_expert_size=arg(args, "moe_shared_expert_intermediate_size"), shared_experts=0)
    if "E" not in hybrid_layers(hybrid_pattern(args) or ""):  # (no MoE layer: its fields are written as _json says)
        values.update({k.field: None for k in MOE_KEYS})
    return values


def _refuse(cfg: HfConfig) -> list[str]:
    out = []
    if cfg.moe and not cfg.shared_expert_size:
        out.append("MoE layers without shared experts (moe_shared_expert_intermediate_size 0: NemotronH's MoE layer "
                   "always runs them)")
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


# what NemotronH's config class holds for its MTP layers (whose weights are not loaded), how it overlaps the shared
# experts' compute, and its initialisation: read for nothing here
INERT = frozenset({"n_shared_experts", "moe_shared_expert_overlap", "mtp_layers_block_type",
                   "num_nextn_predict_layers", "time_step_limit", "time_step_min", "time_step_max", "time_step_floor",
                   "rescale_prenorm_residual", "residual_in_fp32", "mamba_ssm_cache_dtype", "use_mamba_kernels",
                   "num_logits_to_keep", "chunk_size", "expand", "mamba_proj_bias", "use_bias", "use_conv_bias",
                   "mamba_hidden_act", "sliding_window"})


def _expresses(args: Any) -> bool:
    t = traits(args)
    pattern = hybrid_layers(hybrid_pattern(args) or "")  # (its layers: the pipeline cuts and MTP depths aside)
    moe = "E" in pattern
    return t.hybrid and not t.gated and bool(arg(args, "squared_relu", False)) and set(pattern) <= set("M*-E") \
        and (not moe or (t.moe and t.sigmoid and t.expert_bias and t.shared
                         and not arg(args, "moe_shared_expert_gate", False))) \
        and not (t.mla or t.mtp or t.zero_centred)


# its MoE layers' config rows (transformers' NemotronHConfig defaults; its typed fields refuse a null)
MOE_KEYS = (Key("n_routed_experts", "num_experts", 8, ("num_local_experts",)),
            Key("num_experts_per_tok", "experts_per_token", 2),
            Key("moe_intermediate_size", "moe_intermediate_size", 7688),
            Key("moe_shared_expert_intermediate_size", "shared_expert_size", 7688),
            Key("moe_latent_size", "moe_latent", None), Key("n_group", "n_group", 1),
            Key("topk_group", "topk_group", 1), Key("routed_scaling_factor", "routed_scaling_factor", 1.0),
            Key("norm_topk_prob", "norm_topk_prob", True))


def _json(cfg: HfConfig) -> dict[str, Any]:
    """A model without MoE layers (its args name no experts) written with transformers' defaults for their fields,
    which it reads for nothing (a null there is refused by its config class)."""
    return {k.hf: k.default for k in MOE_KEYS if k.default is not None and getattr(cfg, k.field) is None}


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
               Key("conv_kernel", "mamba_conv", CONV), *MOE_KEYS),
    fixed={"scoring_func": "sigmoid"}, json=_json,
    qkv_bias="never", acts=("relu2",), args=_args, tensors=_tensors, refuse=_refuse, impl="transformer_engine",
    inert=INERT, expresses=_expresses, back=_back, unloaded=("mtp.",), rank=7,
)
