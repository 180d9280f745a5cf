"""A Hugging Face ``config.json`` normalised into one :class:`HfConfig`, through the config table of the model's family
(:class:`Key` rows, declared in each family's module under :mod:`.families`): the hub's spellings (transformers 4:
``rope_theta`` and ``rope_scaling``) and transformers 5's (``rope_parameters``) alike.

Only what the family declares is read, each field typed and bounded before it is used; a field the family does not
declare keeps :class:`HfConfig`'s neutral value (never another family's default), and a key that changes what a model
computes but that the family does not read is refused (:data:`MODEL_KEYS`), never dropped silently."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight.errors import CorruptFileError, PreflightError
from megatron_preflight.layout.hf import files
from megatron_preflight.layout.hf.names import CONFIG


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``kind`` is transformers' ``rope_type`` (``llama3``, ``yarn``, ``linear``, ...)."""

    kind: str
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # YaRN's (DeepSeek-V3: factor 40, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1, from 4,096 positions)
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # YaRN: round the correction range to whole dims (transformers' default: yes)
    attention_factor: float | None = None  # YaRN: the attention scale, where config.json fixes it


@dataclass(frozen=True)
class HfConfig:
    """The model described by ``config.json`` (None: not given by the config)."""

    path: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # (below: the neutral value of a field the family does not declare)
    max_position_embeddings: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool | None = None
    mlp_bias: bool = False
    dtype: str | None = None
    num_experts: int | None = None
    experts_per_token: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    # DeepSeek-V3: multi-latent attention, shared experts, a sigmoid router with expert bias and groups, dense first
    # layers, multi-token prediction layers (stored after the decoder's, as layers num_layers ..)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False
    shared_experts: int = 0
    first_k_dense: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    scoring_func: str = "softmax"
    mtp_layers: int = 0
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3 always; GLM-4.5 with use_qk_norm)
    rotary_percent: float = 1.0  # the share of each head RoPE rotates (GLM-4.5: partial_rotary_factor 0.5)
    # a hybrid model (NemotronH): its layer pattern in Megatron's symbols (M Mamba-2, * attention, - MLP, E MoE) and
    # its Mamba-2 mixers' sizes
    hybrid_pattern: str | None = None
    mamba_heads: int | None = None
    mamba_head_dim: int | None = None
    mamba_state: int | None = None
    mamba_groups: int | None = None
    mamba_conv: int | None = None
    moe_latent: int | None = None  # NemotronH's MoE layers: the experts compute in this latent width (moe_latent_size)
    # Qwen3-Next: each layer's kind (layer_types: linear_attention / full_attention), its gated delta nets' sizes, the
    # size of its one gated shared expert
    layer_kinds: tuple[str, ...] = ()
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_conv: int | None = None
    shared_expert_size: int | None = None
    # GPT-OSS: which layers attend over the sliding window (layer_types: sliding_attention / full_attention), its
    # clamped SwiGLU's limit and the sigmoid's slope
    window_layers: tuple[bool, ...] = ()
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def moe(self) -> bool:
        """Whether any layer is a MoE layer (a config naming experts for no layer describes a dense model)."""
        return bool(self.num_experts) and any(self.moe_layers())

    def moe_layers(self) -> list[bool]:
        """Whether each decoder layer is a MoE layer (Qwen3-MoE: every ``decoder_sparse_step``-th, minus
        ``mlp_only_layers``)."""
        if not self.num_experts:
            return [False] * self.num_layers
        if self.hybrid_pattern:  # (a hybrid model's MoE layers are its pattern's E layers)
            return [kind == "E" for kind in self.hybrid_pattern]
        step = max(1, self.decoder_sparse_step)
        return [i not in self.mlp_only_layers and (i + 1) % step == 0 and i >= self.first_k_dense
                for i in range(self.num_layers)]

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None


_MISSING = object()
REQUIRED = _MISSING  # a Key's default: config.json must set it


class Key(NamedTuple):
    """One row of a family's config table: ``config.json``'s key ``hf`` (or one of ``aliases``, other writers'
    spellings) holds :class:`HfConfig`'s field ``field``; ``default`` is the family's value when config.json omits it
    (transformers' default for the family's config class; :data:`REQUIRED`: it must be there). An export writes the
    field back under ``hf``: the inverse comes from the same row."""

    hf: str
    field: str
    default: Any = REQUIRED
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.hf, *self.aliases)
# Bounds on config.json's numbers, checked before any is used: far beyond any published model (DeepSeek-V3: 61 layers,
# 7,168 wide, 256 experts; Llama 4: 10M positions; Gemma 3: a 262k vocab), small enough that nothing sized by them
# (a table per layer, a row count) can exhaust memory or overflow
MAX_LAYERS = 4096
MAX_WIDTH = 2**20  # hidden size, an FFN's, a head's dim, a low rank
MAX_HEADS = 2**14
MAX_VOCAB = 2**28
MAX_POSITIONS = 2**30
MAX_EXPERTS = 2**16
SIGMOID_ROUTERS = ("DeepseekV3ForCausalLM",)  # architectures whose router scores with a sigmoid by definition


class _Fields:
    """Typed, range-checked reads of ``config.json``'s fields: a wrong type, a non-finite number or a value out of
    range is an error naming the field and its value, never an internal error later."""

    def __init__(self, raw: dict[str, Any], path: str) -> None:
        self.raw, self.path = raw, path

    def _bad(self, name: str, value: Any, want: str) -> PreflightError:
        return PreflightError(f"config.json's {name} is {value!r:.80}: it must be {want}", path=self.path,
                              fix=f"set {name} to the model's value (download config.json again)", code="hf_config")

    def first(self, *names: str, default: Any = _MISSING) -> tuple[str, Any, bool]:
        """(the first of ``names`` the config sets (not null), its value, whether it was set)."""
        for n in names:
            if self.raw.get(n) is not None:
                return n, self.raw[n], True
        if default is _MISSING:
            raise PreflightError(f"config.json has no {names[0]}", path=self.path, fix="download config.json again",
                                 code="corrupt_file")
        return names[0], default, False

    def int(self, *names: str, lo: int = 1, hi: int = MAX_WIDTH, default: Any = _MISSING) -> Any:
        name, v, given = self.first(*names, default=default)
        if not given:
            return v
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if type(v) is not int:
            raise self._bad(name, v, "an integer")
        if not lo <= v <= hi:
            raise self._bad(name, v, f"an integer in [{lo:,}, {hi:,}]")
        return v

    def float(self, *names: str, lo: float = 0.0, hi: float = math.inf, open_lo: bool = True,
              default: Any = _MISSING) -> Any:
        name, v, given = self.first(*names, default=default)
        if not given:
            return v
        if type(v) not in (int, float) or not math.isfinite(v):
            raise self._bad(name, v, "a finite number")
        if v < lo or (open_lo and v == lo) or v > hi:
            raise self._bad(name, v, f"a number {'>' if open_lo else '>='} {lo:g}"
                            + (f" and <= {hi:g}" if math.isfinite(hi) else ""))
        return float(v)

    def bool(self, name: str, default: Any) -> Any:
        v = self.raw.get(name)
        if v is None:
            return default
        if type(v) is not bool:
            raise self._bad(name, v, "true or false")
        return v

    def str(self, *names: str, default: Any = _MISSING) -> Any:
        name, v, given = self.first(*names, default=default)
        if given and not isinstance(v, str):
            raise self._bad(name, v, "a string")
        return v


def _rope(f: _Fields, theta_default: float, partial_default: float | None) \
        -> tuple[float, RopeScaling | None, float]:
    """(RoPE's base, its frequency scaling, the share of each head it rotates) from ``rope_parameters``
    (transformers 5), ``rope_scaling`` and the top level (transformers 4, the hub). ``partial_default`` None: the
    family rotates whole heads, and a config that says otherwise is refused by the family's undeclared-key check."""
    raw = f.raw
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per layer type (transformers 5)
    scaling = raw.get("rope_scaling")
    for name, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise f._bad(name, v, "an object")
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    m = _Fields(merged, f.path)
    theta = m.float("rope_theta", default=None)
    if theta is None:
        theta = f.float("rope_theta", default=theta_default)
    partial = m.float("partial_rotary_factor", default=None, hi=1.0)
    if partial is None:
        partial = f.float("partial_rotary_factor", default=partial_default, hi=1.0)
    if partial is None:
        partial = 1.0
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if not isinstance(kind, str):
        raise f._bad("rope_type", kind, "a string")
    if kind == "default":
        return theta, None, partial

    def num(name: str) -> float | None:
        return m.float(name, default=None, lo=-1e6, open_lo=False, hi=1e6)

    factor = m.float("factor", default=None, hi=1e6)
    orig = m.int("original_max_position_embeddings", default=None, hi=MAX_POSITIONS)
    truncate = merged.get("truncate")
    if truncate is not None and type(truncate) is not bool:
        raise f._bad("truncate", truncate, "true or false")
    return theta, RopeScaling(kind, factor, num("low_freq_factor"), num("high_freq_factor"), orig, num("beta_fast"),
                              num("beta_slow"), num("mscale"), num("mscale_all_dim"), truncate,
                              m.float("attention_factor", default=None, hi=1e6)), partial


def load_raw(model_dir: str) -> tuple[dict[str, Any], str]:
    """(``config.json`` of ``model_dir`` as JSON, its path): a regular file inside the dir, bounded in size and depth,
    no key twice (:mod:`.files`)."""
    path = os.path.join(model_dir, CONFIG)
    if not os.path.lexists(path):
        raise PreflightError("cannot read the model's config (no such file)", path=path,
                             fix="a Hugging Face model dir holds config.json beside its safetensors", code="format")
    raw = files.load_json(files.member(model_dir, CONFIG, model_dir), "download config.json again", infinity=True)
    if not isinstance(raw, dict):
        raise CorruptFileError("config.json is not a JSON object", path=path, fix="download config.json again",
                               code="corrupt_file")
    return raw, path


def architecture_of(raw: dict[str, Any]) -> str:
    """The model class ``config.json`` names (``LlamaForCausalLM``), else its ``model_type``."""
    archs = raw.get("architectures") or []
    return str(archs[0]) if archs else str(raw.get("model_type", "unknown"))


def _layer_list(f: _Fields, names: tuple[str, ...], default: Any, got: dict[str, Any]) -> tuple[int, ...]:
    name, v, _ = f.first(*names, default=default)
    layers = got["num_layers"]
    if not isinstance(v, (list, tuple)) or any(type(i) is not int or not 0 <= i < layers for i in v):
        raise f._bad(name, v, f"a list of layer numbers in [0, {layers})")
    return tuple(v)


# a hybrid model's layer kinds as transformers 5 lists them (layers_block_type) -> Megatron's pattern symbols
BLOCK_SYMBOLS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                 "moe": "E"}
PATTERN_SYMBOLS = frozenset("M*-E")


def _pattern(f: _Fields, names: tuple[str, ...], default: Any, got: dict[str, Any]) -> str:
    """A hybrid model's layer pattern: the hub's string (``hybrid_override_pattern``: ``M-M*-...``) or transformers
    5's list of layer kinds (``layers_block_type``), one symbol per layer either way."""
    name, v, _ = f.first(*names, default=default)
    if isinstance(v, list) and all(isinstance(x, str) and x in BLOCK_SYMBOLS for x in v):
        v = "".join(BLOCK_SYMBOLS[x] for x in v)
    layers = got.get("num_layers")
    if not isinstance(v, str) or not v or set(v) - PATTERN_SYMBOLS or len(v) > MAX_LAYERS or (
            layers is not None and len(v) != layers):
        raise f._bad(name, v, f"a layer pattern of {layers or 'num_hidden_layers'} symbols from M * - E (or a list "
                     "of layer kinds: " + ", ".join(BLOCK_SYMBOLS) + ")")
    return v


LAYER_KINDS = frozenset({"linear_attention", "full_attention"})


def _kinds(f: _Fields, names: tuple[str, ...], default: Any, got: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's kind: ``layer_types``, else (as transformers derives it) full attention every
    ``full_attention_interval``-th layer, linear attention between."""
    name, v, given = f.first(*names, default=None)
    layers = got["num_layers"]
    if not given:
        every = f.int("full_attention_interval", default=4, hi=max(1, layers))
        return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers))
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(x not in LAYER_KINDS for x in v):
        raise f._bad(name, v, f"a list of {layers} layer kinds, each one of " + ", ".join(sorted(LAYER_KINDS)))
    return tuple(v)


WINDOW_KINDS = frozenset({"sliding_attention", "full_attention"})


def _windowed(f: _Fields, names: tuple[str, ...], default: Any, got: dict[str, Any]) -> tuple[bool, ...]:
    """Whether each layer attends over the sliding window: ``layer_types``, else (as transformers' GPT-OSS derives it)
    the even layers (0, 2, ..)."""
    name, v, given = f.first(*names, default=None)
    layers = got["num_layers"]
    if not given:
        return tuple(i % 2 == 0 for i in range(layers))
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(x not in WINDOW_KINDS for x in v):
        raise f._bad(name, v, f"a list of {layers} layer kinds, each one of " + ", ".join(sorted(WINDOW_KINDS)))
    return tuple(x == "sliding_attention" for x in v)


def _experts(got: dict[str, Any]) -> int:
    return max(1, got.get("num_experts") or MAX_EXPERTS)


_Reader = Any  # (f, names, default, fields read so far) -> value
# how each HfConfig field is read: its type and bounds (a bound may depend on a field read before it, in this order)
READERS: dict[str, _Reader] = {
    "num_layers": lambda f, n, d, g: f.int(*n, hi=MAX_LAYERS, default=d),
    "num_attention_heads": lambda f, n, d, g: f.int(*n, hi=MAX_HEADS, default=d),
    "hidden_size": lambda f, n, d, g: f.int(*n, default=d),
    # (one that does not divide the heads: the family refuses it)
    "num_key_value_heads": lambda f, n, d, g: f.int(*n, hi=g["num_attention_heads"], default=d),
    "head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "vocab_size": lambda f, n, d, g: f.int(*n, hi=MAX_VOCAB, default=d),
    "intermediate_size": lambda f, n, d, g: f.int(*n, default=d),
    "max_position_embeddings": lambda f, n, d, g: f.int(*n, hi=MAX_POSITIONS, default=d),
    "norm_eps": lambda f, n, d, g: f.float(*n, hi=1.0, default=d),
    "tie_word_embeddings": lambda f, n, d, g: f.bool(n[0], d),
    "hidden_act": lambda f, n, d, g: f.str(*n, default=d),
    "attention_bias": lambda f, n, d, g: f.bool(n[0], d),
    "mlp_bias": lambda f, n, d, g: f.bool(n[0], d),
    "qk_norm": lambda f, n, d, g: f.bool(n[0], d),
    "dtype": lambda f, n, d, g: f.str(*n, default=d),
    "num_experts": lambda f, n, d, g: f.int(*n, lo=0, hi=MAX_EXPERTS, default=d),
    "experts_per_token": lambda f, n, d, g: f.int(*n, hi=_experts(g), default=d),
    "moe_intermediate_size": lambda f, n, d, g: f.int(*n, default=d),
    "norm_topk_prob": lambda f, n, d, g: f.bool(n[0], d),
    "decoder_sparse_step": lambda f, n, d, g: f.int(*n, hi=max(1, g["num_layers"]), default=d),
    "mlp_only_layers": _layer_list,
    "sliding_window": lambda f, n, d, g: (f.int(*n, hi=MAX_POSITIONS, default=d)
                                          if f.bool("use_sliding_window", True) is not False else None),
    "q_lora_rank": lambda f, n, d, g: f.int(*n, default=d),
    "kv_lora_rank": lambda f, n, d, g: f.int(*n, default=d),
    "qk_nope_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "qk_rope_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "v_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "rope_interleave": lambda f, n, d, g: f.bool(n[0], d),
    "shared_experts": lambda f, n, d, g: f.int(*n, lo=0, hi=MAX_EXPERTS, default=d),
    "first_k_dense": lambda f, n, d, g: f.int(*n, lo=0, hi=g["num_layers"], default=d),
    "n_group": lambda f, n, d, g: f.int(*n, hi=_experts(g), default=d),
    "topk_group": lambda f, n, d, g: f.int(*n, hi=_experts(g), default=d),
    "routed_scaling_factor": lambda f, n, d, g: f.float(*n, hi=1e6, default=d),
    "scoring_func": lambda f, n, d, g: f.str(*n, default=d),
    "mtp_layers": lambda f, n, d, g: f.int(*n, lo=0, hi=MAX_LAYERS, default=d),
    "hybrid_pattern": _pattern,
    "mamba_heads": lambda f, n, d, g: f.int(*n, hi=MAX_HEADS, default=d),
    "mamba_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "mamba_state": lambda f, n, d, g: f.int(*n, default=d),
    "mamba_groups": lambda f, n, d, g: f.int(*n, hi=MAX_HEADS, default=d),
    "mamba_conv": lambda f, n, d, g: f.int(*n, hi=64, default=d),
    "moe_latent": lambda f, n, d, g: f.int(*n, default=d),
    "layer_kinds": _kinds,
    "linear_key_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "linear_value_head_dim": lambda f, n, d, g: f.int(*n, default=d),
    "linear_num_key_heads": lambda f, n, d, g: f.int(*n, hi=MAX_HEADS, default=d),
    "linear_num_value_heads": lambda f, n, d, g: f.int(*n, hi=MAX_HEADS, default=d),
    "linear_conv": lambda f, n, d, g: f.int(*n, hi=64, default=d),
    "shared_expert_size": lambda f, n, d, g: f.int(*n, lo=0, default=d),
    "window_layers": _windowed,
    "swiglu_limit": lambda f, n, d, g: f.float(*n, hi=1e6, default=d),
    "swiglu_alpha": lambda f, n, d, g: f.float(*n, hi=1e6, default=d),
}
ROPE_FIELDS = ("rope_theta", "rotary_percent", "rope_scaling")  # read together by _rope
# the fields every family declares (what a decoder-only language model cannot be described without)
CORE_FIELDS = ("num_layers", "num_attention_heads", "hidden_size", "vocab_size", "intermediate_size", "norm_eps",
               "tie_word_embeddings", "hidden_act", "rope_theta")


def normalise(raw: dict[str, Any], path: str, keys: tuple[Key, ...], fixed: dict[str, Any] | None = None) -> HfConfig:
    """The model ``raw`` (a decoder-only language model's ``config.json``) describes, read through ``keys`` (its
    family's config table); ``fixed``: fields its architecture fixes whatever the config says. A missing field the
    model cannot be described without, a field of the wrong type or out of range, is an error naming it; a field no
    key declares keeps :class:`HfConfig`'s neutral value."""
    f = _Fields(raw, path)
    by_field = {k.field: k for k in keys}
    got: dict[str, Any] = {}
    for field_name, reader in READERS.items():
        key = by_field.get(field_name)
        if key is not None:
            got[field_name] = reader(f, key.names, key.default, got)
    if got.get("num_layers") is None and got.get("hybrid_pattern"):  # (transformers 5's NemotronH: one per kind)
        got["num_layers"] = len(got["hybrid_pattern"])
    if got.get("num_key_value_heads") is None:
        got["num_key_value_heads"] = got["num_attention_heads"]
    if got.get("head_dim") is None:
        hidden, heads = got["hidden_size"], got["num_attention_heads"]
        if hidden % heads:
            raise f._bad("hidden_size", hidden, f"a multiple of num_attention_heads ({heads}) when head_dim is not "
                         "given")
        got["head_dim"] = hidden // heads
    theta = by_field["rope_theta"].default
    partial = by_field["rotary_percent"].default if "rotary_percent" in by_field else None
    got["rope_theta"], got["rope_scaling"], got["rotary_percent"] = _rope(f, theta, partial)
    got["num_experts"] = got.get("num_experts") or None
    got.update(fixed or {})
    return HfConfig(path=path, architecture=architecture_of(raw), model_type=str(raw.get("model_type", "")),
                    raw=raw, **got)
