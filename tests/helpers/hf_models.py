"""Tiny random Hugging Face models written by ``transformers`` (the oracle), and megatron-core GPT models built from
the Megatron args megatron-preflight derives for them (test-only).

``transformers`` is a test dependency: the package reads safetensors headers itself and never imports it."""

from __future__ import annotations

import os
from typing import Any

import torch

SEQ = 16
# every family: 2 layers, GQA (4 heads over 2 groups), 96-token vocab (128 at TP2 after Megatron's padding would
# change the softmax: 128 keeps it unpadded at TP1 and TP2)
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.25)


def configs() -> dict[str, Any]:
    import transformers as T

    return {
        "llama": T.LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
        "mistral": T.MistralConfig(**COMMON, tie_word_embeddings=False),
        "qwen2": T.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": T.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False),
        "mixtral": T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      norm_topk_prob=True, tie_word_embeddings=False),
        # MLA (q and kv low rank, interleaved rotary rows), a dense first layer, 8 routed experts in 2 groups with a
        # sigmoid router and its bias, a shared expert, a routed scaling factor
        "deepseek_v3": T.DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                          moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=8,
                                          num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                                          routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                                          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                          tie_word_embeddings=False, rope_scaling=None),
        # GLM-4.5: QKV bias, QK norm, RoPE on half of each head, a dense first layer, 8 routed experts in 2 groups
        # with a sigmoid router and its bias, a shared expert, a routed scaling factor
        "glm4_moe": T.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, moe_intermediate_size=16,
                                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                    attention_bias=True, use_qk_norm=True, tie_word_embeddings=False),
        # NemotronH: Mamba-2 (4 heads of 16 in 2 groups, state 16), attention without RoPE, a squared-ReLU MLP
        "nemotron_h": T.NemotronHConfig(**{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
                                        hybrid_override_pattern="M*M-", head_dim=8, mamba_num_heads=4,
                                        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                        chunk_size=8, tie_word_embeddings=False),
        # NemotronH with MoE layers (Nemotron 3): Mamba-2, MoE, attention, MoE; 8 squared-ReLU experts in 2 groups
        # behind a sigmoid router with its expert bias and a scaling factor, shared experts of their own size
        "nemotron_h_moe": T.NemotronHConfig(**{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
                                            hybrid_override_pattern="ME*E", head_dim=8, mamba_num_heads=4,
                                            mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                            chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                                            n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                            tie_word_embeddings=False),
        # ... and its experts computing in a latent width (Nemotron 3 Super's moe_latent_size)
        "nemotron_h_latent": T.NemotronHConfig(**{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
                                               hybrid_override_pattern="M*E", head_dim=8, mamba_num_heads=4,
                                               mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                               chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                                               moe_latent_size=16, tie_word_embeddings=False),
        # Qwen3-Next: 3 gated delta nets (2 key / 4 value heads of 8) then gated attention (RoPE on a quarter of each
        # head, QK norm), every layer a MoE of 4 experts with a gated shared expert, zero-centred norms
        "qwen3_next": T.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                        linear_conv_kernel_dim=4, tie_word_embeddings=False),
        # Qwen3.5-MoE: Qwen3-Next's layers with the gated delta nets' input projections stored section by section
        "qwen3_5_moe": T.Qwen3_5MoeTextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                              linear_num_value_heads=4, linear_key_head_dim=8,
                                              linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                              tie_word_embeddings=False),
        # Qwen3.5 (dense): the same layers with dense MLPs
        "qwen3_5": T.Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                       linear_conv_kernel_dim=4, tie_word_embeddings=False),
        # GPT-OSS: attention sinks, biases on every projection, a 4-token sliding window on the even layers (the
        # sequence is 16: it matters), YaRN (transformers' default: factor 32, not truncated), 4 experts stored
        # stacked with a clamped SwiGLU
        "gpt_oss": T.GptOssConfig(**COMMON, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                  tie_word_embeddings=False),
    }


def write(name: str, path: str, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``name`` model (fp32) to ``path``."""
    import transformers as T

    cfg = configs()[name]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # (transformers starts a router's expert bias at zero: one that was not read would pass)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 5)) * 0.1)
    model.save_pretrained(path)
    return path


def write_vlm(name: str, path: str, seed: int = 0, **top: Any) -> str:
    """Save a tiny random Qwen3.5 vision-language model (``qwen3_5_moe`` or ``qwen3_5``: the form the hub publishes
    Qwen3.5 in) whose language model is :func:`configs`' text model of that name, with a 2-block vision encoder;
    ``top``: top-level config fields."""
    import transformers as T

    kinds = {"qwen3_5_moe": (T.Qwen3_5MoeConfig, T.Qwen3_5MoeVisionConfig, T.Qwen3_5MoeForConditionalGeneration),
             "qwen3_5": (T.Qwen3_5Config, T.Qwen3_5VisionConfig, T.Qwen3_5ForConditionalGeneration)}
    config_cls, vision_cls, model_cls = kinds[name]
    vision = vision_cls(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                        patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    text = configs()[name].to_dict()
    # (the hub's: M-RoPE over RoPE's quarter of each head; one position in every section on text)
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    cfg = config_cls(text_config=text, vision_config=vision.to_dict(), tie_word_embeddings=False, **top)
    torch.manual_seed(seed)
    model_cls(cfg).save_pretrained(path)
    return path


def write_kimi_k25(src: str, dst: str, quant_in_text: bool = False) -> str:
    """The DeepSeek-V3 model dir ``src`` (bf16 / fp32, or its quantized form) as Moonshot publishes Kimi K2.5 / K2.6
    (test-built: transformers ships no KimiK25 class, the hub's is custom code): ``KimiK25ForConditionalGeneration``
    whose ``text_config`` is the Kimi K2 config (``model_type: kimi_k2``, DeepseekV3ForCausalLM), its tensors under
    ``language_model.model.`` and ``language_model.lm_head.``, beside a small random vision tower and projector
    (``vision_tower.``, ``mm_projector.``); ``quant_in_text``: the quantization_config in text_config alone (else at
    the top level, as Moonshot's)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(dst, f)))
            os.remove(os.path.join(dst, f))
    if os.path.exists(os.path.join(dst, "model.safetensors.index.json")):
        os.remove(os.path.join(dst, "model.safetensors.index.json"))
    out = {("language_model.lm_head." + k[len("lm_head."):] if k.startswith("lm_head.") else
            "language_model." + k): v for k, v in tensors.items()}
    g = torch.Generator().manual_seed(11)
    for name, shape in (("vision_tower.patch_embed.proj.weight", (16, 3, 2, 2)),
                        ("vision_tower.encoder.blocks.0.wqkv.weight", (48, 16)),
                        ("vision_tower.encoder.blocks.0.norm0.weight", (16,)),
                        ("mm_projector.proj.0.weight", (32, 64)), ("mm_projector.pre_norm.weight", (16,))):
        out[name] = torch.randn(shape, generator=g).to(next(iter(tensors.values())).dtype)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        text = json.load(fh)
    quant = text.pop("quantization_config", None)
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    top = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
           "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False),
           "vision_config": {"model_type": "moonvit", "hidden_size": 16, "num_hidden_layers": 1},
           "media_placeholder_token_id": 163605, "use_unified_vision_chunk": True}
    if quant is not None:
        (text if quant_in_text else top)["quantization_config"] = quant
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(top, fh)
    return dst


def tokens(batch: int = 2, seed: int = 7, vocab: int = COMMON["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(path: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``transformers``' own logits for :func:`tokens` (fp32, eager attention)."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(tokens() if ids is None else ids).logits.float()


def build_from_args(args: dict[str, Any], tp: int, pp: int = 1, ep: int = 1) -> list[torch.nn.Module]:
    """A megatron-core GPT model (local spec) built from Megatron args (attribute names) at this layout."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers import cpu_compat
    from tests.helpers.pool import release_groups

    release_groups()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if ep == 1 else 1)
    cpu_compat.seed(1234)
    kw: dict[str, Any] = dict(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=args["num_attention_heads"],
        ffn_hidden_size=args["ffn_hidden_size"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"],
        add_bias_linear=args["add_bias_linear"], add_qkv_bias=args["add_qkv_bias"], gated_linear_unit=args["swiglu"],
        activation_func=F.silu, qk_layernorm=args["qk_layernorm"], use_cpu_initialization=True,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if ep == 1 else 1, sequence_parallel=bool(args.get("num_experts")) and tp > 1,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False)
    if args.get("num_experts"):
        kw.update(num_moe_experts=args["num_experts"], moe_router_topk=args["moe_router_topk"],
                  moe_ffn_hidden_size=args["moe_ffn_hidden_size"], moe_token_dispatcher_type="allgather",
                  moe_aux_loss_coeff=0.0, moe_router_pre_softmax=args["moe_router_pre_softmax"],
                  moe_router_score_function=args["moe_router_score_function"],
                  moe_layer_freq=args.get("moe_layer_freq", 1))
        for name in ("moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias", "moe_router_num_groups",
                     "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_dtype"):
            if args.get(name) is not None:
                kw[name] = args[name]
    if args.get("quick_geglu"):  # GPT-OSS: a clamped quick GEGLU with a linear offset, sinks, a sliding window
        from megatron.core.activations import quick_gelu

        kw.update(activation_func=quick_gelu, gated_linear_unit=True, glu_linear_offset=args["glu_linear_offset"],
                  activation_func_clamp_value=args["activation_func_clamp_value"])
    for name in ("softmax_type", "window_size", "window_attn_skip_freq"):
        if args.get(name) is not None:
            kw[name] = args[name]
    cfg = TransformerConfig(**kw)
    if args.get("position_embedding_type") == "yarn":  # (the GPT model reads YaRN's settings off the config)
        for name, arg in (("yarn_rotary_scaling_factor", "rotary_scaling_factor"),
                          ("yarn_original_max_position_embeddings", "yarn_original_max_position_embeddings"),
                          ("yarn_beta_fast", "yarn_beta_fast"), ("yarn_beta_slow", "yarn_beta_slow"),
                          ("yarn_mscale", "mscale"), ("yarn_mscale_all_dim", "mscale_all_dim"),
                          ("yarn_correction_range_round_to_int", "yarn_correction_range_round_to_int")):
            setattr(cfg, name, args[arg])
    if args.get("num_experts") and args.get("moe_layer_freq", 1) != 1:  # dense and MoE layers: a block spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args["normalization"])
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.get("num_experts"), qk_layernorm=args["qk_layernorm"],
                                        normalization=args["normalization"])
    from megatron_preflight.parallel import pad_vocab

    padded = pad_vocab(args["true_vocab"], args["make_vocab_size_divisible_by"], tp)
    model = GPTModel(cfg, spec, vocab_size=padded, max_sequence_length=SEQ,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
                     position_embedding_type=args.get("position_embedding_type", "rope"),
                     rotary_base=args["rotary_base"],
                     rotary_percent=args["rotary_percent"])
    model.eval()
    return [model]


def load_and_forward(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, root: str | None = None) -> Any:
    """On every rank: the model built from the HF dir's Megatron args at this layout, loaded (strictly) from the
    in-memory reshard of ``hf_dir`` (or of the Megatron checkpoint ``root`` when given); rank 0's logits over the
    model's vocab (PP1), else each rank's state dict."""
    from megatron_preflight import reshard
    from megatron_preflight.layout.hf.families import true_vocab
    from megatron_preflight.reshard.resharder import build_rank_state_dict
    from megatron_preflight.reshard.target import TargetLayout

    saved = reshard.open_index(hf_dir).layout.saved_args
    args = dict(vars(saved))  # an HF dir's derived args, or a Megatron checkpoint's saved ones
    if args.get("norm_epsilon") is None:  # (Megatron-LM main saves --norm-epsilon as layernorm_epsilon)
        args["norm_epsilon"] = args.get("layernorm_epsilon", 1e-5)
    for name, default in (("add_qkv_bias", False), ("qk_layernorm", False), ("rotary_percent", 1.0),
                          ("moe_router_pre_softmax", False), ("moe_router_score_function", "softmax")):
        args.setdefault(name, default)
    vocab = args["true_vocab"] = true_vocab(saved)
    chunks = build_from_args(args, tp, pp, ep)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sd = build_rank_state_dict(root or hf_dir, TargetLayout(tp=tp, pp=pp, ep=ep, etp=tp if ep == 1 else 1),
                               rank=rank, world_size=world)
    chunks[0].load_state_dict(sd["model"], strict=True)
    if pp > 1:
        return {k: v.clone() for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
    ids = tokens(vocab=min(vocab, COMMON["vocab_size"]))
    pos = torch.arange(SEQ).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        out = chunks[0](ids, pos, mask, runtime_gather_output=True)
    return out[..., :vocab].clone() if rank == 0 else None





def add_mtp(path: str, seed: int = 3) -> str:
    """Give a DeepSeek-V3 dir written by ``transformers`` (which drops them) the multi-token prediction layer the hub's
    files carry, as layer ``num_hidden_layers``: a copy of the last layer's weights, random norms and ``eh_proj``,
    and copies of the embedding and head (test-only: ``transformers`` ignores these weights, so they change nothing
    it computes)."""
    import json

    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as fh:
        n = json.load(fh)["num_hidden_layers"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for k in [k for k in weights if k.startswith(last)]:
        weights[mtp + k[len(last):]] = weights[k].clone() + 0.01 * torch.randn(weights[k].shape, generator=g)
    hidden = weights["model.norm.weight"].shape[0]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    weights[mtp + "eh_proj.weight"] = 0.25 * torch.randn(hidden, 2 * hidden, generator=g)
    weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def _quantized(name: str) -> bool:
    """What the hub's FP8 checkpoints quantize: the decoder's linear weights (not norms, the router, the embedding or
    the output layer)."""
    return ".layers." in name and name.endswith("proj.weight") or ".experts." in name and name.endswith(".weight")


def _quantized_pair(src: str, dst: str, quantize: Any, quantization_config: dict, dtype: torch.dtype | None) \
        -> tuple[str, str]:
    """The model at ``src`` written twice (test-only): ``dst`` with each tensor as ``quantize(name, w)`` returns it
    (the tensors stored for it, and its dequantized value) and config.json naming ``quantization_config``; and
    ``dst + "_dequantized"`` with the dequantized values (the oracle's model). ``dtype``: the model's, default the
    source's. Returns (the quantized dir, the dequantized dir)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    deq_dir = dst + "_dequantized"
    for d in (dst, deq_dir):
        shutil.copytree(src, d)
        for f in os.listdir(d):
            if f.endswith(".safetensors") or f == "model.safetensors.index.json":
                os.remove(os.path.join(d, f))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    stored, deq = {}, {}
    for name, w in tensors.items():
        parts, deq[name] = quantize(name, w.to(dtype) if dtype is not None else w)
        stored.update(parts)
    save_file(stored, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    if dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(deq_dir, "config.json"), "w") as fh:
            json.dump(cfg, fh)
    cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst, deq_dir


def _fp8(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[R, C]`` as FP8 e4m3 with one scale per ``br`` x ``bc`` block (test-only; amax / 448, the edge blocks
    partial): (the float8_e4m3fn weight, the float32 scales ``[ceil(R / br), ceil(C / bc)]``, the dequantized value in
    ``w``'s dtype — fp8 x scale, the plain formula)."""
    r, c = w.shape
    br, bc = min(br, r), min(bc, c)
    rb, cb = -(-r // br), -(-c // bc)
    padded = torch.zeros(rb * br, cb * bc, dtype=torch.float32)
    padded[:r, :c] = w.float()
    amax = padded.reshape(rb, br, cb, bc).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / FP8_MAX).float()
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale, (q.float() * full).to(w.dtype)


def write_fp8(src: str, dst: str, block: tuple[int, int] = (16, 16), dtype: torch.dtype | None = None) \
        -> tuple[str, str]:
    """The model at ``src`` as the hub publishes an FP8 model (test-only): each decoder linear weight float8_e4m3fn
    with a float32 ``weight_scale_inv`` per ``block`` (amax / 448, the edge blocks partial), config.json naming the
    scheme; and beside it ``dst + "_dequantized"``: the same model with the dequantized weights (fp8 x scale, in the
    model's dtype: ``dtype``, default the source's), the oracle's model. Returns (the FP8 dir, the dequantized dir)."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if not (_quantized(name) and w.dim() == 2):
            return {name: w}, w
        q, scale, value = _fp8(w, *block)
        return {name: q, name + "_scale_inv": scale}, value

    return _quantized_pair(src, dst, quantize, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": list(block)}, dtype)


def write_compressed_fp8(src: str, dst: str, strategy: str = "channel", size: Any = None,
                         dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The model at ``src`` as llm-compressor publishes an FP8 model (test-only; compressed-tensors
    ``float-quantized``): each decoder linear weight float8_e4m3fn beside ``weight_scale`` for its ``strategy`` —
    ``tensor`` (shape [1]), ``channel`` ([R, 1]), ``group`` (``size`` columns: [R, ceil(C / size)]) or ``block``
    (``size`` = [bR, bC]) — in the model's dtype, and config.json's quantization_config as llm-compressor writes it
    (dynamic per-token activations); beside it ``dst + "_dequantized"`` (fp8 x scale: the oracle's model)."""
    def quantize(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if not (_quantized(name) and w.dim() == 2):
            return {name: w}, w
        r, c = w.shape
        br, bc = {"tensor": (r, c), "channel": (1, c), "group": (1, size), "block": size}[strategy]
        q, scale, _ = _fp8(w, br, bc)
        scale = scale.to(w.dtype)  # (llm-compressor keeps the scales in the model's dtype)
        value = (q.float() * scale.float().repeat_interleave(min(br, r), 0).repeat_interleave(min(bc, c), 1)[:r, :c])
        return {name: q, name + "_scale": scale.reshape(1) if strategy == "tensor" else scale}, value.to(w.dtype)

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": size if strategy == "group" else None, "actorder": None, "observer": "minmax",
               "block_structure": list(size) if strategy == "block" else None, "observer_kwargs": {}}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {
                  "targets": ["Linear"], "weights": weights, "output_activations": None, "format": "float-quantized",
                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                        "strategy": "token"}}},
              "ignore": ["lm_head", "re:.*mlp[.]gate$", "re:.*kv_a_proj_with_mqa$"], "kv_cache_scheme": None,
              "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None, "version": "0.11.0"}
    return _quantized_pair(src, dst, quantize, config, dtype)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric integers ``q`` ``[R, C]`` packed as compressed-tensors stores them (test-only, written from the
    format's description): each value plus 2^(bits - 1), ``32 / bits`` a little-endian int32 word, the first in the
    lowest bits — INT4 two a byte, the low nibble first. ``[R, C * bits / 32]`` int32."""
    u = (q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return u.contiguous().view(torch.int32)


def write_compressed_int(src: str, dst: str, bits: int = 4, group: int | None = 16,
                         dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The model at ``src`` as llm-compressor publishes an INT4 / INT8 weight-only model (test-only; compressed-tensors
    ``pack-quantized``, as Kimi K2 Thinking's experts): each decoder linear weight as ``weight_packed`` (int32),
    ``weight_scale`` (the model's dtype; per ``group`` columns, None: per channel) and ``weight_shape`` (int64 [R, C]);
    beside it ``dst + "_dequantized"`` ((stored - 2^(bits - 1)) x scale: the oracle's model)."""
    top = (1 << (bits - 1)) - 1

    def quantize(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if not (_quantized(name) and w.dim() == 2):
            return {name: w}, w
        r, c = w.shape
        g = group or c
        scale = (w.float().reshape(r, c // g, g).abs().amax(-1).clamp(min=1e-12) / top).to(w.dtype)
        full = scale.float().repeat_interleave(g, 1)
        q = torch.clamp(torch.round(w.float() / full), -top - 1, top).to(torch.int8)
        module = name.removesuffix("weight")
        return ({module + "weight_packed": _pack(q, bits), module + "weight_scale": scale,
                 module + "weight_shape": torch.tensor([r, c], dtype=torch.int64)}, (q.float() * full).to(w.dtype))

    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "group" if group else "channel", "group_size": group, "actorder": None,
               "observer": "minmax", "block_structure": None, "observer_kwargs": {}}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None}},
              "ignore": ["lm_head", "re:.*mlp[.]gate$", "re:.*kv_a_proj_with_mqa$"], "kv_cache_scheme": None}
    return _quantized_pair(src, dst, quantize, config, dtype)


def write_modelopt_fp8(src: str, dst: str, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The model at ``src`` as NVIDIA ModelOpt publishes an FP8 model (test-only; ``quant_algo: FP8``): each decoder
    linear weight float8_e4m3fn with a float32 ``weight_scale`` of shape [] (per tensor) and a static
    ``input_scale`` [] beside it (an activation scale: no weight); beside it ``dst + "_dequantized"``."""
    def quantize(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if not (_quantized(name) and w.dim() == 2):
            return {name: w}, w
        q, scale, value = _fp8(w, *w.shape)
        module = name.removesuffix(".weight")
        return {name: q, name + "_scale": scale.reshape(()), module + ".input_scale": torch.tensor(0.02)}, value

    return _quantized_pair(src, dst, quantize, {"quant_method": "modelopt", "quant_algo": "FP8",
                                                "kv_cache_quant_algo": None, "ignore": ["lm_head"]}, dtype)


FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's magnitudes by code


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., in]`` as MXFP4 (test-only): per 32 values an e8m0 exponent (biased by 127) that puts the largest
    magnitude at or under 6, each value rounded to the nearest e2m1 code; (blocks ``[..., in / 32, 16]`` uint8, the
    low nibble the even value; scales ``[..., in / 32]`` uint8)."""
    *prefix, cols = w.shape
    groups = w.float().reshape(*prefix, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp).unsqueeze(-1)
    grid = torch.tensor(FP4_GRID)
    code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def write_mxfp4(src: str, dst: str, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The GPT-OSS model at ``src`` as the hub publishes it (test-only): each expert weight (``gate_up_proj``,
    ``down_proj``) as MXFP4 ``*_blocks`` / ``*_scales`` in the hub's ``[experts, out, in / 32, 16]`` layout, config.json
    naming the scheme; and beside it ``dst + "_dequantized"``: the same model with those weights dequantized by
    transformers' own ``convert_moe_packed_tensors`` (the oracle's model); ``dtype``: the model's (bf16 as the hub's),
    default the source's. Returns (the MXFP4 dir, the dequantized)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def quantize(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return {name: w}, w
        blocks, scales = _to_mxfp4(w.transpose(1, 2))  # (transformers' [E, in, out] -> the hub's [E, out, in])
        return ({name + "_blocks": blocks, name + "_scales": scales},
                convert_moe_packed_tensors(blocks, scales, dtype=w.dtype).contiguous())

    return _quantized_pair(src, dst, quantize, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}, dtype)
