"""Llama and Mistral (``LlamaForCausalLM``, ``MistralForCausalLM``): grouped-query attention, SwiGLU, RMSNorm,
untied or tied head; a QKV bias only with ``attention_bias``, which Llama gives ``o_proj`` too."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import HfConfig, Key
from megatron_preflight.layout.hf.families.spec import Family, plain_dense, table, traits


def _refuse(cfg: HfConfig) -> list[str]:
    if cfg.attention_bias:
        return ["attention_bias: Llama's o_proj bias has no Megatron counterpart without every linear's bias"]
    return []


FAMILY = Family(
    "llama", ("LlamaForCausalLM", "MistralForCausalLM"),
    keys=table(Key("attention_bias", "attention_bias", False), Key("mlp_bias", "mlp_bias", False),
               Key("sliding_window", "sliding_window", None)),
    qkv_bias="config", model_types={"MistralForCausalLM": "mistral"}, refuse=_refuse,
    expresses=lambda args: (lambda t: plain_dense(t) and not t.qk_norm and not t.qkv_bias)(traits(args)), rank=0,
)
