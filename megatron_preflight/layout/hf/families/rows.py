"""How each Megatron tensor is made of Hugging Face tensors: the row transforms a family's module composes.

Every Megatron tensor (a legacy key of the layer spec at TP1, PP1, EP1: the global tensor) is a stack along dim 0 of
row blocks of Hugging Face tensors (:class:`Block`); the other dims are whole. The transforms:

* ``copy`` — one HF tensor as is (norms, ``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2``, embeddings);
* ``glu``  — SwiGLU's fc1 is ``[gate; up]``: ``gate_proj`` rows, then ``up_proj`` rows;
* ``qkv``  — Megatron's fused QKV is grouped per query group: for each group ``g`` its ``q`` heads, then its one
  ``k`` head, then its ``v`` head (weight and bias alike);
* ``rope`` — DeepSeek's multi-latent attention rotates each head's rotary rows in interleaved pairs ``(2i, 2i+1)``
  (``rope_interleave``, the default), and so does Megatron's MLA (it de-interleaves before rotating halves): the rows
  are taken as they are. A model that rotates halves (``rope_interleave: false``) has its rows interleaved: row
  ``2i`` from ``i``, row ``2i + 1`` from ``i + d/2`` (measured: without it the loss differs from ``transformers``');
* ``experts`` — routed experts one by one (``experts.{j}.{gate,up,down}``), the router, its expert bias, the shared
  experts.

The same blocks read backwards split a Megatron tensor into its HF tensors, so a reader and a writer of HF models
share these rows. The layer spec's other names (Transformer Engine's fused norms, grouped experts) are the
resharder's bridge (:mod:`megatron_preflight.reshard.plan.spec`), not these rows'.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import NamedTuple

from megatron_preflight.layout.hf.config import HfConfig


class Block(NamedTuple):  # (tuples: a DeepSeek-V3 is 31k mappings)
    """Rows ``src0 .. src0 + rows`` (dim 0) of HF tensor ``hf`` are rows ``dst0 ..`` of the Megatron tensor."""

    hf: str
    src0: int
    rows: int
    dst0: int


class Mapping(NamedTuple):
    """One Megatron tensor (a global legacy key) and the HF row blocks it is made of, in order (no blocks: an
    extra state, ``None``); ``add``: a constant added to every value read (a norm weight that one side stores
    zero-centred and the other not: Qwen3-Next's gated delta net norm, ``w - 1`` in Megatron's zero-centred form)."""

    key: str
    blocks: tuple[Block, ...]
    add: float = 0.0


@dataclass(frozen=True)
class Moe:
    """Where a family keeps its MoE block and what it calls the expert projections."""

    block: str  # the module under each layer (``block_sparse_moe`` / ``mlp``)
    gate: str  # the router's linear
    experts: tuple[str, str, str]  # (gate, up, down) projection names of one expert
    shared: str = "shared_experts"  # the shared experts' module (when the config names any)
    bias: bool = False  # the router and every expert projection carry a bias (GPT-OSS; Megatron's add_bias_linear)


class Experts(NamedTuple):
    """A MoE layer's routed experts one by one, as one entry: expert ``j``'s fc1 (SwiGLU's ``[gate; up]``) and fc2
    (``down``) from HF ``{hf}{j}.{gate,up,down}.weight``, their biases and extra states, in Megatron's order — as
    sequential experts, ``{mg}{j}.linear_fc1.weight`` (expert by expert), or with ``grouped_linears`` as Transformer
    Engine's grouped linears, ``{mg}linear_fc1.weight{j}`` (every expert's fc1, its one extra state, then fc2).
    :meth:`mappings` gives the mapping of each Megatron tensor; discovery reads a regular layer's at once."""

    hf: str  # the HF experts' prefix, ``model.layers.{i}.mlp.experts.``
    mg: str  # the Megatron experts' prefix: ``decoder.layers.{i}.mlp.experts.local_experts.`` / ``...mlp.experts.``
    count: int
    projections: tuple[str, str, str]  # (gate, up, down) projection names of one expert
    bias: bool
    extras: bool
    grouped_linears: bool = False

    def names(self, what: str = "weight") -> tuple[list[str], list[str], list[str]]:
        """Every expert's HF (gate, up, down) tensor names of ``what``, in expert order."""
        return tuple([f"{self.hf}{j}.{p}.{what}" for j in range(self.count)]  # type: ignore[return-value]
                     for p in self.projections)

    def keys(self, fc: str, what: str = "weight") -> list[str]:
        """Every expert's Megatron key of ``fc`` (``linear_fc1`` / ``linear_fc2``) ``what``, in expert order."""
        if self.grouped_linears:
            return [f"{self.mg}{fc}.{what}{j}" for j in range(self.count)]
        return [f"{self.mg}{j}.{fc}.{what}" for j in range(self.count)]

    def extra_keys(self, fc: str) -> list[str]:
        """The extra states of ``fc``: one per expert, or one per grouped linear."""
        if self.grouped_linears:
            return [f"{self.mg}{fc}._extra_state"]
        return [f"{self.mg}{j}.{fc}._extra_state" for j in range(self.count)]

    def mappings(self, r: Rows) -> list[Mapping]:
        """The mapping of each expert tensor, in Megatron's order."""
        gate, up, down = self.names()
        fc1 = [r.glu(k, g, u) for k, g, u in zip(self.keys("linear_fc1"), gate, up, strict=True)]
        fc2 = [r.copy(k, d) for k, d in zip(self.keys("linear_fc2"), down, strict=True)]
        if self.bias:
            gate_b, up_b, down_b = self.names("bias")
            fc1_b = [r.glu(k, g, u) for k, g, u in zip(self.keys("linear_fc1", "bias"), gate_b, up_b, strict=True)]
            fc2_b = [r.copy(k, d) for k, d in zip(self.keys("linear_fc2", "bias"), down_b, strict=True)]
        extra1 = [Mapping(k, ()) for k in self.extra_keys("linear_fc1")] if self.extras else []
        extra2 = [Mapping(k, ()) for k in self.extra_keys("linear_fc2")] if self.extras else []
        if self.grouped_linears:
            return fc1 + (fc1_b if self.bias else []) + extra1 + fc2 + (fc2_b if self.bias else []) + extra2
        out: list[Mapping] = []
        for j in range(self.count):
            out += [fc1[j], *((fc1_b[j],) if self.bias else ()), *extra1[j:j + 1], fc2[j],
                    *((fc2_b[j],) if self.bias else ()), *extra2[j:j + 1]]
        return out


def stack(names: list[tuple[str, int, int]]) -> tuple[Block, ...]:
    """Blocks stacked along dim 0, each ``(hf, src0, rows)``."""
    out, at = [], 0
    for hf, src0, rows in names:
        out.append(Block(hf, src0, rows, at))
        at += rows
    return tuple(out)


class Rows:
    """The transforms for one direction: reading an HF model (``rows``: each HF tensor's dim-0 size, from the
    safetensors headers) or writing one (``megatron_rows``: each Megatron tensor's; a copied tensor has its rows,
    each SwiGLU half half of them). ``grouped``: a MoE layer's routed experts are one :class:`Experts` entry (the
    reader builds them a layer at a time), not a mapping each."""

    def __init__(self, rows: abc.Mapping[str, int], megatron_rows: dict[str, int] | None,
                 grouped: bool = False) -> None:
        self.rows, self.megatron_rows, self.grouped = rows, megatron_rows, grouped

    def size(self, hf: str, key: str, parts: int) -> int:
        if self.megatron_rows is not None:
            return self.megatron_rows.get(key, 0) // parts
        return self.rows.get(hf, 0)

    def copy(self, key: str, hf: str) -> Mapping:
        return Mapping(key, (Block(hf, 0, self.size(hf, key, 1), 0),))

    def glu(self, key: str, gate: str, up: str) -> Mapping:
        rows = self.size(gate, key, 2)
        return Mapping(key, (Block(gate, 0, rows, 0), Block(up, 0, self.size(up, key, 2), rows)))

    @staticmethod
    def extra(key: str) -> Mapping:
        return Mapping(key, ())


def heads_with_rope(hf: str, heads: int, plain: int, rope: int, interleaved: bool, base: int = 0) -> list[tuple]:
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


def qkv(prefix: str, what: str, cfg: HfConfig) -> tuple[Block, ...]:
    """Megatron's fused QKV rows, per query group: q heads, k head, v head."""
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    per = cfg.num_attention_heads // groups
    parts = []
    for g in range(groups):
        parts += [(f"{prefix}q_proj.{what}", g * per * hd, per * hd), (f"{prefix}k_proj.{what}", g * hd, hd),
                  (f"{prefix}v_proj.{what}", g * hd, hd)]
    return stack(parts)


def moe_block(r: Rows, moe: Moe, cfg: HfConfig, hf: str, mg: str, extras: bool) -> list[Mapping]:
    """A MoE layer's router (and its expert bias with a sigmoid router), its routed experts one by one and its shared
    experts, in Megatron's order; ``extras``: each linear's extra state."""
    block = hf + moe.block + "."
    out = [r.copy(mg + "mlp.router.weight", block + moe.gate + ".weight")]
    if moe.bias:
        out.append(r.copy(mg + "mlp.router.bias", block + moe.gate + ".bias"))
    if cfg.scoring_func == "sigmoid":
        out.append(r.copy(mg + "mlp.router.expert_bias", block + moe.gate + ".e_score_correction_bias"))
    g, u, d = moe.experts
    assert cfg.num_experts
    experts = Experts(block + "experts.", mg + "mlp.experts.local_experts.", cfg.num_experts, moe.experts, moe.bias,
                      extras)
    out += [experts] if r.grouped else experts.mappings(r)  # type: ignore[list-item]
    if cfg.shared_experts:
        sh, ms = block + moe.shared + ".", mg + "mlp.shared_experts."
        out += [r.glu(ms + "linear_fc1.weight", sh + f"{g}.weight", sh + f"{u}.weight"),
                r.extra(ms + "linear_fc1._extra_state"), r.copy(ms + "linear_fc2.weight", sh + f"{d}.weight"),
                r.extra(ms + "linear_fc2._extra_state")]
    return out


def gqa_layer(r: Rows, cfg: HfConfig, hf: str, mg: str, is_moe: bool, moe: Moe | None, bias: bool,
              qk_norm: bool, out_bias: bool = False, sinks: bool = False) -> list[Mapping]:
    """A grouped-query attention layer under the local spec's names: input norm, its attention sinks (Megatron's
    learnable softmax offset, one per head), the output projection (its bias), fused QKV (its bias), QK norms, the
    pre-MLP norm, then a SwiGLU MLP or a MoE block."""
    attn = hf + "self_attn."
    out = [r.copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight")]
    if sinks:
        out.append(r.copy(mg + "self_attention.core_attention.softmax_offset", attn + "sinks"))
    out.append(r.copy(mg + "self_attention.linear_proj.weight", attn + "o_proj.weight"))
    if out_bias:
        out.append(r.copy(mg + "self_attention.linear_proj.bias", attn + "o_proj.bias"))
    out += [r.extra(mg + "self_attention.linear_proj._extra_state"),
           Mapping(mg + "self_attention.linear_qkv.weight", qkv(attn, "weight", cfg))]
    if bias:
        out.append(Mapping(mg + "self_attention.linear_qkv.bias", qkv(attn, "bias", cfg)))
    out.append(r.extra(mg + "self_attention.linear_qkv._extra_state"))
    if qk_norm:
        out += [r.copy(mg + "self_attention.q_layernorm.weight", attn + "q_norm.weight"),
                r.copy(mg + "self_attention.k_layernorm.weight", attn + "k_norm.weight")]
    out.append(r.copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
    if is_moe:
        assert moe is not None
        return out + moe_block(r, moe, cfg, hf, mg, extras=True)
    return out + [r.glu(mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                  r.extra(mg + "mlp.linear_fc1._extra_state"),
                  r.copy(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
                  r.extra(mg + "mlp.linear_fc2._extra_state")]


def mla_layer(r: Rows, cfg: HfConfig, hf: str, mg: str, is_moe: bool, moe: Moe) -> list[Mapping]:
    """A DeepSeek-V3 layer under the Transformer Engine spec's names (Megatron builds MLA with it only): a separate
    input norm, the fused q/kv up projections' norms, sequential experts, shared experts, the router's expert bias."""
    attn, heads = hf + "self_attn.", cfg.num_attention_heads
    nope, rope = cfg.qk_nope_head_dim or 0, cfg.qk_rope_head_dim or 0
    inter = cfg.rope_interleave

    def extra(name: str) -> Mapping:
        return Mapping(mg + name + "._extra_state", ())

    out = [r.copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight"), extra("input_layernorm"),
           extra("self_attention.core_attention"),
           r.copy(mg + "self_attention.linear_proj.weight", attn + "o_proj.weight"), extra("self_attention.linear_proj")]
    if cfg.q_lora_rank:
        out += [r.copy(mg + "self_attention.linear_q_down_proj.weight", attn + "q_a_proj.weight"),
                extra("self_attention.linear_q_down_proj"),
                r.copy(mg + "self_attention.linear_q_up_proj.layer_norm_weight", attn + "q_a_layernorm.weight"),
                Mapping(mg + "self_attention.linear_q_up_proj.weight",
                        stack(heads_with_rope(attn + "q_b_proj.weight", heads, nope, rope, inter))),
                extra("self_attention.linear_q_up_proj")]
    else:
        out += [Mapping(mg + "self_attention.linear_q_proj.weight",
                        stack(heads_with_rope(attn + "q_proj.weight", heads, nope, rope, inter))),
                extra("self_attention.linear_q_proj")]
    kv_a = attn + "kv_a_proj_with_mqa.weight"
    # (kv_b_proj's rows per head, [k_nope, v], are Megatron's linear_kv_up_proj rows as they are)
    out += [Mapping(mg + "self_attention.linear_kv_down_proj.weight",
                    stack([(kv_a, 0, cfg.kv_lora_rank or 0)]
                          + heads_with_rope(kv_a, 1, 0, rope, inter, base=cfg.kv_lora_rank or 0))),
            extra("self_attention.linear_kv_down_proj"),
            r.copy(mg + "self_attention.linear_kv_up_proj.layer_norm_weight", attn + "kv_a_layernorm.weight"),
            r.copy(mg + "self_attention.linear_kv_up_proj.weight", attn + "kv_b_proj.weight"),
            extra("self_attention.linear_kv_up_proj")]
    if not is_moe:
        return out + [r.copy(mg + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
                      r.glu(mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                      extra("mlp.linear_fc1"), r.copy(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
                      extra("mlp.linear_fc2")]
    out += [r.copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"), extra("pre_mlp_layernorm")]
    return out + moe_block(r, moe, cfg, hf, mg, extras=True)


def te_mlp(r: Rows, mg: str, norm: str, fc1: Mapping, down: str) -> list[Mapping]:
    """A dense MLP under the Transformer Engine spec's names: its norm fused into fc1 (HF ``norm``), ``fc1`` (SwiGLU's
    halves or one projection), fc2 (HF ``down``), their extra states."""
    return [r.copy(mg + "mlp.linear_fc1.layer_norm_weight", norm), fc1, r.extra(mg + "mlp.linear_fc1._extra_state"),
            r.copy(mg + "mlp.linear_fc2.weight", down), r.extra(mg + "mlp.linear_fc2._extra_state")]


def hybrid_tail(r: Rows, cfg: HfConfig, norm: str) -> list[Mapping]:
    """A HybridModel's last tensors: its final norm (HF ``norm``, Transformer Engine's), the output layer unless tied
    to the embedding, its extra state."""
    out = [r.copy("decoder.final_norm.weight", norm), r.extra("decoder.final_norm._extra_state")]
    if not cfg.tie_word_embeddings:
        out.append(r.copy("output_layer.weight", "lm_head.weight"))
    return out + [r.extra("output_layer._extra_state")]
