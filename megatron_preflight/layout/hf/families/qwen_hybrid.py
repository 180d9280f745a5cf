"""What Qwen3-Next and Qwen3.5 share (:mod:`.qwen3_next`, :mod:`.qwen3_5`): gated delta net layers
(``linear_attention``) beside gated attention (``full_attention``, a sigmoid gate on each head's output, QK norm, RoPE
on a quarter of each head), every norm zero-centred (``1 + w``), MoE layers with a softmax router and one shared expert
behind a sigmoid gate (or dense MLPs). Megatron builds it as a HybridModel (``pretrain_hybrid.py``, the Transformer
Engine hybrid stack spec): each HF layer is two Megatron layers, its mixer (``G`` or ``*``) then its MLP (``E``, or
``-`` for a dense one), with ``--apply-layernorm-1p``, ``--attention-output-gate`` and ``--moe-shared-expert-gate``.

Rows: the attention's fused QKV per query group is ``[q heads, their gates, k, v]`` (HF keeps each head's query and
gate side by side in ``q_proj``); a gated delta net's ``in_proj`` is ``[q, k, v, z, b, a]`` section by section (each
family says where its tensors hold them). The gated delta net's output norm is the one norm HF does not zero-centre,
where Megatron's (a TENorm under ``--apply-layernorm-1p``) is: read as ``w - 1``. An export writes the model back in
transformers' layout (the norm's ``w - 1`` undone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.layout.hf.config import REQUIRED, HfConfig, Key
from megatron_preflight.layout.hf.families.rows import Experts, Mapping, Moe, Rows, hybrid_tail, stack, te_mlp
from megatron_preflight.layout.hf.families.spec import HYBRID_SPEC, arg, table, traits


def pattern(cfg: HfConfig) -> str:
    """The Megatron hybrid pattern: per HF layer its mixer (G / *), then its MLP (E / -)."""
    moe = cfg.moe_layers()
    return "".join(("G" if kind == "linear_attention" else "*") + ("E" if moe[i] else "-")
                   for i, kind in enumerate(cfg.layer_kinds))


def _gated_qkv(attn: str, cfg: HfConfig) -> Any:
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    per = cfg.num_attention_heads // groups
    parts: list[tuple[str, int, int]] = []
    for g in range(groups):
        heads = range(g * per, (g + 1) * per)
        parts += [(attn + "q_proj.weight", 2 * h * hd, hd) for h in heads]
        parts += [(attn + "q_proj.weight", 2 * h * hd + hd, hd) for h in heads]
        parts += [(attn + "k_proj.weight", g * hd, hd), (attn + "v_proj.weight", g * hd, hd)]
    return stack(parts)


MOE = Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))


def grouped_experts(r: Rows, cfg: HfConfig, hf: str, mg: str) -> list[Mapping]:
    """The router and the routed experts as a HybridModel holds them: Transformer Engine's grouped linears (its layer
    specs build no other), one weight per expert and one extra state per grouped linear."""
    experts = Experts(hf + "experts.", mg + "experts.", cfg.num_experts or 0, MOE.experts, bias=False, extras=True,
                      grouped_linears=True)
    return [r.copy(mg + "router.weight", hf + "gate.weight"), *([experts] if r.grouped else experts.mappings(r))]


def tensors(in_proj: Callable[[str, HfConfig], Any]) -> Callable[[Rows, HfConfig], list[Mapping]]:
    """The HybridModel's tensors under the Transformer Engine hybrid stack spec's names, two layers per HF layer;
    ``in_proj``: a gated delta net's ``in_proj`` rows ``[q, k, v, z, b, a]`` from the family's own tensors."""
    return lambda r, cfg: _tensors(r, cfg, in_proj)


def _tensors(r: Rows, cfg: HfConfig, in_proj: Callable[[str, HfConfig], Any]) -> list[Mapping]:
    out = [r.copy("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    moe = cfg.moe_layers()
    for i, kind in enumerate(cfg.layer_kinds):
        hf, mix, mlp = f"model.layers.{i}.", f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        norm = hf + "input_layernorm.weight"
        if kind == "linear_attention":
            la, sa = hf + "linear_attn.", mix + "self_attention."
            out += [r.copy(sa + "dt_bias", la + "dt_bias"), r.copy(sa + "A_log", la + "A_log"),
                    r.copy(sa + "in_proj.layer_norm_weight", norm),
                    Mapping(sa + "in_proj.weight", in_proj(la, cfg)), r.extra(sa + "in_proj._extra_state"),
                    r.copy(sa + "conv1d.weight", la + "conv1d.weight"),
                    r.copy(sa + "out_norm.weight", la + "norm.weight")._replace(add=-1.0),
                    r.extra(sa + "out_norm._extra_state"), r.copy(sa + "out_proj.weight", la + "out_proj.weight"),
                    r.extra(sa + "out_proj._extra_state")]
        else:
            at, sa = hf + "self_attn.", mix + "self_attention."
            out += [r.extra(sa + "core_attention._extra_state"), r.copy(sa + "linear_proj.weight", at + "o_proj.weight"),
                    r.extra(sa + "linear_proj._extra_state"), r.copy(sa + "linear_qkv.layer_norm_weight", norm),
                    Mapping(sa + "linear_qkv.weight", _gated_qkv(at, cfg)), r.extra(sa + "linear_qkv._extra_state"),
                    r.copy(sa + "q_layernorm.weight", at + "q_norm.weight"), r.extra(sa + "q_layernorm._extra_state"),
                    r.copy(sa + "k_layernorm.weight", at + "k_norm.weight"), r.extra(sa + "k_layernorm._extra_state")]
        post = hf + "post_attention_layernorm.weight"
        if moe[i]:
            block = hf + "mlp."
            sh, ms = block + "shared_expert.", mlp + "mlp.shared_experts."
            out += [r.copy(mlp + "pre_mlp_layernorm.weight", post), r.extra(mlp + "pre_mlp_layernorm._extra_state")]
            out += grouped_experts(r, cfg, block, mlp + "mlp.")
            out += [r.copy(ms + "gate_weight", block + "shared_expert_gate.weight"),
                    r.glu(ms + "linear_fc1.weight", sh + "gate_proj.weight", sh + "up_proj.weight"),
                    r.extra(ms + "linear_fc1._extra_state"), r.copy(ms + "linear_fc2.weight", sh + "down_proj.weight"),
                    r.extra(ms + "linear_fc2._extra_state")]
        else:
            out += te_mlp(r, mlp, post, r.glu(mlp + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight",
                                              hf + "mlp.up_proj.weight"), hf + "mlp.down_proj.weight")
    return out + hybrid_tail(r, cfg, "model.norm.weight")


def args(cfg: HfConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_layers": 2 * cfg.num_layers, "hybrid_layer_pattern": pattern(cfg), "is_hybrid_model": True,
        "spec": list(HYBRID_SPEC), "apply_layernorm_1p": True, "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_conv_kernel_dim": cfg.linear_conv}
    if cfg.moe:
        out.update(moe_router_pre_softmax=not cfg.norm_topk_prob, moe_layer_freq=1)
        if cfg.shared_expert_size:
            out.update(moe_shared_expert_intermediate_size=cfg.shared_expert_size, moe_shared_expert_gate=True)
    return out


def back(values: dict[str, Any], args: Any) -> dict[str, Any]:
    """The HF layers of the Megatron model: each pair of hybrid layers (mixer, MLP) one HF layer."""
    layers = parallel.hybrid_layers(parallel.hybrid_pattern(args) or "")
    mixers, mlps = layers[0::2], layers[1::2]
    values.update(num_layers=len(mixers),
                  layer_kinds=tuple("linear_attention" if m == "G" else "full_attention" for m in mixers),
                  mlp_only_layers=tuple(i for i, m in enumerate(mlps) if m != "E"),
                  linear_key_head_dim=arg(args, "linear_key_head_dim"),
                  linear_value_head_dim=arg(args, "linear_value_head_dim"),
                  linear_num_key_heads=arg(args, "linear_num_key_heads"),
                  linear_num_value_heads=arg(args, "linear_num_value_heads"),
                  linear_conv=arg(args, "linear_conv_kernel_dim", 4),
                  shared_expert_size=arg(args, "moe_shared_expert_intermediate_size", 0), shared_experts=0)
    return values


def expresses(args: Any, dense: bool = False) -> bool:
    """Whether the Megatron model of ``args`` is this hybrid: MoE layers with a gated shared expert (or, ``dense``,
    dense MLPs only)."""
    layers = parallel.hybrid_layers(parallel.hybrid_pattern(args) or "")
    mlps = "-" if dense else "E-"
    pairs = len(layers) % 2 == 0 and all(m in "G*" for m in layers[0::2]) and all(m in mlps for m in layers[1::2])
    t = traits(args)
    return bool(layers) and pairs and t.gated and t.qk_norm and t.zero_centred \
        and not (t.mla or t.mtp or t.sigmoid or t.qkv_bias) and bool(arg(args, "attention_output_gate", False)) \
        and (dense or bool(arg(args, "moe_shared_expert_gate", False)))


def refuse(cfg: HfConfig) -> list[str]:
    out = []
    if (cfg.linear_num_value_heads or 1) % (cfg.linear_num_key_heads or 1):
        out.append(f"{cfg.linear_num_value_heads} gated delta net value heads over {cfg.linear_num_key_heads} key "
                   "heads (a whole number of value heads per key head is needed)")
    if cfg.attention_bias:
        out.append("attention_bias (a gated attention's QKV bias is not mapped here)")
    return out


def keys(*own: Key, sparse: bool = True, experts: bool = True) -> tuple[Key, ...]:
    """The config table both families read (transformers' Qwen3NextConfig defaults), ``own`` rows replacing or adding
    to it; ``sparse``: the family reads which layers are MoE layers and whether the top-k is renormalised (Qwen3-Next;
    Qwen3.5's every layer is, and it always renormalises); ``experts``: it has experts (Qwen3.5's dense models not)."""
    rows = [Key("head_dim", "head_dim", 256), Key("attention_bias", "attention_bias", False),
            Key("partial_rotary_factor", "rotary_percent", 0.25),
            Key("layer_types", "layer_kinds", None), Key("linear_conv_kernel_dim", "linear_conv", 4),
            Key("linear_key_head_dim", "linear_key_head_dim", 128),
            Key("linear_value_head_dim", "linear_value_head_dim", 128),
            Key("linear_num_key_heads", "linear_num_key_heads", 16),
            Key("linear_num_value_heads", "linear_num_value_heads", 32)]
    if experts:
        rows += [Key("num_experts", "num_experts", REQUIRED, ("num_local_experts",)),
                 Key("num_experts_per_tok", "experts_per_token", 10),
                 Key("moe_intermediate_size", "moe_intermediate_size", REQUIRED),
                 Key("shared_expert_intermediate_size", "shared_expert_size", 0)]
    if sparse:
        rows += [Key("norm_topk_prob", "norm_topk_prob", True), Key("decoder_sparse_step", "decoder_sparse_step", 1),
                 Key("mlp_only_layers", "mlp_only_layers", ())]
    mine = {k.field: k for k in own}
    return table(*[mine.pop(k.field, k) for k in rows], *mine.values())
