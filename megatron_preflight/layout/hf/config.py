"""A Hugging Face ``config.json`` normalised: the hub's spellings (transformers 4: ``rope_theta`` and ``rope_scaling``,
Qwen3-MoE's ``num_experts``) and transformers 5's (``rope_parameters``, ``num_local_experts``) read into one
:class:`HfConfig`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.errors import CorruptFileError, PreflightError
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


def _first(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if raw.get(n) is not None:
            return raw[n]
    return default


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per layer type (transformers 5)
    scaling = raw.get("rope_scaling")
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    theta = float(_first(merged, "rope_theta", default=_first(raw, "rope_theta", default=10000.0)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "default":
        return theta, None
    def num(name: str) -> float | None:
        v = merged.get(name)
        return float(v) if v is not None else None
    orig = merged.get("original_max_position_embeddings")
    return theta, RopeScaling(str(kind), num("factor"), num("low_freq_factor"), num("high_freq_factor"),
                              int(orig) if orig is not None else None, num("beta_fast"), num("beta_slow"),
                              num("mscale"), num("mscale_all_dim"))


def load_raw(model_dir: str) -> tuple[dict[str, Any], str]:
    """(``config.json`` of ``model_dir`` as JSON, its path)."""
    path = os.path.join(model_dir, CONFIG)
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except OSError as exc:
        raise PreflightError(f"cannot read the model's config ({exc.strerror})", path=path,
                             fix="a Hugging Face model dir holds config.json beside its safetensors", code="format") \
            from None
    except ValueError as exc:
        raise CorruptFileError(f"config.json is not valid JSON ({exc})", path=path,
                               fix="download config.json again", code="corrupt_file") from None
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
    cannot be described without is an error naming it."""
    arch = architecture_of(raw)

    def need(*names: str) -> Any:
        value = _first(raw, *names)
        if value is None:
            raise PreflightError(f"config.json has no {names[0]}", path=path, fix="download config.json again",
                                 code="corrupt_file")
        return value

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    theta, scaling = _rope(raw)
    head_dim = raw.get("head_dim")
    experts = _first(raw, "num_local_experts", "num_experts", "n_routed_experts")
    return HfConfig(
        path=path, architecture=arch, model_type=str(raw.get("model_type", "")),
        vocab_size=int(need("vocab_size")), hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")), num_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads, num_key_value_heads=int(_first(raw, "num_key_value_heads", default=heads)),
        head_dim=int(head_dim) if head_dim else hidden // heads,
        max_position_embeddings=_first(raw, "max_position_embeddings"),
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(_first(raw, "rms_norm_eps", "layer_norm_eps", "norm_eps", default=1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        hidden_act=str(_first(raw, "hidden_act", "activation_function", default="silu")),
        attention_bias=raw.get("attention_bias"), mlp_bias=bool(raw.get("mlp_bias", False)),
        dtype=_first(raw, "dtype", "torch_dtype"),
        num_experts=int(experts) if experts else None,
        experts_per_token=_first(raw, "num_experts_per_tok"),
        moe_intermediate_size=_first(raw, "moe_intermediate_size"),
        norm_topk_prob=raw.get("norm_topk_prob"),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
        q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw.get("kv_lora_rank"),
        qk_nope_head_dim=raw.get("qk_nope_head_dim"), qk_rope_head_dim=raw.get("qk_rope_head_dim"),
        v_head_dim=raw.get("v_head_dim"),
        # transformers' DeepseekV3Config default: the hub's config.json does not say, and its rows are interleaved
        rope_interleave=bool(raw.get("rope_interleave", True)),
        shared_experts=int(raw.get("n_shared_experts") or 0), first_k_dense=int(raw.get("first_k_dense_replace") or 0),
        n_group=raw.get("n_group"), topk_group=raw.get("topk_group"),
        routed_scaling_factor=raw.get("routed_scaling_factor"),
        scoring_func=str(raw.get("scoring_func") or ("sigmoid" if raw.get("model_type") == "deepseek_v3"
                                                      else "softmax")),
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        raw=raw)
