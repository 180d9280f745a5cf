"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's layers with a bias on q, k and v always."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import Key
from megatron_preflight.layout.hf.families.spec import Family, plain_dense, table, traits

FAMILY = Family(
    "qwen2", ("Qwen2ForCausalLM",), keys=table(Key("sliding_window", "sliding_window", None)), qkv_bias="always",
    json=lambda cfg: {"use_sliding_window": False},
    expresses=lambda args: (lambda t: plain_dense(t) and not t.qk_norm and t.qkv_bias)(traits(args)), rank=1,
)
