"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK norm), MoE layers every ``decoder_sparse_step``-th
but those in ``mlp_only_layers``, a softmax router: over the top-k renormalised with ``norm_topk_prob``, else over
all experts before the top-k (Megatron's ``--moe-router-pre-softmax``)."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import REQUIRED, HfConfig, Key
from megatron_preflight.layout.hf.families.rows import Moe
from megatron_preflight.layout.hf.families.spec import Family, softmax_moe, table, traits


def _args(cfg: HfConfig) -> dict:
    return {"moe_router_pre_softmax": not cfg.norm_topk_prob} if cfg.moe else {}


FAMILY = Family(
    "qwen3_moe", ("Qwen3MoeForCausalLM",),
    keys=table(Key("attention_bias", "attention_bias", False), Key("num_experts", "num_experts", REQUIRED, ("num_local_experts",)),
               Key("num_experts_per_tok", "experts_per_token", 8),
               Key("moe_intermediate_size", "moe_intermediate_size", REQUIRED),
               Key("norm_topk_prob", "norm_topk_prob", False), Key("decoder_sparse_step", "decoder_sparse_step", 1),
               Key("mlp_only_layers", "mlp_only_layers", ()), Key("sliding_window", "sliding_window", None)),
    qkv_bias="config", qk_norm="always", moe=Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj")), args=_args,
    json=lambda cfg: {"use_sliding_window": False, "router_aux_loss_coef": 0.0},
    expresses=lambda args: (lambda t: softmax_moe(t) and t.qk_norm)(traits(args)), rank=4,
)
