"""Mixtral (``MixtralForCausalLM``): Mistral's attention, every layer a MoE of ``w1`` / ``w3`` / ``w2`` experts under
``block_sparse_moe`` with a softmax router whose top-k probabilities are renormalised (Megatron's default: softmax
over the top-k logits)."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import REQUIRED, Key
from megatron_preflight.layout.hf.families.rows import Moe
from megatron_preflight.layout.hf.families.spec import Family, softmax_moe, table, traits

FAMILY = Family(
    "mixtral", ("MixtralForCausalLM",),
    keys=table(Key("rms_norm_eps", "norm_eps", 1e-5), Key("rope_theta", "rope_theta", 1e6),
               Key("num_local_experts", "num_experts", REQUIRED),
               Key("num_experts_per_tok", "experts_per_token", 2), Key("sliding_window", "sliding_window", None)),
    qkv_bias="never", moe=Moe("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    json=lambda cfg: {"router_aux_loss_coef": 0.0, "output_router_logits": False},
    expresses=lambda args: (lambda t: softmax_moe(t) and not (t.qk_norm or t.qkv_bias or t.pre_softmax))(
        traits(args)), rank=3,
)
