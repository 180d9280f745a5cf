"""THE families of Hugging Face architectures, one module each (:mod:`.llama`, :mod:`.qwen2`, :mod:`.qwen3`,
:mod:`.mixtral`, :mod:`.qwen3_moe`, :mod:`.deepseek_v3`, :mod:`.glm4_moe`, :mod:`.nemotron_h`, :mod:`.qwen3_next`,
:mod:`.gpt_oss`, :mod:`.qwen3_5`; Qwen3-Next and Qwen3.5 share :mod:`.qwen_hybrid`): for each, which Megatron model its
``config.json`` describes (its config table, :class:`~megatron_preflight.layout.hf.config.Key` rows) and how each
Megatron tensor is made of Hugging Face tensors (:mod:`.rows`). Import, export, ``flags`` and ``check`` read the same
declaration (:mod:`.spec` holds the code that reads it); adding a family is adding its module to :data:`FAMILIES`."""

from __future__ import annotations

from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf.config import HfConfig, normalise
from megatron_preflight.layout.hf.families import (
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    llama,
    mixtral,
    nemotron_h,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from megatron_preflight.layout.hf.families.rows import Block, Experts, Mapping, Moe, Rows
from megatron_preflight.layout.hf.families.spec import (
    LLAMA3_FIXED,
    MAX_TP,
    MLA_YARN_ORIGINAL,
    Family,
    Wrapper,
    arg,
    config_from_args,
    config_json,
    ignored,
    mappings,
    megatron_args,
    mtp_copies,
    mtp_depth,
    qk_norm,
    qkv_bias,
    refusals,
    traits,
    true_vocab,
)

# (a module declares FAMILY, or FAMILIES where one architecture comes as two models: Qwen3.5 dense and MoE)
FAMILIES: tuple[Family, ...] = tuple(f for m in (llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, glm4_moe,
                                                 nemotron_h, qwen3_next, gpt_oss, qwen3_5)
                                     for f in getattr(m, "FAMILIES", None) or (m.FAMILY,))

__all__ = ["FAMILIES", "LLAMA3_FIXED", "MAX_TP", "MLA_YARN_ORIGINAL", "Block", "Experts", "Family", "Mapping", "Moe",
           "Rows", "UnsupportedModel", "Wrapper", "config_from_args", "config_json", "export_refusals", "family_for", "family_for_args",
           "fitting_families", "ignored", "mappings", "megatron_args", "mtp_copies", "mtp_depth", "qk_norm",
           "qkv_bias", "read_config", "refusals", "supported", "true_vocab", "wrapper_for"]


def supported() -> list[str]:
    """Every architecture a family covers (the multimodal ones whose language model it is, too)."""
    return [a for f in FAMILIES for a in (*f.architectures, *(w.architecture for w in f.wrappers))]


def wrapper_for(architecture: str) -> Wrapper | None:
    """The multimodal model ``architecture`` names whose language model a family here is (None: not one)."""
    return next((w for f in FAMILIES for w in f.wrappers if w.architecture == architecture), None)


class UnsupportedModel(PreflightError):
    """An HF model no family expresses as a Megatron GPT model."""


def family_for(architecture: str, path: str) -> Family:
    """The family of ``architecture``; an unsupported one is refused, naming what is supported."""
    wrapper = wrapper_for(architecture)
    if wrapper is not None:
        architecture = wrapper.text
    for f in FAMILIES:
        if architecture in f.architectures:
            return f
    what = ("this Hugging Face model dir's config.json names no architecture (no architectures, no model_type)"
            if architecture == "unknown" else
            f"the Hugging Face architecture {architecture} is not one megatron-preflight maps to Megatron's GPT model")
    raise UnsupportedModel(what, path=path,
                           fix="supported: " + ", ".join(supported()) + "; convert other models with the tool that "
                               "knows them (e.g. Megatron-Bridge)", code="hf_unsupported")


def read_config(family: Family, raw: dict[str, Any], path: str) -> HfConfig:
    """``config.json`` (``raw``) read through ``family``'s config table."""
    return normalise(raw, path, family.keys, family.fixed)


def export_refusals(args: Any) -> list[str]:
    """Why no HF architecture expresses the Megatron model of ``args``, whatever the family (empty: one may)."""
    out = []
    hybrid = bool(parallel.hybrid_pattern(args))
    position = arg(args, "position_embedding_type", "learned_absolute")
    if position not in ("rope", "yarn") and not (hybrid and position == "none"):
        out.append(f"{position} position embeddings (the architectures here use RoPE or YaRN; a hybrid one none)")
    biased = any(f.linear_bias and f.expresses(args) for f in FAMILIES)  # (GPT-OSS: its clamped quick GEGLU too)
    if not arg(args, "swiglu", False) and not (hybrid and arg(args, "squared_relu", False)) and not biased:
        out.append("an MLP without SwiGLU (the architectures here gate with silu, GPT-OSS with a clamped quick GELU "
                   "and biases; a hybrid one squares a ReLU)")
    if str(arg(args, "normalization", "LayerNorm")).lower() != "rmsnorm":
        out.append(f"{arg(args, 'normalization', 'LayerNorm')} (the architectures here use RMSNorm)")
    if arg(args, "add_bias_linear", True) and not biased:
        out.append("biases on every linear layer (--disable-bias-linear was not given)")
    if arg(args, "moe_latent_size") and not hybrid:
        out.append("MoE latent projections (--moe-latent-size: the architecture here with them is NemotronH, a hybrid "
                   "model)")
    return out


def fitting_families(args: Any) -> list[Family]:
    """The families that express the Megatron model of ``args`` (best first)."""
    return sorted((f for f in FAMILIES if f.expresses(args)), key=lambda f: f.rank)


def _traits_text(args: Any) -> str:
    t = traits(args)
    said = [name.replace("_", " ") for name, on in t._asdict().items() if on]
    return "a model with " + (", ".join(said) if said else "none of MLA, MoE, QK norm, QKV bias")


def family_for_args(args: Any, architecture: str | None, path: str) -> tuple[Family, str]:
    """(the family an export writes, the architecture it names): ``architecture`` (``--hf-architecture``) when it
    expresses the model, else the one the model was read from (its args' ``hf_architecture``: Qwen3-Next and Qwen3.5
    build the same Megatron model) when it does, else the first that does; refused with the reason before anything
    is written."""
    reasons = export_refusals(args)
    fits = [] if reasons else fitting_families(args)
    came_from = arg(args, "hf_architecture")
    if architecture is None and came_from is not None:
        fits = sorted(fits, key=lambda f: came_from not in f.architectures)
        if fits and came_from in fits[0].architectures:
            return fits[0], came_from
    if architecture is not None:
        chosen = next((f for f in FAMILIES if architecture in f.architectures), None)
        if chosen is None:
            raise UnsupportedModel(f"--hf-architecture {architecture} is not one the families here write", path=path,
                                   fix="one of: " + ", ".join(supported()), code="usage")
        if chosen not in fits:
            why = "; ".join(reasons) or f"its attention, experts or norms differ from the model's ({_traits_text(args)})"
            raise UnsupportedModel(f"{architecture} does not express this model ({why})", path=path,
                                   fix="leave --hf-architecture out" + (
                                       f" (this model writes as {fits[0].architectures[0]})" if fits else ""),
                                   code="hf_unsupported")
        return chosen, architecture
    if not fits:
        why = "; ".join(reasons) or f"no family here has this combination ({_traits_text(args)})"
        raise UnsupportedModel(f"no Hugging Face architecture here expresses this model: {why}", path=path,
                               fix="export it with a tool that maps this model, or keep it as a Megatron checkpoint",
                               code="hf_unsupported")
    return fits[0], fits[0].architectures[0]
