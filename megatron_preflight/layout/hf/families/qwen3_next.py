"""Qwen3-Next (``Qwen3NextForCausalLM``): gated delta net layers (``linear_attention``) beside gated attention
(``full_attention``, a sigmoid gate on each head's output, QK norm, RoPE on a quarter of each head), every norm
zero-centred (``1 + w``), MoE layers with a softmax router and one shared expert behind a sigmoid gate. Megatron builds
it as a HybridModel (``pretrain_hybrid.py``, the Transformer Engine hybrid stack spec): each HF layer is two Megatron
layers, its mixer (``G`` or ``*``) then its MLP (``E``, or ``-`` for the ``mlp_only_layers``), with
``--apply-layernorm-1p``, ``--attention-output-gate`` and ``--moe-shared-expert-gate``.

Rows: the attention's fused QKV per query group is ``[q heads, their gates, k, v]`` (HF keeps each head's query and
gate side by side in ``q_proj``); a gated delta net's ``in_proj`` is ``[q, k, v, z, b, a]`` section by section (HF
keeps them per key-head group in ``in_proj_qkvz`` and ``in_proj_ba``). The gated delta net's output norm is the one
norm HF does not zero-centre, where Megatron's (a TENorm under ``--apply-layernorm-1p``) is: read as ``w - 1``.

The multi-token prediction weights the hub's files carry (``mtp.*``) are not loaded (said; Megatron's hybrid MTP for
it is not mapped here). An export writes the model back in transformers' layout (the norm's ``w - 1`` undone)."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout.hf.config import HfConfig
from megatron_preflight.layout.hf.families import qwen_hybrid as qh
from megatron_preflight.layout.hf.families.rows import stack
from megatron_preflight.layout.hf.families.spec import Family


def _gdn_in_proj(la: str, cfg: HfConfig) -> Any:
    nk, nv = cfg.linear_num_key_heads or 1, cfg.linear_num_value_heads or 1
    dk, dv = cfg.linear_key_head_dim or 0, cfg.linear_value_head_dim or 0
    r = nv // nk
    width = 2 * dk + 2 * dv * r
    qkvz, ba = la + "in_proj_qkvz.weight", la + "in_proj_ba.weight"
    parts = [(qkvz, g * width, dk) for g in range(nk)] + [(qkvz, g * width + dk, dk) for g in range(nk)]
    parts += [(qkvz, g * width + 2 * dk, dv * r) for g in range(nk)]
    parts += [(qkvz, g * width + 2 * dk + dv * r, dv * r) for g in range(nk)]
    parts += [(ba, g * 2 * r, r) for g in range(nk)] + [(ba, g * 2 * r + r, r) for g in range(nk)]
    return stack(parts)


FAMILY = Family(
    "qwen3_next", ("Qwen3NextForCausalLM",), keys=qh.keys(),
    qkv_bias="never", qk_norm="always", moe=qh.MOE, args=qh.args, tensors=qh.tensors(_gdn_in_proj), refuse=qh.refuse,
    impl="transformer_engine", inert=frozenset({"full_attention_interval", "num_nextn_predict_layers"}),
    unloaded=("mtp.",), back=qh.back, expresses=qh.expresses, rank=8,
)
