"""GPT-OSS (``GptOssForCausalLM``): grouped-query attention with biases on every projection and a learnable sink
logit per head (Megatron's ``--softmax-type learnable``: ``self_attn.sinks`` is ``core_attention.softmax_offset``), a
sliding window on the layers ``layer_types`` names (``--window-size W-1,0`` and ``--window-attn-skip-freq``, one
0/1 per layer), YaRN RoPE (``--position-embedding-type yarn``), every layer a MoE whose router has a bias and whose
experts compute a clamped SwiGLU with a linear offset: ``(clamp(up, ±limit) + 1) * g * sigmoid(1.702 g)``,
``g = clamp(gate, max=limit)`` (``--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value limit``).

Its experts are stored stacked (:mod:`~megatron_preflight.layout.hf.stacked`): transformers writes
``gate_up_proj`` ``[E, hidden, 2 x ffn]`` with the gate and up rows alternating, ``down_proj`` ``[E, ffn, hidden]``
(each expert's matrix ``[in, out]``), their biases ``[E, out]``; the hub's MXFP4 files hold the two weights as e2m1
blocks ``[E, out, in / 32, 16]`` with e8m0 scales. An export writes transformers' bf16 / fp32 form."""

from __future__ import annotations

from megatron_preflight.layout.hf.config import REQUIRED, HfConfig, Key
from megatron_preflight.layout.hf.families.rows import Moe
from megatron_preflight.layout.hf.families.spec import Family, arg, table, traits
from megatron_preflight.layout.hf.stacked import Stacked

QUICK_GELU_SLOPE = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x), a constant no flag sets

STACKED = (
    Stacked("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), interleaved=True, transposed=True),
    Stacked("mlp.experts.gate_up_proj_bias", ("gate_proj.bias", "up_proj.bias"), interleaved=True),
    Stacked("mlp.experts.down_proj", ("down_proj.weight",), transposed=True),
    Stacked("mlp.experts.down_proj_bias", ("down_proj.bias",)),
)


def _args(cfg: HfConfig) -> dict:
    out = {"softmax_type": "learnable", "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
           "activation_func_clamp_value": cfg.swiglu_limit, "add_qkv_bias": True}
    if cfg.sliding_window and any(cfg.window_layers):
        out.update(window_size=(cfg.sliding_window - 1, 0),  # (transformers' window counts the token itself)
                   window_attn_skip_freq=[int(w) for w in cfg.window_layers])
    return out


def _refuse(cfg: HfConfig) -> list[str]:
    out = []
    if not cfg.attention_bias:
        out.append("attention_bias false (Megatron gives the attention's projections biases with every linear's)")
    if cfg.swiglu_alpha is not None and abs(cfg.swiglu_alpha - QUICK_GELU_SLOPE) > 1e-9:
        out.append(f"swiglu_alpha {cfg.swiglu_alpha} (Megatron's quick GELU has the slope {QUICK_GELU_SLOPE})")
    if cfg.swiglu_limit is None:
        out.append("swiglu_limit null (Megatron's GPT-OSS activation here is the clamped one)")
    return out


def _back(values: dict, args: object) -> dict:
    """The GPT-OSS fields of a Megatron model's args (export)."""
    window = arg(args, "window_size")
    skip = arg(args, "window_attn_skip_freq")
    layers = values["num_layers"]
    if window:
        if isinstance(skip, int):
            windowed = tuple((i + 1) % skip != 0 for i in range(layers))
        elif skip is None:
            windowed = (True,) * layers
        else:
            windowed = tuple(bool(x) for x in skip)
        values.update(sliding_window=int(window[0]) + 1, window_layers=windowed)
    else:
        values.update(sliding_window=None, window_layers=(False,) * layers)
    values.update(swiglu_limit=arg(args, "activation_func_clamp_value"), swiglu_alpha=QUICK_GELU_SLOPE)
    return values


def _json(cfg: HfConfig) -> dict:
    return {"layer_types": ["sliding_attention" if w else "full_attention" for w in cfg.window_layers],
            "router_aux_loss_coef": 0.0, "output_router_logits": False}


def _expresses(args: object) -> bool:
    t = traits(args)
    return (bool(arg(args, "quick_geglu", False)) and arg(args, "softmax_type", "vanilla") == "learnable"
            and t.moe and not (t.mla or t.hybrid or t.shared or t.sigmoid or t.qk_norm or t.mtp or t.zero_centred)
            and bool(arg(args, "add_bias_linear", True)) and float(arg(args, "glu_linear_offset", 0.0)) == 1.0)


FAMILY = Family(
    "gpt_oss", ("GptOssForCausalLM",),
    # transformers' GptOssConfig defaults, where config.json may leave a field out
    keys=table(Key("rms_norm_eps", "norm_eps", 1e-5), Key("rope_theta", "rope_theta", 150000.0),
               Key("attention_bias", "attention_bias", True), Key("head_dim", "head_dim", 64),
               Key("num_local_experts", "num_experts", REQUIRED), Key("num_experts_per_tok", "experts_per_token", 4),
               Key("sliding_window", "sliding_window", 128), Key("layer_types", "window_layers", None),
               Key("swiglu_limit", "swiglu_limit", 7.0), Key("swiglu_alpha", "swiglu_alpha", QUICK_GELU_SLOPE)),
    qkv_bias="config", moe=Moe("mlp", "router", ("gate_proj", "up_proj", "down_proj"), bias=True),
    args=_args, json=_json, refuse=_refuse, back=_back, expresses=_expresses, rank=7,
    inert=frozenset({"router_aux_loss_coef", "output_router_logits"}),
    stacked=STACKED, linear_bias=True, sinks=True,
)
