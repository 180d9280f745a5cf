"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): grouped-query attention with a QKV bias (``attention_bias``) and an
optional per-head QK norm (``use_qk_norm``), RoPE on part of each head (``partial_rotary_factor``, 0.5: Megatron's
``--rotary-percent``, rotating halves as transformers does), dense first layers (``first_k_dense_replace``), routed
experts with DeepSeek-V3's router (sigmoid scores, the expert bias ``e_score_correction_bias`` for the choice only,
groups, top-k renormalised, a routed scaling factor), shared experts, multi-token prediction layers stored after the
decoder's. Megatron builds all of it with the local spec (no Transformer Engine needed).

The worked example of docs/hf.md "adding a family": this module is all a family is."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import REQUIRED, Key
from megatron_preflight.layout.hf.families.rows import Moe
from megatron_preflight.layout.hf.families.spec import Family, gpt, table, traits

FAMILY = Family(
    "glm4_moe", ("Glm4MoeForCausalLM",),
    # transformers' Glm4MoeConfig defaults, where config.json may leave a field out
    keys=table(Key("rms_norm_eps", "norm_eps", 1e-5), Key("attention_bias", "attention_bias", False),
               Key("use_qk_norm", "qk_norm", False), Key("partial_rotary_factor", "rotary_percent", 0.5),
               Key("n_routed_experts", "num_experts", REQUIRED), Key("num_experts_per_tok", "experts_per_token", 8),
               Key("moe_intermediate_size", "moe_intermediate_size", REQUIRED),
               Key("n_shared_experts", "shared_experts", 1), Key("first_k_dense_replace", "first_k_dense", 1),
               Key("n_group", "n_group", 1), Key("topk_group", "topk_group", 1),
               Key("routed_scaling_factor", "routed_scaling_factor", 1.0),
               Key("norm_topk_prob", "norm_topk_prob", True), Key("num_nextn_predict_layers", "mtp_layers", 1)),
    qkv_bias="config", qk_norm="config", moe=Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    fixed={"scoring_func": "sigmoid"},  # (its router is sigmoid by definition: no config key says so)
    expresses=lambda args: (lambda t: gpt(t) and not t.mla and t.moe and t.sigmoid and t.expert_bias)(traits(args)), rank=6,
)
