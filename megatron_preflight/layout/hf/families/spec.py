"""What a family's module declares (:class:`Family`), the config rows every family shares (:data:`COMMON`), the
config keys that change what a model computes (:data:`MODEL_KEYS`), and the generic code that reads a declaration:
the Megatron args of an HF model, its Megatron tensors, and the way back (config.json of a Megatron model).

Nothing here branches on a family's name: what differs is declared in the family's own module."""

from __future__ import annotations

import math
from collections import abc
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf.config import HfConfig, Key, RopeScaling
from megatron_preflight.layout.hf.families.rows import Mapping, Moe, Rows, gqa_layer, mla_layer, stack
from megatron_preflight.layout.hf.stacked import Stacked

# the config rows every family has (a family overrides a row by declaring its field again: its default, its key)
COMMON = (
    Key("vocab_size", "vocab_size"), Key("hidden_size", "hidden_size"), Key("intermediate_size", "intermediate_size"),
    Key("num_hidden_layers", "num_layers"), Key("num_attention_heads", "num_attention_heads"),
    Key("num_key_value_heads", "num_key_value_heads", None), Key("head_dim", "head_dim", None),
    Key("max_position_embeddings", "max_position_embeddings", None),
    Key("rms_norm_eps", "norm_eps", 1e-6), Key("tie_word_embeddings", "tie_word_embeddings", False),
    Key("hidden_act", "hidden_act", "silu"), Key("rope_theta", "rope_theta", 10000.0),
    Key("rope_scaling", "rope_scaling", None, ("rope_parameters",)), Key("torch_dtype", "dtype", None, ("dtype",)),
)


def _falsy(v: Any, raw: dict) -> bool:
    return not v


def _one(v: Any, raw: dict) -> bool:
    return v is None or v == 1


# config.json keys that change what a model computes, each with the test of its neutral value: a family that does not
# declare one (a Key row, or its ``inert`` set) refuses a config that sets it otherwise (read as another model, it
# would train silently wrong). A key outside this table is not checked: the table is the list of known ones.
MODEL_KEYS: dict[str, Callable[[Any, dict], bool]] = {
    "partial_rotary_factor": _one, "use_qk_norm": _falsy, "attention_bias": _falsy, "mlp_bias": _falsy,
    "qkv_bias": _falsy, "hidden_activation": lambda v, raw: v in (None, "silu"),
    "attn_logit_softcapping": _falsy, "final_logit_softcapping": _falsy, "query_pre_attn_scalar": _falsy,
    "sliding_window": lambda v, raw: v is None or raw.get("use_sliding_window") is False,
    "layer_types": lambda v, raw: not v or all(t == "full_attention" for t in v),
    "n_shared_experts": _falsy, "shared_expert_intermediate_size": _falsy, "num_local_experts": _falsy,
    "num_experts": _falsy, "n_routed_experts": _falsy, "first_k_dense_replace": _falsy, "q_lora_rank": _falsy,
    "kv_lora_rank": _falsy, "routed_scaling_factor": _one, "use_mrope": _falsy, "mrope_section": _falsy,
    "embedding_multiplier": _one, "logits_scaling": _one, "residual_multiplier": _one,
    "attention_multiplier": _falsy, "decoder_sparse_step": _one, "mlp_only_layers": _falsy, "clip_qkv": _falsy,
    "scoring_func": lambda v, raw: v in (None, "softmax"), "use_qk_layernorm": _falsy, "qk_layernorm": _falsy,
    "num_nextn_predict_layers": _falsy, "moe_layer_freq": _one,
}


def _none(*_: Any) -> dict:
    return {}


def _nothing(*_: Any) -> list:
    return []


@dataclass(frozen=True)
class Wrapper:
    """A multimodal model as the hub publishes it whose language model is one of the family's text models (Qwen3.5:
    ``Qwen3_5MoeForConditionalGeneration`` holds a ``Qwen3_5MoeForCausalLM``): the text model's config.json is the
    wrapper's ``config_key`` object, its tensors are the text model's under ``prefix`` in place of ``model.`` (the
    head, ``lm_head.``, as it is), and the tensors under ``others`` (the ``what``) are no part of a Megatron GPT or
    hybrid run: not loaded, said in a note. transformers reads the language model of such a dir the same way (its
    text model class drops the prefix and ignores the rest), and an export writes the text model."""

    architecture: str
    text: str  # the family's architecture of the language model it holds
    prefix: str = "model.language_model."
    others: tuple[str, ...] = ("model.visual.",)
    what: str = "vision encoder"
    config_key: str = "text_config"
    head: str = "lm_head."  # where the files keep the text model's lm_head.
    # whether transformers' text model class reads these files itself (Qwen3.5's does; Kimi K2.5's custom code keeps
    # a whole DeepseekV3ForCausalLM under language_model., which no text class reads)
    text_reads: bool = True
    # top-level config.json keys the text model takes where its own object leaves them out (transformers' multimodal
    # configs keep the dtype and the tied head there)
    shared: tuple[str, ...] = ("torch_dtype", "dtype", "tie_word_embeddings")

    def text_config(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """The language model's config.json: the wrapper's ``config_key`` object, with the top-level keys it leaves
        out (:attr:`shared`), naming the text architecture. A key set at both levels to different values is refused
        (transformers' multimodal class reads the top level, its text model class the object: they would differ)."""
        text = raw.get(self.config_key)
        if not isinstance(text, dict):
            raise PreflightError(f"config.json names {self.architecture} but holds no {self.config_key} object (the "
                                 "language model's config)", path=path, fix="download config.json again",
                                 code="hf_config")
        out = dict(text)
        for name in self.shared:
            top = raw.get(name)
            if top is None:
                continue
            if out.get(name) is None:
                out[name] = top
            elif out[name] != top:
                raise PreflightError(f"config.json's {name} is {top!r} and its {self.config_key}.{name} is "
                                     f"{out[name]!r}: {self.architecture} reads the first, its language model class "
                                     f"({self.text}) the second", path=path,
                                     fix="set both to the model's value (download config.json again)",
                                     code="hf_config")
        out["architectures"] = [self.text]
        return out

    def stored(self, name: str) -> str:
        """The name the wrapper's files give the text model's tensor ``name``."""
        if name.startswith(TEXT_PREFIX):
            return self.prefix + name[len(TEXT_PREFIX):]
        return self.head + name[len(HEAD):] if name.startswith(HEAD) else name

    def own(self, name: str) -> str:
        """The text model's name of the wrapper's tensor ``name`` (the inverse of :meth:`stored`)."""
        if name.startswith(self.prefix):
            return TEXT_PREFIX + name[len(self.prefix):]
        return HEAD + name[len(self.head):] if name.startswith(self.head) else name


TEXT_PREFIX = "model."  # the text models' own prefix (a wrapper's ``prefix`` stands in its place)
HEAD = "lm_head."  # the text models' head (a wrapper's ``head``)


@dataclass(frozen=True)
class Family:
    """One family's declaration: the HF architectures it covers, its config table, its tensor rows and what it
    refuses. Its module holds everything that differs from the shared code here."""

    name: str  # model_type an export writes
    architectures: tuple[str, ...]
    keys: tuple[Key, ...]  # its config table: COMMON's rows overridden and extended by its own
    attention: str = "gqa"  # "gqa" (fused QKV, local spec) or "mla" (multi-latent, Transformer Engine spec)
    qkv_bias: str = "config"  # "always" (Qwen2), "config" (attention_bias), "never"
    qk_norm: str = "never"  # "always" (Qwen3), "config" (use_qk_norm), "never"
    moe: Moe | None = None
    fixed: dict[str, Any] = field(default_factory=dict)  # fields the architecture fixes whatever the config says
    model_types: dict[str, str] = field(default_factory=dict)  # architecture -> model_type, where not ``name``
    # family-specific: Megatron args beside the generic ones; config.json keys beside its table's; refusals
    args: Callable[[HfConfig], dict[str, Any]] = _none
    json: Callable[[HfConfig], dict[str, Any]] = _none
    refuse: Callable[[HfConfig], list[str]] = _nothing
    # export: whether it expresses the Megatron model of ``args`` (a Namespace), and its rank among those that do
    expresses: Callable[[Any], bool] = lambda args: False
    rank: int = 100
    acts: tuple[str, ...] = ("silu", "swish")  # the MLP activations (config's hidden_act) it takes
    # its own tensors, where they are not a GPT model's layers (a hybrid model): (rows, cfg) -> mappings
    tensors: Callable[[Rows, HfConfig], list[Mapping]] | None = None
    impl: str = ""  # the layer spec Megatron builds it with ("": Transformer Engine's for MLA, else local)
    inert: frozenset[str] = frozenset()  # config keys its transformers class reads for nothing this family maps
    unloaded: tuple[str, ...] = ()  # prefixes of HF tensors its files may hold that are not loaded (said in a note)
    # export: its fields from a Megatron model's args where the generic inverse of ``args`` does not give them
    back: Callable[[dict[str, Any], Any], dict[str, Any]] = lambda values, args: values
    stacked: tuple[Stacked, ...] = ()  # its experts' tensors stored stacked, one per layer (layout/hf/stacked.py)
    linear_bias: bool = False  # every linear carries a bias (Megatron's add_bias_linear; GPT-OSS)
    sinks: bool = False  # attention sinks: a learnable logit per head in each softmax (--softmax-type learnable)
    wrappers: tuple[Wrapper, ...] = ()  # the multimodal models on the hub whose language model is this family's

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def transformer_impl(self) -> str:
        return self.impl or ("transformer_engine" if self.mla else "local")

    def declares(self, name: str) -> bool:
        """Whether the family's config table reads field ``name``."""
        return any(k.field == name for k in self.keys)

    def config_keys(self) -> frozenset[str]:
        """Every config.json key the family reads."""
        return frozenset(n for k in self.keys for n in k.names) | {"rope_theta", "rope_parameters", "rope_scaling"} \
            | self.inert


def table(*own: Key, without: tuple[str, ...] = ()) -> tuple[Key, ...]:
    """COMMON's rows (less the fields ``without``) with ``own`` replacing those of the same field, then the rest of
    ``own``."""
    mine = {k.field: k for k in own}
    return tuple(mine.pop(k.field, k) for k in COMMON if k.field not in without) + tuple(mine.values())


def key(family: Family, name: str) -> Key:
    return next(k for k in family.keys if k.field == name)


def undeclared(family: Family, raw: dict[str, Any]) -> list[str]:
    """The keys of ``raw`` that change what a model computes, set to a non-neutral value, that ``family`` does not read
    (each a reason the model is refused)."""
    read = family.config_keys()
    out = []
    for name, neutral in MODEL_KEYS.items():
        if name in raw and name not in read and not neutral(raw[name], raw):
            out.append(f"config.json's {name} = {raw[name]!r:.60} (the {family.name} family here does not read it, "
                       "and it changes what the model computes)")
    return out


def qkv_bias(family: Family, cfg: HfConfig) -> bool:
    return family.qkv_bias == "always" or (family.qkv_bias == "config" and bool(cfg.attention_bias))


def qk_norm(family: Family, cfg: HfConfig) -> bool:
    return family.qk_norm == "always" or (family.qk_norm == "config" and bool(cfg.qk_norm))


MAX_TP = 8  # the vocab is kept unpadded up to this TP
# the layer spec a HybridModel family's run names (--spec): Megatron's Transformer Engine hybrid stack
HYBRID_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
MLA_YARN_ORIGINAL = 4096  # MLATransformerConfig's original_max_position_embeddings (no flag sets it for MLA)
# what Megatron's RotaryEmbedding applies with --use-rope-scaling besides the factor (no flag sets them)
LLAMA3_FIXED: dict[str, Any] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def refusals(family: Family, cfg: HfConfig) -> list[str]:
    """What in this model Megatron's GPT model cannot express (each a reason; empty: it can)."""
    out = undeclared(family, cfg.raw) + list(family.refuse(cfg))
    if cfg.rotary_percent != 1.0 and not family.declares("rotary_percent"):
        out.append(f"RoPE on {cfg.rotary_percent} of each head (partial_rotary_factor: the {family.name} family here "
                   "rotates whole heads)")
    if cfg.hidden_act not in family.acts:
        out.append(f"hidden_act {cfg.hidden_act!r} (the {family.name} family here takes " + " / ".join(family.acts)
                   + ("; Megatron's gated MLP here is SwiGLU: silu)" if "silu" in family.acts else ")"))
    if cfg.mlp_bias:
        out.append("mlp_bias: the MLP projections have biases, which Megatron adds only with every linear's bias")
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
    elif sc is not None and sc.kind == "yarn":
        if sc.attention_factor is not None and abs(sc.attention_factor - yarn_attention_factor(cfg)) > 1e-9:
            out.append(f"YaRN's attention_factor {sc.attention_factor} (Megatron scales attention by "
                       f"{yarn_attention_factor(cfg):.6g} from the factor and mscales: no flag sets it)")
    elif sc is not None and sc.kind != "linear":
        out.append(f"RoPE scaling {sc.kind!r} (Megatron's GPT model applies llama3 scaling (--use-rope-scaling), "
                   "linear interpolation (--rotary-seq-len-interpolation-factor) and YaRN)")
    if sc is not None and sc.kind == "linear" and sc.factor is not None and float(sc.factor) != int(sc.factor):
        out.append(f"linear RoPE scaling by {sc.factor} (Megatron takes an integer factor)")
    if cfg.num_attention_heads % cfg.num_key_value_heads and not family.mla:
        out.append(f"{cfg.num_attention_heads} heads do not group over {cfg.num_key_value_heads} key-value heads")
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        out.append(f"the router's scoring function {cfg.scoring_func!r}")
    if cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob is False and (cfg.experts_per_token or 1) > 1:
        out.append("sigmoid routing without norm_topk_prob (Megatron normalises the top-k sigmoid scores)")
    if cfg.moe and (cfg.n_group or 1) > 1 and cfg.scoring_func == "sigmoid" \
            and (cfg.experts_per_token or 1) // (cfg.topk_group or 1) != GROUP_RANK:
        out.append(f"grouped routing with num_experts_per_tok {cfg.experts_per_token} over topk_group "
                   f"{cfg.topk_group}: the model ranks each expert group by its top {GROUP_RANK} scores, Megatron by "
                   f"its top num_experts_per_tok // topk_group = {(cfg.experts_per_token or 1) // (cfg.topk_group or 1)}")
    return out


GROUP_RANK = 2  # how many of a group's expert scores rank the group (DeepSeek-V3's and NemotronH's routers: the top 2)


def _yarn_mscales(sc: RopeScaling) -> tuple[float, float]:
    """(mscale, mscale_all_dim) as Megatron takes them: transformers divides the two scales only when both are set
    (else it scales by ``0.1 ln(factor) + 1``: Megatron's with its defaults 1 and 0)."""
    if sc.mscale and sc.mscale_all_dim:
        return float(sc.mscale), float(sc.mscale_all_dim)
    return 1.0, 0.0


def _yarn_factor(cfg: HfConfig) -> float:
    sc = cfg.rope_scaling
    assert sc is not None
    if sc.factor is not None:
        return float(sc.factor)
    orig = sc.original_max_position_embeddings or cfg.max_position_embeddings or 1
    return float((cfg.max_position_embeddings or orig) / orig)


def yarn_attention_factor(cfg: HfConfig) -> float:
    """The attention scale YaRN applies (transformers' and Megatron's formula alike)."""
    sc = cfg.rope_scaling
    assert sc is not None
    factor = _yarn_factor(cfg)
    mscale, all_dim = _yarn_mscales(sc)

    def m(scale: float, k: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    return m(factor, mscale) / m(factor, all_dim)


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
        else cfg.rope_theta, "rotary_percent": cfg.rotary_percent,
        "use_rope_scaling": False, "rotary_seq_len_interpolation_factor": None,
        "normalization": "RMSNorm", "norm_epsilon": cfg.norm_eps, "swiglu": True,
        "add_bias_linear": family.linear_bias, "add_qkv_bias": qkv_bias(family, cfg), "qk_layernorm": qk_norm(family, cfg),
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
    sc = cfg.rope_scaling
    if sc is not None and sc.kind == "yarn" and not family.mla:  # Megatron-LM main's GPT YaRN
        mscale, all_dim = _yarn_mscales(sc)
        args.update(position_embedding_type="yarn", rotary_scaling_factor=_yarn_factor(cfg),
                    yarn_original_max_position_embeddings=int(sc.original_max_position_embeddings
                                                              or cfg.max_position_embeddings or 4096),
                    yarn_beta_fast=float(sc.beta_fast or 32.0), yarn_beta_slow=float(sc.beta_slow or 1.0),
                    yarn_correction_range_round_to_int=sc.truncate is not False, mscale=mscale,
                    mscale_all_dim=all_dim)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        args["use_rope_scaling"] = True
        args["rope_scaling_factor"] = cfg.rope_scaling.factor
    elif cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        args["rotary_seq_len_interpolation_factor"] = int(cfg.rope_scaling.factor or 1)
    if cfg.moe:
        args.update({
            "num_experts": cfg.num_experts, "moe_router_topk": int(cfg.experts_per_token or 2),
            "moe_ffn_hidden_size": int(cfg.moe_intermediate_size or cfg.intermediate_size),
            # Megatron's default: softmax over the top-k logits (= the top-k probabilities renormalised)
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
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
    args.update(family.args(cfg))
    return args


# -- the tensors ----------------------------------------------------------------------------------------------------
def mtp_depth(cfg: HfConfig, rows: Container[str]) -> int:
    """How many multi-token prediction layers the files hold (DeepSeek-V3 and GLM-4.5 store them after the decoder's
    layers; ``transformers`` drops them on save, so a model it wrote has none). ``rows``: the names of its tensors."""
    return sum(1 for d in range(cfg.mtp_layers) if f"model.layers.{cfg.num_layers + d}.eh_proj.weight" in rows)


def layer(family: Family, r: Rows, cfg: HfConfig, hf: str, mg: str, is_moe: bool) -> list[Mapping]:
    if family.mla:
        assert family.moe is not None
        return mla_layer(r, cfg, hf, mg, is_moe, family.moe)
    return gqa_layer(r, cfg, hf, mg, is_moe, family.moe, qkv_bias(family, cfg), qk_norm(family, cfg),
                     out_bias=family.linear_bias, sinks=family.sinks)


def mappings(family: Family, cfg: HfConfig, rows: abc.Mapping[str, int],
             megatron_rows: dict[str, int] | None = None, grouped: bool = False) -> list[Mapping]:
    """Every Megatron tensor of the model, in Megatron's state-dict order, with its HF blocks. ``rows``: each HF
    tensor's dim-0 size (from the safetensors headers); writing an HF model, ``megatron_rows`` instead: each Megatron
    tensor's. ``grouped``: each MoE layer's routed experts as one :class:`~.rows.Experts` entry in the list."""
    r = Rows(rows, megatron_rows, grouped)
    if family.tensors is not None:
        return family.tensors(r, cfg)
    out = [r.copy("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i, is_moe in enumerate(cfg.moe_layers()):
        out += layer(family, r, cfg, f"model.layers.{i}.", f"decoder.layers.{i}.", is_moe)
    out.append(r.copy("decoder.final_layernorm.weight", "model.norm.weight"))
    if family.mla:  # (the Transformer Engine spec's norm)
        out.append(r.extra("decoder.final_layernorm._extra_state"))
    for d in range(mtp_depth(cfg, rows) if megatron_rows is None else cfg.mtp_layers):
        hf, mg = f"model.layers.{cfg.num_layers + d}.", f"mtp.layers.{d}."
        for norm in ("enorm", "hnorm"):
            out.append(r.copy(f"{mg}{norm}.weight", f"{hf}{norm}.weight"))
            if family.mla:
                out.append(r.extra(f"{mg}{norm}._extra_state"))
        out += [r.copy(mg + "eh_proj.weight", hf + "eh_proj.weight"), r.extra(mg + "eh_proj._extra_state")]
        out += layer(family, r, cfg, hf, mg + "mtp_model_layer.", cfg.moe)
        out.append(r.copy(mg + "final_layernorm.weight", hf + "shared_head.norm.weight"))
        if family.mla:
            out.append(r.extra(mg + "final_layernorm._extra_state"))
    if not cfg.tie_word_embeddings:
        out.append(r.copy("output_layer.weight", "lm_head.weight"))
    out.append(r.extra("output_layer._extra_state"))
    return out


def mtp_copies(cfg: HfConfig, megatron_rows: dict[str, int]) -> list[Mapping]:
    """What an HF file holds in each MTP layer beside its own weights: copies of the embedding and the head
    (Megatron's MTP shares the model's). Written by an export; read by nothing (see :func:`ignored`)."""
    head = "embedding.word_embeddings.weight" if cfg.tie_word_embeddings else "output_layer.weight"
    out = []
    for d in range(cfg.mtp_layers):
        layer_ = f"model.layers.{cfg.num_layers + d}."
        for k, hf in (("embedding.word_embeddings.weight", layer_ + "embed_tokens.weight"),
                      (head, layer_ + "shared_head.head.weight")):
            out.append(Mapping(k, stack([(hf, 0, megatron_rows.get(k, 0))])))
    return out


BUFFERS = (".rotary_emb.inv_freq",)  # tensors some HF checkpoints carry that are buffers, not weights


def ignored(name: str, cfg: HfConfig) -> bool:
    """HF tensors that are not weights of the Megatron model: rotary buffers, a tied model's copy of the head, an MTP
    layer's copies of the embedding and the head (Megatron's MTP shares the model's)."""
    if name.endswith(BUFFERS) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return True
    return cfg.mtp_layers > 0 and any(name == f"model.layers.{cfg.num_layers + d}.{part}"
                                      for d in range(cfg.mtp_layers)
                                      for part in ("embed_tokens.weight", "shared_head.head.weight"))


# -- the way back: a Megatron model as an HF config ------------------------------------------------------------------
def arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def true_vocab(args: Any) -> int:
    """The model's real vocabulary rows (Megatron pads them to a multiple of its divisor × TP): the tokenizer's size
    (``NullTokenizer``: --vocab-size ids and the end-of-document one), else the padded rows."""
    vocab = arg(args, "vocab_size")
    padded = int(arg(args, "padded_vocab_size", 0) or 0)
    if vocab is None:
        return padded
    vocab = parallel.tokenizer_ids(int(vocab), arg(args, "tokenizer_type"))
    return min(vocab, padded) if padded else vocab


def config_from_args(family: Family, args: Any, path: str, architecture: str | None = None) -> HfConfig:
    """The HF model (as :class:`HfConfig`) that holds the Megatron model of ``args``: the inverse of
    :func:`megatron_args`, for the fields the family declares (the others keep their neutral values)."""
    heads = int(arg(args, "num_attention_heads"))
    hidden = int(arg(args, "hidden_size"))
    layers = int(arg(args, "num_layers"))
    moe_layers = None
    if arg(args, "num_experts"):
        freq = arg(args, "moe_layer_freq", 1)
        moe_layers = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(x) for x in freq]
    scaling = None
    if family.mla and arg(args, "rope_type") == "yarn":
        scaling = RopeScaling("yarn", float(arg(args, "rotary_scaling_factor", 1.0)), None, None, MLA_YARN_ORIGINAL,
                              32.0, 1.0, float(arg(args, "mscale", 1.0)), float(arg(args, "mscale_all_dim", 0.0)))
    elif arg(args, "position_embedding_type") == "yarn":
        scaling = RopeScaling("yarn", float(arg(args, "rotary_scaling_factor", 1.0)), None, None,
                              int(arg(args, "yarn_original_max_position_embeddings", 4096)),
                              float(arg(args, "yarn_beta_fast", 32.0)), float(arg(args, "yarn_beta_slow", 1.0)),
                              *((float(arg(args, "mscale")), float(arg(args, "mscale_all_dim")))
                                if arg(args, "mscale", 1.0) and arg(args, "mscale_all_dim", 0.0) else (None, None)),
                              truncate=bool(arg(args, "yarn_correction_range_round_to_int", True)))
    elif arg(args, "use_rope_scaling", False):
        scaling = RopeScaling("llama3", float(arg(args, "rope_scaling_factor", 8.0)), **LLAMA3_FIXED)
    elif arg(args, "rotary_seq_len_interpolation_factor"):
        scaling = RopeScaling("linear", float(arg(args, "rotary_seq_len_interpolation_factor")))
    groups = int(arg(args, "num_query_groups", heads) or heads) if arg(args, "group_query_attention", False) \
        else heads
    dtype = "bfloat16" if arg(args, "bf16", False) else "float16" if arg(args, "fp16", False) else "float32"
    experts = arg(args, "num_experts")
    values: dict[str, Any] = dict(
        vocab_size=true_vocab(args), hidden_size=hidden, intermediate_size=int(arg(args, "ffn_hidden_size", 4 * hidden)),
        num_layers=layers, num_attention_heads=heads, num_key_value_heads=groups,
        head_dim=int(arg(args, "kv_channels", hidden // heads) or hidden // heads),
        max_position_embeddings=arg(args, "max_position_embeddings"),
        rope_theta=float(arg(args, "rotary_base", 10000)), rope_scaling=scaling,
        rotary_percent=float(arg(args, "rotary_percent", 1.0)),
        norm_eps=float(arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5))),
        tie_word_embeddings=not arg(args, "untie_embeddings_and_output_weights", False), hidden_act="silu",
        attention_bias=bool(arg(args, "add_qkv_bias", False)), mlp_bias=False, dtype=dtype,
        qk_norm=bool(arg(args, "qk_layernorm", False)),
        num_experts=int(experts) if experts else None, experts_per_token=arg(args, "moe_router_topk", 2),
        moe_intermediate_size=arg(args, "moe_ffn_hidden_size", arg(args, "ffn_hidden_size")),
        norm_topk_prob=not arg(args, "moe_router_pre_softmax", False),
        mlp_only_layers=tuple(i for i, m in enumerate(moe_layers or []) if not m),
        first_k_dense=next((i for i, m in enumerate(moe_layers or []) if m), layers) if moe_layers else 0,
        q_lora_rank=arg(args, "q_lora_rank"), kv_lora_rank=arg(args, "kv_lora_rank"),
        qk_nope_head_dim=arg(args, "qk_head_dim"), qk_rope_head_dim=arg(args, "qk_pos_emb_head_dim"),
        v_head_dim=arg(args, "v_head_dim"), rope_interleave=True,
        shared_experts=(int(arg(args, "moe_shared_expert_intermediate_size", 0) or 0)
                        // int(arg(args, "moe_ffn_hidden_size", 1) or 1)),
        n_group=arg(args, "moe_router_num_groups"), topk_group=arg(args, "moe_router_group_topk"),
        routed_scaling_factor=arg(args, "moe_router_topk_scaling_factor"),
        scoring_func=arg(args, "moe_router_score_function", "softmax"),
        mtp_layers=int(arg(args, "mtp_num_layers", 0) or 0), moe_latent=arg(args, "moe_latent_size"))
    pattern = parallel.hybrid_pattern(args)
    if pattern:  # a HybridModel: its layers in order, its Mamba-2 mixers (Megatron's d_inner: 2 x hidden)
        head_dim = int(arg(args, "mamba_head_dim", 64))
        values.update(hybrid_pattern=parallel.hybrid_layers(pattern), mamba_head_dim=head_dim,
                      mamba_heads=int(arg(args, "mamba_num_heads", 0) or 2 * hidden // head_dim),
                      mamba_state=int(arg(args, "mamba_state_dim", 128)),
                      mamba_groups=int(arg(args, "mamba_num_groups", 8)), mamba_conv=4)
    if arg(args, "squared_relu", False):
        values["hidden_act"] = "relu2"
    values = family.back(values, args)
    declared = {k.field for k in family.keys} | {"rope_scaling", "rotary_percent", "dtype"}
    kept = {k: v for k, v in values.items() if k in declared or k in REQUIRED_FIELDS}
    kept.update(family.fixed)
    return HfConfig(path=path, architecture=architecture or family.architectures[0], model_type=family.name, **kept)


# HfConfig's fields without a neutral value (given whatever the family declares)
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "attention_bias")


def _scaling_json(sc: RopeScaling) -> dict[str, Any]:
    return {k: v for k, v in (("rope_type", sc.kind), ("factor", sc.factor), ("low_freq_factor", sc.low_freq_factor),
                              ("high_freq_factor", sc.high_freq_factor),
                              ("original_max_position_embeddings", sc.original_max_position_embeddings),
                              ("beta_fast", sc.beta_fast), ("beta_slow", sc.beta_slow), ("mscale", sc.mscale),
                              ("mscale_all_dim", sc.mscale_all_dim), ("truncate", sc.truncate)) if v is not None}


def config_json(family: Family, cfg: HfConfig) -> dict[str, Any]:
    """``config.json`` of the HF model ``cfg`` in the hub's spelling (read by transformers 4 and 5 alike): each row of
    the family's config table written back under its key, then the family's constant keys."""
    out: dict[str, Any] = {"architectures": [cfg.architecture],
                           "model_type": family.model_types.get(cfg.architecture, family.name)}
    for k in family.keys:
        if k.field in family.fixed:
            continue
        value = getattr(cfg, k.field)
        if k.field == "rope_scaling":
            if value is not None:
                out[k.hf] = _scaling_json(value)
            continue
        if k.field == "max_position_embeddings" and value is None:
            value = 4096
        if k.field == "n_group" or k.field == "topk_group":
            value = value or 1
        if k.field == "routed_scaling_factor":
            value = value or 1.0
        out[k.hf] = list(value) if isinstance(value, tuple) else value
    out.update(attention_dropout=0.0, initializer_range=0.02, use_cache=True)
    out.update(family.json(cfg))
    return out



class Traits(NamedTuple):
    """What tells the families apart in a Megatron model's args (an export's choice of architecture)."""

    mla: bool
    moe: bool
    qk_norm: bool
    qkv_bias: bool
    sigmoid: bool  # a sigmoid router (DeepSeek-V3, GLM-4.5)
    expert_bias: bool  # the router's expert bias (theirs too)
    pre_softmax: bool  # softmax over all experts before the top-k (Qwen3-MoE without norm_topk_prob)
    shared: bool  # shared experts
    partial_rope: bool  # RoPE on part of each head
    mtp: bool  # multi-token prediction layers
    hybrid: bool  # a HybridModel (a layer pattern)
    gated: bool  # a SwiGLU MLP
    zero_centred: bool  # zero-centred norm weights (--apply-layernorm-1p: Qwen3-Next's)


def traits(args: Any) -> Traits:
    moe = bool(arg(args, "num_experts"))
    return Traits(
        mla=bool(arg(args, "multi_latent_attention", False)), moe=moe, qk_norm=bool(arg(args, "qk_layernorm", False)),
        qkv_bias=bool(arg(args, "add_qkv_bias", False)),
        sigmoid=moe and arg(args, "moe_router_score_function", "softmax") == "sigmoid",
        expert_bias=moe and bool(arg(args, "moe_router_enable_expert_bias", False)),
        pre_softmax=moe and bool(arg(args, "moe_router_pre_softmax", False)),
        shared=moe and bool(arg(args, "moe_shared_expert_intermediate_size")),
        partial_rope=float(arg(args, "rotary_percent", 1.0)) != 1.0, mtp=bool(arg(args, "mtp_num_layers")),
        hybrid=bool(parallel.hybrid_pattern(args)), gated=bool(arg(args, "swiglu", False)),
        zero_centred=bool(arg(args, "apply_layernorm_1p", False) or arg(args, "layernorm_zero_centered_gamma", False)))


def gpt(t: Traits) -> bool:
    """A GPT model (not a hybrid one) with SwiGLU MLPs and plain norm weights."""
    return t.gated and not t.hybrid and not t.zero_centred


def plain_dense(t: Traits) -> bool:
    """A dense GQA model with RoPE on whole heads and no MTP layers (what Llama, Qwen2 and Qwen3 share)."""
    return gpt(t) and not (t.mla or t.moe or t.partial_rope or t.mtp)


def softmax_moe(t: Traits) -> bool:
    """A GQA MoE model with a softmax router, no shared experts, RoPE on whole heads, no MTP layers."""
    return gpt(t) and t.moe and not (t.mla or t.sigmoid or t.expert_bias or t.shared or t.partial_rope or t.mtp)
