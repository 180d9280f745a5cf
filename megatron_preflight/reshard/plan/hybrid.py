"""A GPT checkpoint as a HybridModel's: each GPT layer ``i`` is the hybrid pair of layers ``2i`` (attention, ``*``)
and ``2i+1`` (its MLP ``-`` or MoE ``E``), the final layer norm ``decoder.final_norm``, an MTP layer's transformer
layer its stack ``layers.0`` / ``layers.1`` (MTP pattern ``*-`` or ``*E``).

The tensors are the same: Megatron's hybrid attention layer is the GPT layer without its MLP (the TE spec: the input
norm fused into ``linear_qkv``), its MLP layer the GPT layer's MLP (the pre-MLP norm fused into ``linear_fc1``), its
MoE layer the GPT layer's ``pre_mlp_layernorm``, router and experts. Only the layer numbers change (and with them
the pipeline placement), so the bridge renames global keys, as :func:`~.spec.bridge` does for layer specs, and the
optimizer state follows the renamed keys.
"""

from __future__ import annotations

import ast
from collections import OrderedDict
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import MTP_SEPARATOR, hybrid_layers, hybrid_main
from megatron_preflight.reshard.plan.rules import MTP_INNER, info_of_global, mamba_conv_name, mtp_index, spellings
from megatron_preflight.reshard.plan.spec import reordered
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey

# the parts of a GPT layer that make the hybrid attention layer (the rest is its MLP / MoE layer)
_ATTENTION = ("input_layernorm.", "self_attention.")
# GPT layer parts a hybrid attention or MLP layer has no module for (layer norms of the local spec, q/k norms)
_NOT_IN_HYBRID = ("input_layernorm.", "self_attention.q_layernorm.", "self_attention.k_layernorm.")


def _literal_list(text: str) -> list[int] | None:
    """Megatron's ``--moe-layer-freq`` list expression (``([0]+[1]*3)``): lists of ints, ``+`` and ``*``; evaluated
    without eval."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(text)

    try:
        out = value(ast.parse(text.strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError):
        return None
    return [int(bool(x)) for x in out] if isinstance(out, list) else None


def moe_layers(args: Any) -> list[bool] | None:
    """Which GPT layers are MoE layers (``--num-experts``, ``--moe-layer-freq``), None when not known."""
    layers = getattr(args, "num_layers", None)
    if not isinstance(layers, int):
        return None
    if not getattr(args, "num_experts", None):
        return [False] * layers
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int) and freq > 0:
        return [i % freq == 0 for i in range(layers)]
    listed = _literal_list(freq) if isinstance(freq, str) else list(freq) if isinstance(freq, (list, tuple)) else None
    if listed is None or len(listed) != layers:
        return None
    return [bool(x) for x in listed]


def gpt_pattern(args: Any) -> str | None:
    """The hybrid layer pattern that is the GPT model ``args`` describe (without ``|`` cuts), None when unknown."""
    moe = moe_layers(args)
    if moe is None:
        return None
    main = "".join("*E" if m else "*-" for m in moe)
    depths = int(getattr(args, "mtp_num_layers", 0) or 0)
    mtp_moe = bool(getattr(args, "num_experts", None)) and (moe[-1] if moe else False)
    return main + (MTP_SEPARATOR + ("*E" if mtp_moe else "*-")) * depths


def gpt_to_hybrid_problem(args: Any, pattern: str) -> str | None:
    """Why a run with the hybrid ``pattern`` cannot load the GPT checkpoint of ``args`` (None: it can, renamed)."""
    want = gpt_pattern(args)
    if want is None:
        return "the checkpoint's MoE layers (--moe-layer-freq) are not known"
    if getattr(args, "qk_layernorm", False):
        return "its attention has q/k layer norms, which the hybrid attention layer does not build"
    if getattr(args, "multi_latent_attention", False):
        return "its attention is MLA, the hybrid attention layer (`*`) is not (MLA layers, `+`, are not mapped)"
    if hybrid_layers(pattern) != hybrid_layers(want) or pattern[len(hybrid_main(pattern)):] != want[len(
            hybrid_main(want)):]:
        return f"the pattern that is this GPT model is {want!r} (each layer as attention `*` then its MLP `-` or MoE " \
               f"`E`; '|' cuts may be added)"
    return None


def _mtp_name(suffix: str) -> str:
    """An MTP layer's transformer-layer key in the hybrid MTP stack: attention in ``layers.0``, its MLP in
    ``layers.1``."""
    head = suffix[: suffix.index(MTP_INNER) + len(MTP_INNER)]
    rest = suffix[len(head):]
    return f"{head}layers.{0 if rest.startswith(_ATTENTION) else 1}.{rest}"


def _renamed(key: GlobalKey) -> GlobalKey | None:
    layer, expert, style, suffix = key
    if layer is not None:
        if suffix.startswith(_NOT_IN_HYBRID):
            return None
        return GlobalKey(2 * layer + (0 if suffix.startswith(_ATTENTION) else 1), expert, style, suffix)
    if suffix.startswith("decoder.final_layernorm."):
        return GlobalKey(None, expert, style, "decoder.final_norm." + suffix[len("decoder.final_layernorm."):])
    if mtp_index(suffix) is not None and MTP_INNER in suffix:
        return GlobalKey(None, expert, style, _mtp_name(suffix))
    return key


def to_hybrid(index: OrderedDict[GlobalKey, GlobalEntry], where: str | None = None
              ) -> tuple[OrderedDict[GlobalKey, GlobalEntry], dict[GlobalKey, GlobalKey]]:
    """The GPT global index under the hybrid model's keys (the same entries, renamed), and old -> new keys of every
    renamed one (what the optimizer state follows). A GPT tensor the hybrid layers have no module for is refused."""
    out: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    renamed: dict[GlobalKey, GlobalKey] = {}
    for key, entry in index.items():
        new = _renamed(key)
        if new is None:
            if key.suffix.endswith("_extra_state"):
                continue
            raise PreflightError(f"decoder layer {key.layer}'s {key.suffix} has no place in a HybridModel (its "
                                 "attention layer fuses the input norm into linear_qkv and has no q/k norms)",
                                 path=where, code="layout",
                                 fix="load it into a GPT run, or convert it to the Transformer Engine spec "
                                     "(--transformer-impl transformer_engine) without q/k layer norms first")
        if new != key:
            renamed[key] = new
            entry = GlobalEntry(new, info_of_global(*new), entry.rule, entry.pieces, entry.order)
        out[new] = entry
    return out, renamed


def conv_named(index: OrderedDict[GlobalKey, GlobalEntry], name: str
               ) -> tuple[OrderedDict[GlobalKey, GlobalEntry], dict[GlobalKey, GlobalKey]]:
    """The index with every Mamba mixer's conv under the naming ``name`` (``conv1d_weight``: megatron-core 0.19 and
    later; ``conv1d.weight`` before) and every layer key at its place in Megatron's module order (the conv moves:
    parameters of the mixer come before its modules, a module after ``in_proj``); old -> new keys of the renamed ones
    (the optimizer state follows them, and so the plain optimizer's parameter order)."""
    renamed: dict[GlobalKey, GlobalKey] = {}
    out: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    for key, entry in index.items():
        found = mamba_conv_name(key.suffix)
        if found is not None and found != name:
            new = GlobalKey(key.layer, key.expert, key.style, spellings(key.suffix)[1])
            renamed[key] = new
            entry = GlobalEntry(new, info_of_global(*new), entry.rule, entry.pieces, entry.order)
            key = new
        out[key] = entry
    return (reordered(out), renamed) if renamed else (index, {})
