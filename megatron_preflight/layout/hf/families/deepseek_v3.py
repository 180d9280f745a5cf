"""DeepSeek-V3 / V3.1 / R1 and Kimi K2 (``DeepseekV3ForCausalLM``; Kimi K2 under ``model_type: kimi_k2`` with its own
code in ``auto_map``; Kimi K2.5 / K2.6 the language model of ``KimiK25ForConditionalGeneration``): multi-latent
attention (q and kv low rank, rotary rows interleaved unless ``rope_interleave: false``), dense first layers, routed
experts with a sigmoid router, its expert bias and groups, a routed scaling factor, shared experts, multi-token
prediction layers stored after the decoder's. Megatron builds MLA with the Transformer Engine spec only."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import REQUIRED, Key
from megatron_preflight.layout.hf.families.rows import Moe
from megatron_preflight.layout.hf.families.spec import Family, Wrapper, gpt, table, traits

FAMILY = Family(
    "deepseek_v3", ("DeepseekV3ForCausalLM",),
    keys=table(Key("n_routed_experts", "num_experts", REQUIRED), Key("num_experts_per_tok", "experts_per_token", 8),
               Key("moe_intermediate_size", "moe_intermediate_size", REQUIRED),
               Key("n_shared_experts", "shared_experts", 1), Key("first_k_dense_replace", "first_k_dense", 3),
               Key("n_group", "n_group", 8), Key("topk_group", "topk_group", 4),
               Key("routed_scaling_factor", "routed_scaling_factor", 2.5),
               Key("norm_topk_prob", "norm_topk_prob", True), Key("scoring_func", "scoring_func", "sigmoid"),
               # (a null q_lora_rank: q is projected at full rank, as DeepSeek-V2-Lite does)
               Key("q_lora_rank", "q_lora_rank", None), Key("kv_lora_rank", "kv_lora_rank", REQUIRED),
               Key("qk_nope_head_dim", "qk_nope_head_dim", REQUIRED),
               Key("qk_rope_head_dim", "qk_rope_head_dim", REQUIRED), Key("v_head_dim", "v_head_dim", REQUIRED),
               # transformers' default: the hub's config.json does not say, and its rows are interleaved
               Key("rope_interleave", "rope_interleave", True),
               Key("num_nextn_predict_layers", "mtp_layers", 0),
               # (transformers' head_dim of DeepSeek-V3 is the rotary dim: never written back, never read)
               without=("head_dim",)),
    attention="mla", qkv_bias="never", moe=Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    json=lambda cfg: {"topk_method": "noaux_tc"},
    expresses=lambda args: (lambda t: gpt(t) and t.mla and t.moe and t.sigmoid and t.expert_bias)(traits(args)), rank=5,
    # Kimi K2.5 / K2.6 as Moonshot publishes them: Kimi K2's DeepseekV3ForCausalLM under language_model. beside a
    # vision tower (its routed experts INT4, compressed-tensors pack-quantized: layout/hf/quant.py)
    wrappers=(Wrapper("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", prefix="language_model.model.",
                      head="language_model.lm_head.", others=("vision_tower.", "mm_projector."),
                      what="vision encoder", text_reads=False),),
)
