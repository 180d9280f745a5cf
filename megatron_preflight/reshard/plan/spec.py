"""The one place that knows how a layer spec names its tensors, and the bridge between specs.

Megatron-Core builds a GPT layer from a *spec*: ``--transformer-impl local`` (megatron-core's own modules) or
``transformer_engine`` (TE's fused modules). The tensors are the same; a legacy state dict names some differently:

* the attention and dense-MLP layer norms are modules of their own in the local spec (``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight``) and fused into the next linear in TE's (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``); a MoE layer keeps ``pre_mlp_layernorm`` in both (TE: a ``TENorm``);
* TE modules carry an ``_extra_state`` (FP8 metadata; empty without FP8): TE's attention
  (``self_attention.core_attention._extra_state``) and TE norms (``pre_mlp_layernorm`` of MoE layers, q/k layer
  norms, the final norm) have one where the local modules have none;
* experts: sequential (``local_experts.{j}.linear_fc1.weight``, an ``_extra_state`` per expert linear) or, with TE and
  ``--moe-grouped-gemm``, grouped (``experts.linear_fc1.weight{j}``, one ``_extra_state`` per grouped linear). Each
  expert's weight is the same tensor either way, split the same way. Older Megatron's local spec with
  ``--moe-grouped-gemm`` built the legacy ``GroupedMLP``: ``experts.weight1`` ``[h, E_loc·f]`` and ``experts.weight2``
  ``[E_loc·f, h]`` (f: the ETP rank's fc1 rows, GLU halves included, or fc2 columns), whose memory its forward views
  as ``(E_loc, h, f)`` / ``(E_loc, f, h)``: expert j's block is contiguous and holds the *transpose* of its sequential
  linear's ETP shard. :func:`unpack_legacy_grouped` reads it as that (strided views, no copy); it is read, never
  written (Megatron-LM main has no GroupedMLP: its local spec builds sequential experts).

torch_dist saves the local spec's layer norms under the fused names (megatron-core's ``sharded_state_dict_keys_map``):
:func:`legacy_suffix` / :func:`dist_suffix` translate. :func:`bridge` renames a global index from one spec to
another: renamed parameters keep their data (and, through the returned mapping, their optimizer state), extra state
TE has and the local modules do not is made empty (``None``: every TE version's ``set_extra_state`` accepts it, and a
fresh TE module holds no more than that without FP8), extra state the target modules do not have is dropped, and a
local target's linears get ``None`` as megatron-core's own modules save (FP8 scales have no meaning without TE).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import hybrid_pattern
from megatron_preflight.reshard.plan.rules import info_of_global, rule_for
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey, SourcePiece
from megatron_preflight.torch_file import TensorRef

LOCAL, TE = "local", "transformer_engine"

# --transformer-impl local: module names -> the names the torch_dist save uses (megatron-core's local layer spec)
LOCAL_SPEC_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                   "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

# Megatron-Core's module registration order inside a transformer layer (the order of a legacy state dict; the
# optimizer's parameter order follows it). Keys of other modules follow.
MODULE_ORDER = ("input_layernorm.", "self_attention.core_attention.", "self_attention.linear_proj.",
                "self_attention.linear_qkv.", "self_attention.linear_q_proj.", "self_attention.linear_q_down_proj.",
                "self_attention.linear_q_up_proj.", "self_attention.linear_kv_down_proj.",
                "self_attention.linear_kv_up_proj.", "self_attention.q_layernorm.", "self_attention.kv_layernorm.",
                "self_attention.k_layernorm.",
                "pre_cross_attn_layernorm.", "cross_attention.", "pre_mlp_layernorm.", "mlp.linear_fc1.",
                "mlp.linear_fc2.", "mlp.router.", "mlp.experts.", "mlp.shared_experts.linear_fc1.",
                "mlp.shared_experts.linear_fc2.", "mlp.shared_experts.",
                # HybridModel: a Mamba-2 layer's pre-norm and mixer (its own parameters, then its modules), a gated
                # delta net (the same)
                "norm.", "mixer.conv1d_weight", "mixer.conv1d_bias", "mixer.dt_bias", "mixer.A_log", "mixer.D",
                "mixer.in_proj.", "mixer.conv1d.", "mixer.norm.", "mixer.out_proj.",
                "self_attention.dt_bias", "self_attention.A_log", "self_attention.in_proj.",
                "self_attention.conv1d.", "self_attention.out_norm.", "self_attention.out_proj.")

PARAM_ORDER = {"layer_norm_weight": 0, "layer_norm_bias": 1, "weight": 2, "bias": 3, "_extra_state": 9}

# Norms built as TE's TENorm by the TE spec (an _extra_state of their own); local ones have none.
_TE_NORMS = ("self_attention.q_layernorm.", "self_attention.k_layernorm.")
_MOE_NORM = "pre_mlp_layernorm."
_FINAL_NORM = "decoder.final_layernorm."
ATTENTION_EXTRA = "self_attention.core_attention._extra_state"
EXPERTS_MODULE = "mlp.experts."
# an MTP layer: its transformer layer (named mtp_model_layer from megatron-core 0.17, transformer_layer before), and
# its own norms (TE norms under the TE spec, with an extra state of their own)
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+\.(?:mtp_model_layer|transformer_layer)\.)(.*)$")
_MTP_NORM_EXTRA = re.compile(r"^mtp\.layers\.\d+\.(?:enorm|hnorm|final_layernorm)\._extra_state$")
_MTP_NORMS = ("enorm.", "hnorm.", "final_layernorm.")


def spec_of(args: Any) -> str:
    """The layer spec a run (or the run that saved a checkpoint) builds: ``transformer_impl``, Megatron's default
    being Transformer Engine."""
    value = args.get("transformer_impl") if isinstance(args, dict) else getattr(args, "transformer_impl", None)
    return value or TE


def grouped_experts(args: Any) -> bool:
    """Whether a run builds Transformer Engine's grouped experts (``experts.linear_fc1.weight{j}``): with
    ``--moe-grouped-gemm`` on the TE spec, and always in a HybridModel (its layer specs build no other)."""
    if hybrid_pattern(args) is not None:
        return True
    grouped = args.get("moe_grouped_gemm") if isinstance(args, dict) else getattr(args, "moe_grouped_gemm", False)
    return bool(grouped) and spec_of(args) == TE


def is_local_spec(args: Any) -> bool:
    """``--transformer-impl local``: its layer norms are modules of their own in a legacy state dict."""
    return spec_of(args) == LOCAL


def legacy_suffix(rest: str, local_spec: bool) -> str:
    """A layer key's name in a legacy state dict, from its torch_dist name."""
    if local_spec:
        for module, saved in LOCAL_SPEC_KEYS.items():
            if rest.startswith(saved):
                return module + rest[len(saved):]
    return rest


def dist_suffix(suffix: str, local_spec: bool) -> str:
    """A layer key's torch_dist name, from its legacy name (the inverse of :func:`legacy_suffix`)."""
    if local_spec:
        for module, saved in LOCAL_SPEC_KEYS.items():
            if suffix.startswith(module):
                return saved + suffix[len(module):]
    return suffix


def rank_in(name: str, table: tuple[str, ...], fallback: int) -> int:
    """The place of ``name`` in a prefix ``table`` (``len(table) + fallback`` when no prefix matches)."""
    hit = _first_prefix(name, table)
    return len(table) + fallback if hit is None else hit


@functools.lru_cache(maxsize=65536)  # a model's key suffixes repeat in every layer: ~10^5 calls, a few hundred names
def _first_prefix(name: str, table: tuple[str, ...]) -> int | None:
    return next((i for i, prefix in enumerate(table) if name.startswith(prefix)), None)


def param_rank(name: str) -> int:
    return PARAM_ORDER.get(name.rsplit(".", 1)[-1], 5)


def _expert_inner(rest: str) -> int:
    """Inside the experts module: fc1 before fc2, then the parameter's place."""
    return (0 if rest.startswith("linear_fc1.") else 16) + param_rank(rest)


def layer_order(style: str, suffix: str) -> tuple[int, int]:
    """A key's place inside its layer, as :func:`~megatron_preflight.reshard.plan.index.iter_source_keys` records it
    (planned keys sort by (first, local expert, second)): Megatron's module order, for keys of a bridged spec."""
    experts = rank_in(EXPERTS_MODULE, MODULE_ORDER, 0) * 64
    if style == "seq_expert":
        return experts, _expert_inner(suffix)
    if style == "te_grouped":
        return experts + 1 + _expert_inner(suffix), 0
    if suffix.startswith(EXPERTS_MODULE):  # a grouped linear's one _extra_state
        return experts + 1 + _expert_inner(suffix[len(EXPERTS_MODULE):]), 0
    return rank_in(suffix, MODULE_ORDER, 0) * 64 + param_rank(suffix), 0


@dataclass(frozen=True)
class SpecChange:
    """From the checkpoint's spec (and expert form) to the run's."""

    source: str
    target: str
    source_grouped: bool  # TE grouped experts (weight{j}) in the checkpoint
    target_grouped: bool
    source_packed: bool = False  # the legacy GroupedMLP (experts.weight1/weight2), read as sequential experts

    @property
    def changes(self) -> bool:
        return self.source != self.target or self.source_grouped != self.target_grouped or self.source_packed

    def describe(self) -> str:
        parts = []
        if self.source != self.target:
            parts.append(f"layer spec {self.source} -> {self.target}")
        if self.source_packed:
            parts.append("experts legacy GroupedMLP -> " + ("grouped" if self.target_grouped else "sequential"))
        elif self.source_grouped != self.target_grouped:
            parts.append("experts " + ("grouped -> sequential" if self.source_grouped else "sequential -> grouped"))
        return ", ".join(parts)


def spec_change(saved_args: Any, target_impl: str | None, target_grouped: bool | None,
                moe: bool, packed: bool = False) -> SpecChange:
    """The change a target asks for (None: keep the checkpoint's). Grouped experts are written only in TE's form;
    a local-spec target gets sequential experts whatever ``--moe-grouped-gemm`` says (what Megatron-LM main's local
    spec builds; older ones built the legacy GroupedMLP, which is read — as sequential experts — never written)."""
    source = spec_of(saved_args)
    grouped = grouped_experts(saved_args) and moe
    target = target_impl or source
    want_grouped = grouped if target_grouped is None or hybrid_pattern(saved_args) else bool(target_grouped) and moe
    for name in (source, target):
        if name not in (LOCAL, TE):
            raise PreflightError(f"the layer spec {name!r} is not one the resharder maps (local, transformer_engine)",
                                 fix="reshard at the checkpoint's own --transformer-impl", code="usage")
    if target == LOCAL:
        want_grouped = False
    if grouped and source == LOCAL:
        grouped = False  # the legacy GroupedMLP: its packed weights are indexed as sequential experts
    return SpecChange(source, target, grouped, want_grouped, packed)


LEGACY_GROUPED = {"mlp.experts.weight1": "linear_fc1.weight", "mlp.experts.weight2": "linear_fc2.weight"}


def unpack_legacy_grouped(suffix: str, ref: TensorRef, num_local: int, where: str) -> list[tuple[str, TensorRef]]:
    """GroupedMLP's ``weight1`` / ``weight2`` as each local expert's sequential linear shard: (the expert's suffix,
    a strided view of the same bytes), expert by expert."""
    fc1 = suffix.endswith("weight1")
    if len(ref.shape) != 2 or num_local < 1:
        raise PreflightError(f"{where}: {suffix} has shape {tuple(ref.shape)}, not a 2-D GroupedMLP weight",
                             fix="inspect the checkpoint; it is not one megatron-core's GroupedMLP wrote", code="plan")
    rows, cols = ref.shape
    packed = cols if fc1 else rows  # E_loc · f
    if packed % num_local or tuple(ref.stride) != (cols, 1):
        raise PreflightError(f"{where}: {suffix} of shape {tuple(ref.shape)} does not hold {num_local} local experts "
                             "as GroupedMLP packs them", fix="check --num-experts and the expert-parallel size of "
                             "the checkpoint's args", code="plan")
    f = packed // num_local
    h = rows if fc1 else cols
    out = []
    for j in range(num_local):
        # weight1: expert j is (h, f) at j·h·f, its linear (f, h) is the transpose; weight2: (f, h) -> (h, f)
        shape, stride = ((f, h), (1, f)) if fc1 else ((h, f), (1, h))
        out.append((LEGACY_GROUPED[suffix], TensorRef(ref.file, ref.storage, ref.offset + j * h * f, shape, stride)))
    return out


def _new_entry(key: GlobalKey, swiglu: bool, value: Any = None, like: GlobalEntry | None = None) -> GlobalEntry:
    # the layer number of the info only says "a layer key": the planner places the global layer
    info = info_of_global(*key)
    rule = like.rule if like is not None and like.rule.kind == "sections" else rule_for(info, swiglu=swiglu)
    entry = GlobalEntry(key, info, rule)
    if like is not None:
        entry.pieces = like.pieces
    else:
        entry.add(SourcePiece("", value, 0, 1))
    return entry


def _expert_head(key: GlobalKey) -> str:
    """The module path an expert key's suffix starts with: none in a decoder layer (its layer number says where), an
    MTP layer's transformer layer (``mtp.layers.0.mtp_model_layer.``) there."""
    return "" if key.layer is not None else key.suffix[:key.suffix.index("linear_fc")]


def _plain_suffix(suffix: str, change: SpecChange, dense: bool) -> str | None:
    """A transformer layer's key suffix (a decoder layer's, or an MTP layer's inner layer's) in the target spec; None
    when the target modules have no such entry (extra state only). ``dense``: the layer's MLP is not a MoE."""
    to_te, to_local = change.source == LOCAL and change.target == TE, change.source == TE and change.target == LOCAL
    if to_te:
        for module, fused in LOCAL_SPEC_KEYS.items():
            if suffix.startswith(module) and (module != _MOE_NORM or dense):
                return fused + suffix[len(module):]
    if to_local:
        for module, fused in LOCAL_SPEC_KEYS.items():
            if suffix.startswith(fused):
                return module + suffix[len(fused):]
        if suffix == ATTENTION_EXTRA or (suffix.endswith("._extra_state") and
                                          suffix.startswith((_MOE_NORM, *_TE_NORMS))):
            return None
    if suffix.startswith(EXPERTS_MODULE) and suffix.endswith("._extra_state") and not change.target_grouped:
        return None  # a grouped linear's extra state: the sequential experts get one each
    return suffix


def mtp_inner(suffix: str) -> tuple[str, str] | None:
    """(an MTP layer's inner-layer prefix, the rest) of a top-level key inside an MTP layer's transformer layer."""
    m = _MTP_INNER.match(suffix)
    return (m.group(1), m.group(2)) if m else None


def _rename(key: GlobalKey, change: SpecChange, dense_layers: set[int | str]) -> GlobalKey | None:
    """The key's name in the target spec; None when the target modules have no such entry (extra state only).
    ``dense_layers``: the decoder layers (numbers) and MTP inner layers (prefixes) whose MLP is not a MoE."""
    layer, expert, style, suffix = key
    to_local = change.source == TE and change.target == LOCAL
    if layer is None and style == "plain":
        if to_local and (suffix == _FINAL_NORM + "_extra_state" or _MTP_NORM_EXTRA.match(suffix)):
            return None
        inner = mtp_inner(suffix)
        if inner is not None:
            new = _plain_suffix(inner[1], change, inner[0] in dense_layers)
            return None if new is None else GlobalKey(None, None, style, inner[0] + new)
        if "." + EXPERTS_MODULE in suffix and "local_experts" not in suffix and \
                suffix.endswith("._extra_state") and not change.target_grouped:
            return None  # an MTP layer's grouped linear's extra state: the sequential experts get one each
        return key
    if style == "plain":
        new = _plain_suffix(suffix, change, layer in dense_layers)
        return None if new is None else GlobalKey(layer, None, style, new)
    if style == "te_grouped" and not change.target_grouped:
        return GlobalKey(layer, expert, "seq_expert", suffix)
    if style == "seq_expert" and change.target_grouped:
        return None if suffix.endswith("_extra_state") else GlobalKey(layer, expert, "te_grouped", suffix)
    return key


def bridge(index: OrderedDict[GlobalKey, GlobalEntry], change: SpecChange, *,
           swiglu: bool) -> tuple[OrderedDict[GlobalKey, GlobalEntry], dict[GlobalKey, GlobalKey]]:
    """The global index in the target spec, and old -> new keys of every renamed parameter (what the optimizer state
    follows). Keys keep Megatron's module order of the target spec."""
    dense_layers: set[int | str] = {k.layer for k in index if k.layer is not None and k.style == "plain"
                                    and k.suffix.startswith("mlp.linear_fc1.")}
    mtp_heads: dict[str, bool] = {}  # an MTP inner layer's prefix -> whether it is a MoE layer
    for k in index:
        inner = mtp_inner(k.suffix) if k.layer is None else None
        if inner is not None:
            mtp_heads[inner[0]] = mtp_heads.get(inner[0], False) or k.expert is not None or \
                inner[1].startswith(EXPERTS_MODULE) or inner[1].startswith("mlp.router.")
            if inner[1].startswith("mlp.linear_fc1."):
                dense_layers.add(inner[0])
    moe_layers = {k.layer for k in index if k.layer is not None and k.expert is not None}
    experts: dict[tuple[int | None, str], set[int]] = {}  # (layer, an MTP layer's head) -> its experts
    for k in index:
        if k.expert is not None:
            experts.setdefault((k.layer, _expert_head(k)), set()).add(k.expert)
    out: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    renamed: dict[GlobalKey, GlobalKey] = {}
    for key, entry in index.items():
        new = _rename(key, change, dense_layers)
        if new is None:
            continue
        if new != key:
            renamed[key] = new
            entry = _new_entry(new, swiglu, like=entry)
        if change.target == LOCAL and change.source == TE and new.suffix.endswith("_extra_state"):
            entry = _new_entry(new, swiglu)  # local modules keep None (TE's FP8 metadata has no meaning there)
        out[new] = entry
    made: list[GlobalKey] = []
    if change.target == TE:
        layers = sorted({k.layer for k in out if k.layer is not None})
        for layer in layers:
            made.append(GlobalKey(layer, None, "plain", ATTENTION_EXTRA))
            for norm in _TE_NORMS:
                if GlobalKey(layer, None, "plain", norm + "weight") in out:
                    made.append(GlobalKey(layer, None, "plain", norm + "_extra_state"))
            if layer in moe_layers and GlobalKey(layer, None, "plain", _MOE_NORM + "weight") in out:
                made.append(GlobalKey(layer, None, "plain", _MOE_NORM + "_extra_state"))
        if GlobalKey(None, None, "plain", _FINAL_NORM + "weight") in out:
            made.append(GlobalKey(None, None, "plain", _FINAL_NORM + "_extra_state"))
        for head, moe in mtp_heads.items():  # an MTP layer's inner layer and its own norms, as a layer's above
            mtp = ".".join(head.split(".")[:3]) + "."  # mtp.layers.{d}.
            made.append(GlobalKey(None, None, "plain", head + ATTENTION_EXTRA))
            for norm in _TE_NORMS + ((_MOE_NORM,) if moe else ()):
                if GlobalKey(None, None, "plain", head + norm + "weight") in out:
                    made.append(GlobalKey(None, None, "plain", head + norm + "_extra_state"))
            for norm in _MTP_NORMS:
                if GlobalKey(None, None, "plain", mtp + norm + "weight") in out:
                    made.append(GlobalKey(None, None, "plain", mtp + norm + "_extra_state"))
    for (layer, head), ids in experts.items():
        for linear in ("linear_fc1", "linear_fc2"):
            if change.target_grouped:
                made.append(GlobalKey(layer, None, "plain", f"{head}{EXPERTS_MODULE}{linear}._extra_state"))
            else:
                made += [GlobalKey(layer, e, "seq_expert", f"{head}{linear}._extra_state") for e in sorted(ids)]
    for key in made:
        if key not in out:
            out[key] = _new_entry(key, swiglu)
    return reordered(out), renamed


def reordered(index: OrderedDict[GlobalKey, GlobalEntry]) -> OrderedDict[GlobalKey, GlobalEntry]:
    """Every layer key at its place in the target spec's module order; the others (embedding, final norm, head) in
    their order, the final norm's extra state after its parameters."""
    out: OrderedDict[GlobalKey, GlobalEntry] = OrderedDict()
    top = [k for k in index if k.layer is None]
    top.sort(key=lambda k: (rank_in(k.suffix, ("embedding.", _FINAL_NORM, "decoder.", "output_layer."), 0),
                            param_rank(k.suffix) if k.suffix.startswith(_FINAL_NORM) else 0))
    for n, key in enumerate(top):  # copies: the checkpoint's own index is shared and stays as read
        out[key] = dataclasses.replace(index[key], order=(n, 0))
    for key, entry in index.items():
        if key.layer is not None:
            out[key] = dataclasses.replace(entry, order=layer_order(key.style, key.suffix))
    return out
