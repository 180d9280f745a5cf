"""The pretrain_gpt.py / pretrain_hybrid.py flags of a run that resumes a checkpoint as a user writes them: the model,
the spec, the optimizer form and the format from the checkpoint's saved args, and no size flag unless asked for (a run
on one process usually leaves TP, PP and EP at Megatron's defaults)."""

from __future__ import annotations

from typing import Any

from megatron_preflight.layout.discover import discover

# (saved arg, how it is written): flag VALUE, a switch when true, or skipped when None / false
_VALUED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
           "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "seq_length", "max_position_embeddings",
           "position_embedding_type", "normalization", "vocab_size", "make_vocab_size_divisible_by",
           "transformer_impl", "mtp_num_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
           "v_head_dim", "ckpt_format", "mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim",
           "mamba_expand", "linear_num_key_heads", "linear_num_value_heads")
_SWITCHES = ("group_query_attention", "swiglu", "qk_layernorm", "untie_embeddings_and_output_weights",
             "multi_latent_attention", "moe_grouped_gemm", "use_distributed_optimizer", "bf16", "fp16",
             "sequence_parallel", "use_megatron_fsdp")


def model_flags(root: str, **sizes: int) -> list[str]:
    """The run's flags for the checkpoint at ``root``; ``sizes`` (tp=, pp=, ep=, etp=) adds those size flags."""
    args = discover(root).saved_args
    assert args is not None, f"{root} records no args"
    flags: list[str] = []
    for name in _VALUED:
        value = _get(args, name)
        if value not in (None, False) and not (name in ("num_experts", "mtp_num_layers") and not value):
            flags += [_flag(name), str(value)]
    for name in _SWITCHES:
        if _get(args, name) is True:
            flags.append(_flag(name))
    if _get(args, "add_bias_linear") is False:
        flags.append("--disable-bias-linear")
    pattern = _get(args, "hybrid_layer_pattern") or _get(args, "hybrid_override_pattern")
    if pattern:
        flags += ["--hybrid-layer-pattern", _unpiped(pattern, sizes.get("pp", 1))]
        flags = _drop(flags, "--num-layers")  # the pattern decides it
    names = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
             "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
    for key, value in sizes.items():
        flags += [_flag(names[key]), str(value)]
    saved_pp = _get(args, "pipeline_model_parallel_size") or 1
    if sizes.get("pp", 1) > 1 and sizes.get("pp") == saved_pp and not pattern:  # the saved stage split, kept
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if _get(args, name) is not None:
                flags += [_flag(name), str(_get(args, name))]
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            if _get(args, name) is True:
                flags.append(_flag(name))
    if sizes.get("tp", 1) == 1:
        flags = [f for f in flags if f != "--sequence-parallel"]  # Megatron turns it off at TP1 itself
    return flags


def _unpiped(pattern: str, pp: int) -> str:
    """The hybrid pattern cut into ``pp`` even pipeline segments (as a run at that PP writes it), MTP kept."""
    main, sep, mtp = pattern.partition("/")
    layers = main.replace("|", "")
    if pp > 1 and len(layers) % pp == 0:
        n = len(layers) // pp
        layers = "|".join(layers[i:i + n] for i in range(0, len(layers), n))
    return layers + sep + mtp


def _drop(flags: list[str], flag: str) -> list[str]:
    if flag not in flags:
        return flags
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
