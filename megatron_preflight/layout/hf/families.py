"""THE table of Hugging Face architectures: for each family, which Megatron model its ``config.json`` describes (the
Megatron args) and how each Megatron tensor is made of Hugging Face tensors (names and row blocks).

Every Megatron tensor (a legacy key of the local layer spec at TP1, PP1, EP1: the global tensor) is a stack along
dim 0 of row blocks of Hugging Face tensors (:class:`Block`); the other dims are whole. Three transforms make them:

* ``copy``   — one HF tensor as is (norms, ``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2``, embeddings);
* ``glu``    — SwiGLU's fc1 is ``[gate; up]``: ``gate_proj`` rows, then ``up_proj`` rows;
* ``qkv``    — Megatron's fused QKV is grouped per query group: for each group ``g`` its ``q`` heads, then its one
  ``k`` head, then its ``v`` head (weight and bias alike);
* ``rope``   — DeepSeek's multi-latent attention rotates each head's rotary rows in interleaved pairs ``(2i, 2i+1)``
  (``rope_interleave``, the default), and so does Megatron's MLA (it de-interleaves before rotating halves): the rows
  are taken as they are. A model that rotates halves (``rope_interleave: false``) has its rows interleaved: row
  ``2i`` from ``i``, row ``2i + 1`` from ``i + d/2`` (measured: without it the loss differs from ``transformers``').

The same blocks read backwards split a Megatron tensor into its HF tensors, so a reader and a writer of HF models
share this one table. The layer spec's other names (Transformer Engine's fused norms, grouped experts) are the
resharder's bridge (:mod:`megatron_preflight.reshard.plan.spec`), not this table's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf.config import HfConfig, RopeScaling

# Megatron's extra state of the local spec's linears (``None``: no FP8 metadata), as megatron-core saves them
LINEAR_EXTRA = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
# tensors some HF checkpoints carry that are buffers, not weights (recomputed from the config)
BUFFERS = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Moe:
    """Where a family keeps its MoE block and what it calls the expert projections."""

    block: str  # the module under each layer (``block_sparse_moe`` / ``mlp``)
    gate: str  # the router's linear
    experts: tuple[str, str, str]  # (gate, up, down) projection names of one expert


@dataclass(frozen=True)
class Family:
    """One row of the table: the HF architectures it covers and how they differ."""

    name: str
    architectures: tuple[str, ...]
    qkv_bias: str  # "always" (Qwen2), "config" (``attention_bias``), "never"
    qk_norm: bool  # per-head RMSNorm of q and k (Qwen3)
    moe: Moe | None = None
    mla: bool = False  # multi-latent attention (DeepSeek-V3), which Megatron builds with the TE spec only


FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), qkv_bias="config", qk_norm=False),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias="always", qk_norm=False),
    Family("qwen3", ("Qwen3ForCausalLM",), qkv_bias="config", qk_norm=True),
    Family("mixtral", ("MixtralForCausalLM",), qkv_bias="never", qk_norm=False,
           moe=Moe("block_sparse_moe", "gate", ("w1", "w3", "w2"))),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qkv_bias="config", qk_norm=True,
           moe=Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))),
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), qkv_bias="never", qk_norm=False,
           moe=Moe("mlp", "gate", ("gate_proj", "up_proj", "down_proj")), mla=True),
)


def supported() -> list[str]:
    """Every architecture the table covers."""
    return [a for f in FAMILIES for a in f.architectures]


class UnsupportedModel(PreflightError):
    """An HF model the table does not express as a Megatron GPT model."""


def family_for(architecture: str, path: str) -> Family:
    """The family of ``architecture``; an unsupported one is refused, naming what is supported."""
    for f in FAMILIES:
        if architecture in f.architectures:
            return f
    what = ("this Hugging Face model dir's config.json names no architecture (no architectures, no model_type)"
            if architecture == "unknown" else
            f"the Hugging Face architecture {architecture} is not one megatron-preflight maps to Megatron's GPT model")
    raise UnsupportedModel(what, path=path,
                           fix="supported: " + ", ".join(supported()) + "; convert other models with the tool that "
                               "knows them (e.g. Megatron-Bridge)", code="hf_unsupported")


def qkv_bias(family: Family, cfg: HfConfig) -> bool:
    return family.qkv_bias == "always" or (family.qkv_bias == "config" and bool(cfg.attention_bias))


def refusals(family: Family, cfg: HfConfig) -> list[str]:
    """What in this model Megatron's GPT model cannot express (each a reason; empty: it can)."""
    out = []
    if cfg.hidden_act not in ("silu", "swish"):
        out.append(f"hidden_act {cfg.hidden_act!r} (Megatron's gated MLP here is SwiGLU: silu)")
    if cfg.mlp_bias:
        out.append("mlp_bias: the MLP projections have biases, which Megatron adds only with every linear's bias")
    if family.qkv_bias == "config" and cfg.attention_bias and family.name == "llama":
        out.append("attention_bias: Llama's o_proj bias has no Megatron counterpart without every linear's bias")
    sc = cfg.rope_scaling
    if sc is not None and sc.kind == "yarn" and family.mla:
        fixed = {"original_max_position_embeddings": (sc.original_max_position_embeddings, MLA_YARN_ORIGINAL),
                 "beta_fast": (sc.beta_fast, 32.0), "beta_slow": (sc.beta_slow, 1.0)}
        for name, (value, megatron) in fixed.items():
            if value is not None and float(value) != float(megatron):
                out.append(f"YaRN's {name} {value} (Megatron's MLA takes {megatron}: its command line cannot set it)")
    elif sc is not None and sc.kind == "llama3":
        given = {"low_freq_factor": sc.low_freq_factor, "high_freq_factor": sc.high_freq_factor,
                 "original_max_position_embeddings": sc.original_max_position_embeddings}
        for name, megatron in LLAMA3_FIXED.items():
            value = given[name]
            if value is not None and float(value) != float(megatron):
                out.append(f"llama3 RoPE scaling's {name} {value} (Megatron's --use-rope-scaling takes {megatron}: its "
                           "command line cannot set it, and the rotary frequencies would differ)")
    elif sc is not None and sc.kind != "linear":
        out.append(f"RoPE scaling {sc.kind!r} (Megatron's GPT model applies llama3 scaling (--use-rope-scaling) and "
                   "linear interpolation (--rotary-seq-len-interpolation-factor); YaRN with multi-latent attention)")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor is not None \
            and float(cfg.rope_scaling.factor) != int(cfg.rope_scaling.factor):
        out.append(f"linear RoPE scaling by {cfg.rope_scaling.factor} (Megatron takes an integer factor)")
    if cfg.num_attention_heads % cfg.num_key_value_heads and not family.mla:
        out.append(f"{cfg.num_attention_heads} heads do not group over {cfg.num_key_value_heads} key-value heads")
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        out.append(f"the router's scoring function {cfg.scoring_func!r}")
    if cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob is False and (cfg.experts_per_token or 1) > 1:
        out.append("sigmoid routing without norm_topk_prob (Megatron normalises the top-k sigmoid scores)")
    return out


MAX_TP = 8  # the vocab is kept unpadded up to this TP
MLA_YARN_ORIGINAL = 4096  # MLATransformerConfig's original_max_position_embeddings (no flag sets it for MLA)
# what Megatron's RotaryEmbedding applies with --use-rope-scaling besides the factor (no flag sets them)
LLAMA3_FIXED: dict[str, Any] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def _divisor(vocab: int) -> int:
    """The ``--make-vocab-size-divisible-by`` under which the model's vocab is not padded at any TP up to
    :data:`MAX_TP` (Megatron pads to a multiple of it times TP; padding rows are zeros whose logits enter the softmax,
    so the run would compute another loss than the model's): the largest power of two up to Megatron's default 128."""
    d = 128
    while d > 1 and vocab % (d * MAX_TP):
        d //= 2
    return d


def megatron_args(family: Family, cfg: HfConfig) -> dict[str, Any]:
    """The Megatron args (attribute names) of the GPT model that holds this HF model, as its run must set them."""
    moe_layers = cfg.moe_layers()
    args: dict[str, Any] = {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "group_query_attention": cfg.num_key_value_heads != cfg.num_attention_heads,
        "num_query_groups": cfg.num_key_value_heads, "kv_channels": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "position_embedding_type": "rope", "rotary_base": int(cfg.rope_theta) if float(cfg.rope_theta).is_integer()
        else cfg.rope_theta, "rotary_percent": 1.0,
        "use_rope_scaling": False, "rotary_seq_len_interpolation_factor": None,
        "normalization": "RMSNorm", "norm_epsilon": cfg.norm_eps, "swiglu": True,
        "add_bias_linear": False, "add_qkv_bias": qkv_bias(family, cfg), "qk_layernorm": family.qk_norm,
        "untie_embeddings_and_output_weights": not cfg.tie_word_embeddings,
        "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.vocab_size,
        "make_vocab_size_divisible_by": _divisor(cfg.vocab_size),
        "num_experts": None,
    }
    if family.mla:
        args.update({"multi_latent_attention": True, "q_lora_rank": cfg.q_lora_rank,
                     "kv_lora_rank": cfg.kv_lora_rank, "qk_head_dim": cfg.qk_nope_head_dim,
                     "qk_pos_emb_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
                     "kv_channels": None, "group_query_attention": False, "num_query_groups": None,
                     # the q and kv low-rank norms: Megatron builds them (fused into the up projections) only
                     # with --qk-layernorm
                     "qk_layernorm": True, "rope_type": "rope"})
        sc = cfg.rope_scaling
        if sc is not None and sc.kind == "yarn":  # MLA's YaRN: the factor and the two attention scales
            args.update(rope_type="yarn", rotary_scaling_factor=float(sc.factor or 1.0),
                        mscale=float(sc.mscale if sc.mscale is not None else 1.0),
                        mscale_all_dim=float(sc.mscale_all_dim if sc.mscale_all_dim is not None else 0.0))
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        args["use_rope_scaling"] = True
        args["rope_scaling_factor"] = cfg.rope_scaling.factor
    elif cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        args["rotary_seq_len_interpolation_factor"] = int(cfg.rope_scaling.factor or 1)
    if cfg.moe:
        args.update({
            "num_experts": cfg.num_experts, "moe_router_topk": int(cfg.experts_per_token or 2),
            "moe_ffn_hidden_size": int(cfg.moe_intermediate_size or cfg.intermediate_size),
            "moe_router_score_function": "softmax",
            # Mixtral renormalises the top-k probabilities (Megatron's default: softmax over the top-k logits);
            # Qwen3-MoE only with norm_topk_prob; without it, softmax over all experts, then top-k
            "moe_router_pre_softmax": family.name == "qwen3_moe" and not cfg.norm_topk_prob,
            # as Megatron's args hold it after parsing: 1 (every layer), or one 0/1 per layer
            "moe_layer_freq": 1 if all(moe_layers) else [int(m) for m in moe_layers],
        })
        if cfg.shared_experts:
            args["moe_shared_expert_intermediate_size"] = cfg.shared_experts * int(cfg.moe_intermediate_size or 0)
        if cfg.scoring_func == "sigmoid":
            args.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                        moe_router_enable_expert_bias=True, moe_router_dtype="fp32")
        if cfg.n_group and cfg.n_group > 1:
            args.update(moe_router_num_groups=int(cfg.n_group), moe_router_group_topk=int(cfg.topk_group or 1))
        if cfg.routed_scaling_factor not in (None, 1, 1.0):
            args["moe_router_topk_scaling_factor"] = float(cfg.routed_scaling_factor)
    if cfg.dtype in ("bfloat16", "float16"):
        args["bf16" if cfg.dtype == "bfloat16" else "fp16"] = True
    return args


# -- the names ------------------------------------------------------------------------------------------------------
class Block(NamedTuple):  # (tuples: a DeepSeek-V3 is 31k mappings)
    """Rows ``src0 .. src0 + rows`` (dim 0) of HF tensor ``hf`` are rows ``dst0 ..`` of the Megatron tensor."""

    hf: str
    src0: int
    rows: int
    dst0: int


class Mapping(NamedTuple):
    """One Megatron tensor (a global legacy key) and the HF row blocks it is made of, in order (no blocks: an
    extra state, ``None``)."""

    key: str
    blocks: tuple[Block, ...]


def _stack(names: list[tuple[str, int, int]]) -> tuple[Block, ...]:
    """Blocks stacked along dim 0, each ``(hf, src0, rows)``."""
    out, at = [], 0
    for hf, src0, rows in names:
        out.append(Block(hf, src0, rows, at))
        at += rows
    return tuple(out)


def _heads_with_rope(hf: str, heads: int, plain: int, rope: int, interleaved: bool, base: int = 0) -> list[tuple]:
    """Row blocks of ``heads`` heads of ``plain + rope`` rows each from ``base``: the plain rows as they are, the
    rotary rows as they are when the model interleaves them (Megatron's MLA does too), else interleaved here."""
    out: list[tuple] = []
    half = rope // 2
    for h in range(heads):
        at = base + h * (plain + rope)
        if plain:
            out.append((hf, at, plain))
        if interleaved:
            out.append((hf, at + plain, rope))
        else:
            out += [(hf, at + plain + i + j * half, 1) for i in range(half) for j in (0, 1)]
    return out


def _qkv(prefix: str, what: str, cfg: HfConfig) -> tuple[Block, ...]:
    """Megatron's fused QKV rows, per query group: q heads, k head, v head."""
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    per = cfg.num_attention_heads // groups
    parts = []
    for g in range(groups):
        parts += [(f"{prefix}q_proj.{what}", g * per * hd, per * hd), (f"{prefix}k_proj.{what}", g * hd, hd),
                  (f"{prefix}v_proj.{what}", g * hd, hd)]
    return _stack(parts)


def mappings(family: Family, cfg: HfConfig, rows: dict[str, int],
             megatron_rows: dict[str, int] | None = None) -> list[Mapping]:
    """Every Megatron tensor of the model, in Megatron's state-dict order, with its HF blocks. ``rows``: each HF
    tensor's dim-0 size (from the safetensors headers); writing an HF model, ``megatron_rows`` instead: each Megatron
    tensor's (a copied tensor has its rows, each SwiGLU half half of them)."""

    def size(hf: str, key: str, parts: int) -> int:
        if megatron_rows is not None:
            return megatron_rows.get(key, 0) // parts
        return rows.get(hf, 0)

    def copy(key: str, hf: str) -> Mapping:
        return Mapping(key, _stack([(hf, 0, size(hf, key, 1))]))

    def glu(key: str, gate: str, up: str) -> Mapping:
        return Mapping(key, _stack([(gate, 0, size(gate, key, 2)), (up, 0, size(up, key, 2))]))

    out = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    if family.mla:
        for i, is_moe in enumerate(cfg.moe_layers()):
            out += _mla_layer(family, cfg, f"model.layers.{i}.", f"decoder.layers.{i}.", is_moe, copy, glu)
        out += [copy("decoder.final_layernorm.weight", "model.norm.weight"),
                Mapping("decoder.final_layernorm._extra_state", ())]
        for d in range(mtp_depth(cfg, rows) if megatron_rows is None else cfg.mtp_layers):
            hf, mg = f"model.layers.{cfg.num_layers + d}.", f"mtp.layers.{d}."
            for norm in ("enorm", "hnorm"):
                out += [copy(f"{mg}{norm}.weight", f"{hf}{norm}.weight"), Mapping(f"{mg}{norm}._extra_state", ())]
            out += [copy(mg + "eh_proj.weight", hf + "eh_proj.weight"), Mapping(mg + "eh_proj._extra_state", ())]
            out += _mla_layer(family, cfg, hf, mg + "mtp_model_layer.", cfg.moe, copy, glu)
            out += [copy(mg + "final_layernorm.weight", hf + "shared_head.norm.weight"),
                    Mapping(mg + "final_layernorm._extra_state", ())]
        if not cfg.tie_word_embeddings:
            out.append(copy("output_layer.weight", "lm_head.weight"))
        out.append(Mapping("output_layer._extra_state", ()))
        return out
    bias = qkv_bias(family, cfg)
    for i, is_moe in enumerate(cfg.moe_layers()):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out.append(copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight"))
        out.append(copy(mg + "self_attention.linear_proj.weight", attn + "o_proj.weight"))
        out.append(Mapping(mg + "self_attention.linear_proj._extra_state", ()))
        out.append(Mapping(mg + "self_attention.linear_qkv.weight", _qkv(attn, "weight", cfg)))
        if bias:
            out.append(Mapping(mg + "self_attention.linear_qkv.bias", _qkv(attn, "bias", cfg)))
        out.append(Mapping(mg + "self_attention.linear_qkv._extra_state", ()))
        if family.qk_norm:
            out.append(copy(mg + "self_attention.q_layernorm.weight", attn + "q_norm.weight"))
            out.append(copy(mg + "self_attention.k_layernorm.weight", attn + "k_norm.weight"))
        out.append(copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
        if is_moe:
            assert family.moe is not None and cfg.num_experts
            moe = hf + family.moe.block + "."
            out.append(copy(mg + "mlp.router.weight", moe + family.moe.gate + ".weight"))
            g, u, d = family.moe.experts
            for j in range(cfg.num_experts):
                e, me = f"{moe}experts.{j}.", f"{mg}mlp.experts.local_experts.{j}."
                out.append(glu(me + "linear_fc1.weight", f"{e}{g}.weight", f"{e}{u}.weight"))
                out.append(Mapping(me + "linear_fc1._extra_state", ()))
                out.append(copy(me + "linear_fc2.weight", f"{e}{d}.weight"))
                out.append(Mapping(me + "linear_fc2._extra_state", ()))
        else:
            out.append(glu(mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"))
            out.append(Mapping(mg + "mlp.linear_fc1._extra_state", ()))
            out.append(copy(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"))
            out.append(Mapping(mg + "mlp.linear_fc2._extra_state", ()))
    out.append(copy("decoder.final_layernorm.weight", "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        out.append(copy("output_layer.weight", "lm_head.weight"))
    out.append(Mapping("output_layer._extra_state", ()))
    return out


def mtp_depth(cfg: HfConfig, rows: dict[str, int]) -> int:
    """How many multi-token prediction layers the files hold (DeepSeek-V3 stores them after the decoder's layers;
    ``transformers`` drops them on save, so a model it wrote has none)."""
    return sum(1 for d in range(cfg.mtp_layers) if f"model.layers.{cfg.num_layers + d}.eh_proj.weight" in rows)


def _mla_layer(family: Family, cfg: HfConfig, hf: str, mg: str, is_moe: bool, copy: Any, glu: Any) -> list[Mapping]:
    """A DeepSeek-V3 layer under the Transformer Engine spec's names (Megatron builds MLA with it only): a separate
    input norm, the fused q/kv up projections' norms, sequential experts, shared experts, the router's expert bias."""
    attn, heads = hf + "self_attn.", cfg.num_attention_heads
    nope, rope, v = cfg.qk_nope_head_dim or 0, cfg.qk_rope_head_dim or 0, cfg.v_head_dim or 0
    inter = cfg.rope_interleave

    def extra(name: str) -> Mapping:
        return Mapping(mg + name + "._extra_state", ())

    out = [copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight"), extra("input_layernorm"),
           extra("self_attention.core_attention"),
           copy(mg + "self_attention.linear_proj.weight", attn + "o_proj.weight"), extra("self_attention.linear_proj")]
    if cfg.q_lora_rank:
        out += [copy(mg + "self_attention.linear_q_down_proj.weight", attn + "q_a_proj.weight"),
                extra("self_attention.linear_q_down_proj"),
                copy(mg + "self_attention.linear_q_up_proj.layer_norm_weight", attn + "q_a_layernorm.weight"),
                Mapping(mg + "self_attention.linear_q_up_proj.weight",
                        _stack(_heads_with_rope(attn + "q_b_proj.weight", heads, nope, rope, inter))),
                extra("self_attention.linear_q_up_proj")]
    else:
        out += [Mapping(mg + "self_attention.linear_q_proj.weight",
                        _stack(_heads_with_rope(attn + "q_proj.weight", heads, nope, rope, inter))),
                extra("self_attention.linear_q_proj")]
    kv_a = attn + "kv_a_proj_with_mqa.weight"
    out += [Mapping(mg + "self_attention.linear_kv_down_proj.weight",
                    _stack([(kv_a, 0, cfg.kv_lora_rank or 0)]
                           + _heads_with_rope(kv_a, 1, 0, rope, inter, base=cfg.kv_lora_rank or 0))),
            extra("self_attention.linear_kv_down_proj"),
            copy(mg + "self_attention.linear_kv_up_proj.layer_norm_weight", attn + "kv_a_layernorm.weight"),
            copy(mg + "self_attention.linear_kv_up_proj.weight", attn + "kv_b_proj.weight"),
            extra("self_attention.linear_kv_up_proj")]
    del v  # (kv_b_proj's rows per head, [k_nope, v], are Megatron's linear_kv_up_proj rows as they are)
    if not is_moe:
        return out + [copy(mg + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
                      glu(mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                      extra("mlp.linear_fc1"), copy(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
                      extra("mlp.linear_fc2")]
    assert family.moe is not None and cfg.num_experts
    moe = hf + family.moe.block + "."
    out += [copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"), extra("pre_mlp_layernorm"),
            copy(mg + "mlp.router.weight", moe + family.moe.gate + ".weight")]
    if cfg.scoring_func == "sigmoid":
        out.append(copy(mg + "mlp.router.expert_bias", moe + family.moe.gate + ".e_score_correction_bias"))
    g, u, d = family.moe.experts
    for j in range(cfg.num_experts):
        e, me = f"{moe}experts.{j}.", f"mlp.experts.local_experts.{j}."
        out += [glu(mg + me + "linear_fc1.weight", f"{e}{g}.weight", f"{e}{u}.weight"), extra(me + "linear_fc1"),
                copy(mg + me + "linear_fc2.weight", f"{e}{d}.weight"), extra(me + "linear_fc2")]
    if cfg.shared_experts:
        sh = moe + "shared_experts."
        out += [glu(mg + "mlp.shared_experts.linear_fc1.weight", sh + f"{g}.weight", sh + f"{u}.weight"),
                extra("mlp.shared_experts.linear_fc1"),
                copy(mg + "mlp.shared_experts.linear_fc2.weight", sh + f"{d}.weight"),
                extra("mlp.shared_experts.linear_fc2")]
    return out


def mtp_copies(cfg: HfConfig, megatron_rows: dict[str, int]) -> list[Mapping]:
    """What an HF DeepSeek-V3 file holds in each MTP layer beside its own weights: copies of the embedding and the
    head (Megatron's MTP shares the model's). Written by an export; read by nothing (see :func:`ignored`)."""
    head = "embedding.word_embeddings.weight" if cfg.tie_word_embeddings else "output_layer.weight"
    out = []
    for d in range(cfg.mtp_layers):
        layer = f"model.layers.{cfg.num_layers + d}."
        for key, hf in (("embedding.word_embeddings.weight", layer + "embed_tokens.weight"),
                        (head, layer + "shared_head.head.weight")):
            out.append(Mapping(key, _stack([(hf, 0, megatron_rows.get(key, 0))])))
    return out


def ignored(name: str, cfg: HfConfig) -> bool:
    """HF tensors that are not weights of the Megatron model: rotary buffers, a tied model's copy of the head, an MTP
    layer's copies of the embedding and the head (Megatron's MTP shares the model's)."""
    if name.endswith(BUFFERS) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return True
    return cfg.mtp_layers > 0 and any(name == f"model.layers.{cfg.num_layers + d}.{part}"
                                      for d in range(cfg.mtp_layers)
                                      for part in ("embed_tokens.weight", "shared_head.head.weight"))



# -- the other direction: a Megatron model as an HF architecture -----------------------------------------------------
def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def export_refusals(args: Any) -> list[str]:
    """Why no HF architecture of the table expresses the Megatron model of ``args`` (empty: one does)."""
    out = []
    if _arg(args, "position_embedding_type", "learned_absolute") != "rope":
        out.append(f"{_arg(args, 'position_embedding_type', 'learned_absolute')} position embeddings (the "
                   "architectures here use RoPE)")
    if not _arg(args, "swiglu", False):
        out.append("an MLP without SwiGLU (the architectures here gate with silu)")
    if str(_arg(args, "normalization", "LayerNorm")).lower() != "rmsnorm":
        out.append(f"{_arg(args, 'normalization', 'LayerNorm')} (the architectures here use RMSNorm)")
    if _arg(args, "add_bias_linear", True):
        out.append("biases on every linear layer (--disable-bias-linear was not given)")
    if float(_arg(args, "rotary_percent", 1.0)) != 1.0:
        out.append(f"RoPE on {_arg(args, 'rotary_percent')} of each head")
    if _arg(args, "apply_layernorm_1p", False) or _arg(args, "layernorm_zero_centered_gamma", False):
        out.append("zero-centred norm weights (--apply-layernorm-1p)")
    if _arg(args, "hybrid_layer_pattern") or _arg(args, "hybrid_override_pattern"):
        out.append("a HybridModel (Mamba / gated delta net layers)")
    if _arg(args, "num_experts") and _arg(args, "moe_shared_expert_intermediate_size") and \
            not _arg(args, "multi_latent_attention", False):
        out.append("shared experts without multi-latent attention (no architecture here has both)")
    if _arg(args, "mtp_num_layers") and not _arg(args, "multi_latent_attention", False):
        out.append("multi-token prediction layers without multi-latent attention (DeepSeek-V3's form)")
    return out


def fitting_families(args: Any) -> list[Family]:
    """The families that express the Megatron model of ``args`` (best first)."""
    mla, moe = bool(_arg(args, "multi_latent_attention", False)), bool(_arg(args, "num_experts"))
    qk, bias = bool(_arg(args, "qk_layernorm", False)), bool(_arg(args, "add_qkv_bias", False))
    by_name = {f.name: f for f in FAMILIES}
    if mla:
        return [by_name["deepseek_v3"]] if moe and _arg(args, "moe_router_score_function") == "sigmoid" and \
            _arg(args, "moe_router_enable_expert_bias", False) else []
    if moe:
        if _arg(args, "moe_router_score_function", "softmax") != "softmax":
            return []
        names = ["qwen3_moe"] if qk else ["mixtral", "qwen3_moe"]
        return [by_name[n] for n in names if not (bias and n == "mixtral")]
    if qk:
        return [] if bias else [by_name["qwen3"]]
    return [by_name["qwen2"]] if bias else [by_name["llama"]]


def family_for_args(args: Any, architecture: str | None, path: str) -> tuple[Family, str]:
    """(the family an export writes, the architecture it names): ``architecture`` (``--hf-architecture``) when it
    expresses the model, else the first that does; refused with the reason before anything is written."""
    reasons = export_refusals(args)
    fits = [] if reasons else fitting_families(args)
    if architecture is not None:
        chosen = next((f for f in FAMILIES if architecture in f.architectures), None)
        if chosen is None:
            raise UnsupportedModel(f"--hf-architecture {architecture} is not one the table writes", path=path,
                                   fix="one of: " + ", ".join(supported()), code="usage")
        if chosen not in fits:
            why = "; ".join(reasons) or "its attention, experts or norms differ from the model's"
            raise UnsupportedModel(f"{architecture} does not express this model ({why})", path=path,
                                   fix="leave --hf-architecture out" + (
                                       f" (this model writes as {fits[0].architectures[0]})" if fits else ""),
                                   code="hf_unsupported")
        return chosen, architecture
    if not fits:
        why = "; ".join(reasons) or "its combination of attention, experts and router has no HF architecture here"
        raise UnsupportedModel(f"no Hugging Face architecture here expresses this model: {why}", path=path,
                               fix="export it with a tool that maps this model, or keep it as a Megatron checkpoint",
                               code="hf_unsupported")
    return fits[0], fits[0].architectures[0]


def true_vocab(args: Any) -> int:
    """The model's real vocabulary rows (Megatron pads them to a multiple of its divisor × TP): the tokenizer's size
    (``NullTokenizer``: --vocab-size ids and the end-of-document one), else the padded rows."""
    vocab = _arg(args, "vocab_size")
    padded = int(_arg(args, "padded_vocab_size", 0) or 0)
    if vocab is None:
        return padded
    vocab = parallel.tokenizer_ids(int(vocab), _arg(args, "tokenizer_type"))
    return min(vocab, padded) if padded else vocab


def config_from_args(family: Family, args: Any, path: str, architecture: str | None = None) -> HfConfig:
    """The HF model (as :class:`HfConfig`) that holds the Megatron model of ``args``: the inverse of
    :func:`megatron_args`."""
    heads = int(_arg(args, "num_attention_heads"))
    hidden = int(_arg(args, "hidden_size"))
    layers = int(_arg(args, "num_layers"))
    moe_layers = None
    if _arg(args, "num_experts"):
        freq = _arg(args, "moe_layer_freq", 1)
        moe_layers = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(x) for x in freq]
    first_dense = 0
    if moe_layers is not None and family.mla:
        first_dense = next((i for i, m in enumerate(moe_layers) if m), layers)
    scaling = None
    if family.mla and _arg(args, "rope_type") == "yarn":
        scaling = RopeScaling("yarn", float(_arg(args, "rotary_scaling_factor", 1.0)), None, None, MLA_YARN_ORIGINAL,
                              32.0, 1.0, float(_arg(args, "mscale", 1.0)), float(_arg(args, "mscale_all_dim", 0.0)))
    elif _arg(args, "use_rope_scaling", False):
        scaling = RopeScaling("llama3", float(_arg(args, "rope_scaling_factor", 8.0)), **LLAMA3_FIXED)
    elif _arg(args, "rotary_seq_len_interpolation_factor"):
        scaling = RopeScaling("linear", float(_arg(args, "rotary_seq_len_interpolation_factor")))
    groups = int(_arg(args, "num_query_groups", heads) or heads) if _arg(args, "group_query_attention", False) \
        else heads
    dtype = "bfloat16" if _arg(args, "bf16", False) else "float16" if _arg(args, "fp16", False) else "float32"
    experts = _arg(args, "num_experts")
    return HfConfig(
        path=path, architecture=architecture or family.architectures[0], model_type=family.name,
        vocab_size=true_vocab(args),
        hidden_size=hidden, intermediate_size=int(_arg(args, "ffn_hidden_size", 4 * hidden)), num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=groups,
        head_dim=int(_arg(args, "kv_channels", hidden // heads) or hidden // heads),
        max_position_embeddings=_arg(args, "max_position_embeddings"),
        rope_theta=float(_arg(args, "rotary_base", 10000)), rope_scaling=scaling,
        norm_eps=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
        tie_word_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False), hidden_act="silu",
        attention_bias=bool(_arg(args, "add_qkv_bias", False)), mlp_bias=False, dtype=dtype,
        num_experts=int(experts) if experts else None, experts_per_token=_arg(args, "moe_router_topk", 2),
        moe_intermediate_size=_arg(args, "moe_ffn_hidden_size", _arg(args, "ffn_hidden_size")),
        norm_topk_prob=not _arg(args, "moe_router_pre_softmax", False),
        mlp_only_layers=tuple(i for i, m in enumerate(moe_layers or []) if not m) if not family.mla else (),
        q_lora_rank=_arg(args, "q_lora_rank"), kv_lora_rank=_arg(args, "kv_lora_rank") if family.mla else None,
        qk_nope_head_dim=_arg(args, "qk_head_dim"), qk_rope_head_dim=_arg(args, "qk_pos_emb_head_dim"),
        v_head_dim=_arg(args, "v_head_dim"), rope_interleave=True,
        shared_experts=(int(_arg(args, "moe_shared_expert_intermediate_size", 0) or 0)
                        // int(_arg(args, "moe_ffn_hidden_size", 1) or 1)) if family.mla else 0,
        first_k_dense=first_dense, n_group=_arg(args, "moe_router_num_groups"),
        topk_group=_arg(args, "moe_router_group_topk"),
        routed_scaling_factor=_arg(args, "moe_router_topk_scaling_factor"),
        scoring_func=_arg(args, "moe_router_score_function", "softmax"),
        mtp_layers=int(_arg(args, "mtp_num_layers", 0) or 0))


MODEL_TYPES = {"MistralForCausalLM": "mistral"}  # an architecture whose model_type is not its family's name


def config_json(family: Family, cfg: HfConfig) -> dict[str, Any]:
    """``config.json`` of the HF model ``cfg`` in the hub's spelling (read by transformers 4 and 5 alike)."""
    out: dict[str, Any] = {
        "architectures": [cfg.architecture], "model_type": MODEL_TYPES.get(cfg.architecture, family.name),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or 4096, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": cfg.dtype,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        sc = cfg.rope_scaling
        out["rope_scaling"] = {k: v for k, v in (("rope_type", sc.kind), ("factor", sc.factor),
                                                 ("low_freq_factor", sc.low_freq_factor),
                                                 ("high_freq_factor", sc.high_freq_factor),
                                                 ("original_max_position_embeddings",
                                                  sc.original_max_position_embeddings), ("beta_fast", sc.beta_fast),
                                                 ("beta_slow", sc.beta_slow), ("mscale", sc.mscale),
                                                 ("mscale_all_dim", sc.mscale_all_dim)) if v is not None}
    if family.name in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = bool(cfg.attention_bias)
    if family.name == "llama":
        out["mlp_bias"] = False
    if family.name in ("qwen2", "qwen3", "qwen3_moe", "mixtral"):
        out["use_sliding_window"], out["sliding_window"] = False, None
    if family.name == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=0.0, output_router_logits=False)
    if family.name == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob),
                   decoder_sparse_step=1, mlp_only_layers=list(cfg.mlp_only_layers), router_aux_loss_coef=0.0)
    if family.mla:
        out.pop("head_dim")
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=True,
                   n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.shared_experts,
                   first_k_dense_replace=cfg.first_k_dense, n_group=cfg.n_group or 1,
                   topk_group=cfg.topk_group or 1, routed_scaling_factor=cfg.routed_scaling_factor or 1.0,
                   norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                   num_nextn_predict_layers=cfg.mtp_layers)
    return out
