"""Qwen3 (``Qwen3ForCausalLM``): Llama's layers with a per-head RMSNorm of q and k, an explicit head dim, a QKV bias
only with ``attention_bias``."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import Key
from megatron_preflight.layout.hf.families.spec import Family, plain_dense, table, traits

FAMILY = Family(
    "qwen3", ("Qwen3ForCausalLM",),
    keys=table(Key("attention_bias", "attention_bias", False), Key("sliding_window", "sliding_window", None)),
    qkv_bias="config", qk_norm="always", json=lambda cfg: {"use_sliding_window": False},
    expresses=lambda args: (lambda t: plain_dense(t) and t.qk_norm and not t.qkv_bias)(traits(args)), rank=2,
)
