"""Qwen3.5-MoE and Qwen3.5 (``Qwen3_5MoeForCausalLM``, ``Qwen3_5ForCausalLM``, the text models; two families here): Qwen3-Next's architecture (:mod:`.qwen_hybrid`: gated delta
nets beside gated attention, zero-centred norms, MoE layers with a gated shared expert) with its gated delta nets'
input projections stored section by section — ``in_proj_qkv`` ``[q, k, v]`` (all heads of each), ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` — which are Megatron's ``in_proj`` rows ``[q, k, v, z, b, a]`` as they are; every layer
a MoE layer whose top-k probabilities are always renormalised (the dense models: every layer a dense MLP). The hub
publishes Qwen3.5 (and Qwen3.6, the same classes) as the vision-language model (``Qwen3_5MoeForConditionalGeneration``,
``Qwen3_5ForConditionalGeneration``): its language model is read (the tensors under ``model.language_model.``, the
config's ``text_config``), its vision encoder (``model.visual.``) is not loaded, said in a note."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout.hf.config import HfConfig, Key
from megatron_preflight.layout.hf.families import qwen_hybrid as qh
from megatron_preflight.layout.hf.families.rows import stack
from megatron_preflight.layout.hf.families.spec import Family, Wrapper
from megatron_preflight.layout.hf.stacked import Stacked

# the experts as the hub's Qwen3.5-MoE files may hold them, stacked per layer in transformers' own layout
# (gate_up_proj [E, 2I, H]: each expert's gate rows then its up rows; down_proj [E, H, I]); transformers saves them
# one by one, and so does an export
STACKED = (Stacked("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), written=False),
           Stacked("mlp.experts.down_proj", ("down_proj.weight",), written=False))


def _gdn_in_proj(la: str, cfg: HfConfig) -> Any:
    nk, nv = cfg.linear_num_key_heads or 1, cfg.linear_num_value_heads or 1
    dk, dv = cfg.linear_key_head_dim or 0, cfg.linear_value_head_dim or 0
    return stack([(la + "in_proj_qkv.weight", 0, 2 * nk * dk + nv * dv), (la + "in_proj_z.weight", 0, nv * dv),
                  (la + "in_proj_b.weight", 0, nv), (la + "in_proj_a.weight", 0, nv)])


def _args(cfg: HfConfig) -> dict[str, Any]:
    # (no dense layer: the FFN size Megatron is given is the experts')
    return {**qh.args(cfg), "ffn_hidden_size": cfg.intermediate_size or cfg.moe_intermediate_size}


MOE_FAMILY = Family(
    "qwen3_5_moe", ("Qwen3_5MoeForCausalLM",), model_types={"Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"},
    # transformers' Qwen3_5MoeTextConfig defaults, where config.json may leave a field out
    keys=qh.keys(Key("rms_norm_eps", "norm_eps", 1e-6), Key("intermediate_size", "intermediate_size", 0),
                 Key("num_experts", "num_experts", 256, ("num_local_experts",)),
                 Key("num_experts_per_tok", "experts_per_token", 8),
                 Key("moe_intermediate_size", "moe_intermediate_size", 512),
                 Key("shared_expert_intermediate_size", "shared_expert_size", 512), sparse=False),
    fixed={"norm_topk_prob": True},
    qkv_bias="never", qk_norm="always", moe=qh.MOE, args=_args, tensors=qh.tensors(_gdn_in_proj), refuse=qh.refuse,
    impl="transformer_engine", inert=frozenset({"router_aux_loss_coef", "output_router_logits"}),
    unloaded=("mtp.",), back=qh.back, expresses=qh.expresses, rank=9,
    wrappers=(Wrapper("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),), stacked=STACKED,
)

DENSE_FAMILY = Family(
    "qwen3_5", ("Qwen3_5ForCausalLM",), model_types={"Qwen3_5ForCausalLM": "qwen3_5_text"},
    # transformers' Qwen3_5TextConfig defaults, where config.json may leave a field out (no experts)
    keys=qh.keys(Key("rms_norm_eps", "norm_eps", 1e-6), sparse=False, experts=False),
    qkv_bias="never", qk_norm="always", moe=qh.MOE, args=qh.args, tensors=qh.tensors(_gdn_in_proj),
    refuse=qh.refuse, impl="transformer_engine", unloaded=("mtp.",), back=qh.back,
    expresses=lambda args: qh.expresses(args, dense=True), rank=9,
    wrappers=(Wrapper("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),),
)
FAMILIES = (MOE_FAMILY, DENSE_FAMILY)
