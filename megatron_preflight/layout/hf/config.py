"""A Hugging Face ``config.json`` normalised: the hub's spellings (transformers 4: ``rope_theta`` and ``rope_scaling``,
Qwen3-MoE's ``num_experts``) and transformers 5's (``rope_parameters``, ``num_local_experts``) read into one
:class:`HfConfig`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

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
    max_position_embeddings: int | None
    rope_theta: float
    rope_scaling: RopeScaling | None
    norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool | None
    mlp_bias: bool
    dtype: str | None
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
        step = max(1, self.decoder_sparse_step)
        return [i not in self.mlp_only_layers and (i + 1) % step == 0 and i >= self.first_k_dense
                for i in range(self.num_layers)]

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None


_MISSING = object()
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


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
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
        theta = f.float("rope_theta", default=10000.0)
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if not isinstance(kind, str):
        raise f._bad("rope_type", kind, "a string")
    if kind == "default":
        return theta, None

    def num(name: str) -> float | None:
        return m.float(name, default=None, lo=-1e6, open_lo=False, hi=1e6)

    factor = m.float("factor", default=None, hi=1e6)
    orig = m.int("original_max_position_embeddings", default=None, hi=MAX_POSITIONS)
    return theta, RopeScaling(kind, factor, num("low_freq_factor"), num("high_freq_factor"), orig, num("beta_fast"),
                              num("beta_slow"), num("mscale"), num("mscale_all_dim"))


def load_raw(model_dir: str) -> tuple[dict[str, Any], str]:
    """(``config.json`` of ``model_dir`` as JSON, its path): a regular file inside the dir, bounded in size and depth,
    no key twice (:mod:`.files`)."""
    path = os.path.join(model_dir, CONFIG)
    if not os.path.lexists(path):
        raise PreflightError("cannot read the model's config (no such file)", path=path,
                             fix="a Hugging Face model dir holds config.json beside its safetensors", code="format")
    raw = files.load_json(files.member(model_dir, CONFIG, model_dir), "download config.json again")
    if not isinstance(raw, dict):
        raise CorruptFileError("config.json is not a JSON object", path=path, fix="download config.json again",
                               code="corrupt_file")
    return raw, path


def architecture_of(raw: dict[str, Any]) -> str:
    """The model class ``config.json`` names (``LlamaForCausalLM``), else its ``model_type``."""
    archs = raw.get("architectures") or []
    return str(archs[0]) if archs else str(raw.get("model_type", "unknown"))


def normalise(raw: dict[str, Any], path: str) -> HfConfig:
    """The model ``raw`` (a decoder-only language model's ``config.json``) describes. A missing field the model
    cannot be described without, a field of the wrong type or out of range, is an error naming it."""
    arch = architecture_of(raw)
    f = _Fields(raw, path)
    layers = f.int("num_hidden_layers", hi=MAX_LAYERS)
    heads = f.int("num_attention_heads", hi=MAX_HEADS)
    hidden = f.int("hidden_size")
    kv_heads = f.int("num_key_value_heads", default=heads, hi=heads)  # (one that does not divide: families refuses)
    head_dim = f.int("head_dim", default=None)
    if head_dim is None:
        if hidden % heads:
            raise f._bad("hidden_size", hidden, f"a multiple of num_attention_heads ({heads}) when head_dim is not "
                         "given")
        head_dim = hidden // heads
    theta, scaling = _rope(f)
    experts = f.int("num_local_experts", "num_experts", "n_routed_experts", default=None, lo=0, hi=MAX_EXPERTS)
    topk = f.int("num_experts_per_tok", default=None, hi=max(1, experts or MAX_EXPERTS))

    def layer_list(name: str) -> tuple[int, ...]:
        v = raw.get(name) or []
        if not isinstance(v, list) or any(type(i) is not int or not 0 <= i < layers for i in v):
            raise f._bad(name, v, f"a list of layer numbers in [0, {layers})")
        return tuple(v)

    # transformers' DeepseekV3 router is sigmoid whatever the config says: decided by the architecture, not the
    # model_type (Kimi K2 is DeepseekV3ForCausalLM under model_type kimi_k2, with its own code in auto_map)
    scoring = f.str("scoring_func", default=None) or ("sigmoid" if arch in SIGMOID_ROUTERS else "softmax")
    return HfConfig(
        path=path, architecture=arch, model_type=str(raw.get("model_type", "")),
        vocab_size=f.int("vocab_size", hi=MAX_VOCAB), hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"), num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=f.int("max_position_embeddings", default=None, hi=MAX_POSITIONS),
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=f.float("rms_norm_eps", "layer_norm_eps", "norm_eps", default=1e-6, hi=1.0),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        hidden_act=f.str("hidden_act", "activation_function", default="silu"),
        attention_bias=f.bool("attention_bias", None), mlp_bias=f.bool("mlp_bias", False),
        dtype=f.str("dtype", "torch_dtype", default=None),
        num_experts=experts or None,
        experts_per_token=topk,
        moe_intermediate_size=f.int("moe_intermediate_size", default=None),
        norm_topk_prob=f.bool("norm_topk_prob", None),
        decoder_sparse_step=f.int("decoder_sparse_step", default=1, hi=max(1, layers)),
        mlp_only_layers=layer_list("mlp_only_layers"),
        sliding_window=(f.int("sliding_window", default=None, hi=MAX_POSITIONS)
                        if f.bool("use_sliding_window", True) is not False else None),
        q_lora_rank=f.int("q_lora_rank", default=None), kv_lora_rank=f.int("kv_lora_rank", default=None),
        qk_nope_head_dim=f.int("qk_nope_head_dim", default=None),
        qk_rope_head_dim=f.int("qk_rope_head_dim", default=None),
        v_head_dim=f.int("v_head_dim", default=None),
        # transformers' DeepseekV3Config default: the hub's config.json does not say, and its rows are interleaved
        rope_interleave=f.bool("rope_interleave", True),
        shared_experts=f.int("n_shared_experts", default=0, lo=0, hi=MAX_EXPERTS),
        first_k_dense=f.int("first_k_dense_replace", default=0, lo=0, hi=layers),
        n_group=f.int("n_group", default=None, hi=max(1, experts or 1)),
        topk_group=f.int("topk_group", default=None, hi=max(1, experts or 1)),
        routed_scaling_factor=f.float("routed_scaling_factor", default=None, hi=1e6),
        scoring_func=scoring,
        mtp_layers=f.int("num_nextn_predict_layers", default=0, lo=0, hi=MAX_LAYERS),
        raw=raw)
