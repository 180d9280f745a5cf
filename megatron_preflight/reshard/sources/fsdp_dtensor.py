"""Megatron-FSDP's ``fsdp_dtensor`` checkpoints as a source of the resharder, seen through torch_dist's names.

An fsdp_dtensor save is a torch DCP directory like torch_dist, every tensor at its full global shape, but named
after the FSDP-wrapped module: ``model.module.<name>`` (one tensor per decoder layer, ``decoder.layers.<g>.``),
SwiGLU's fc1 as two tensors ``<param>_w`` / ``<param>_v``, experts one tensor each by global index
(``mlp.experts.local_experts.<e>.`` sequential, ``mlp.experts.linear_fc1.weight<e>`` grouped), the Adam state as
``optimizer.state.<module prefixes><name>.<exp_avg|exp_avg_sq>`` and each parameter's group settings as bytes items
``optimizer.param_to_group_meta.<...>.<setting>``. No Transformer Engine extra state is saved.

:func:`translate` renames that into the metadata a torch_dist save of the same model would have — heterogeneous
layer keys (``decoder.layers.<g>.<name>``), experts stacked along a leading dim, SwiGLU's halves one tensor
``[w; v]``, the state as ``optimizer.state.<field>.<name>`` with the model's own fp32 tensor as the master
(``param``) — whose chunks point at the same bytes. Every torch_dist reader (the virtual legacy shards, the
model-space optimizer state, the region reader) then works unchanged (they read it through
:func:`~megatron_preflight.reshard.sources.torch_dist_reader.source_metadata`). :func:`param_groups` makes the param
groups from the per-parameter settings. The one place that knows fsdp_dtensor's names.
"""

from __future__ import annotations

import os
import re
import types
from dataclasses import dataclass
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.dist import (
    FSDP_MODEL,
    FSDP_OPTIMIZER_STATE,
    FSDP_WRAPPER,
    ObjectReader,
    object_index,
    read_dcp_metadata,
    strip_modules,
)
from megatron_preflight.reshard.plan.rules import mtp_spellings

GROUP_META = "optimizer.param_to_group_meta."
_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.+)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_FC1 = r"^(.*\.linear_fc1\.(?:weight|bias)\d*)"  # a (dense, shared or expert) fc1 parameter
_HALF = re.compile(_FC1 + r"_([wv])$")  # one of SwiGLU's halves of it
_GLU = re.compile(_FC1 + "$")
HALVES = ("w", "v")  # SwiGLU fc1's [gate; up], in that order
MODEL_PREFIX = FSDP_MODEL + FSDP_WRAPPER  # a parameter's key: model.module.<name>
# modules that Transformer Engine's spec builds with an ``_extra_state`` (besides every ``linear_*``); see
# reshard.plan.spec for the same facts about spec changes
_TE_NORM_MODULES = ("pre_mlp_layernorm", "q_layernorm", "k_layernorm",
                    "final_layernorm", "enorm", "hnorm", "eh_proj")  # (the decoder's and an MTP layer's own)
# An MTP layer's transformer layer in an fsdp_dtensor save, by the release that wrote it: ``transformer_layer``
# before megatron-core 0.17; ``mtp_model_layer`` in 0.17-0.19 (tensors and settings); main (0.20) names the tensors
# ``transformer_layer`` again and the settings ``mtp_model_layer``. Megatron-FSDP's load is partial by default (a
# name it does not find is skipped, the weight left at its init), so what the resharder writes or serves carries
# each such entry under both names, the same bytes (:func:`aliases`).
_MTP = ".mtp.layers."


@dataclass(frozen=True)
class _Index:
    """A storage key (``MetadataIndex``'s fields the readers use)."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None


@dataclass
class _ChunkMeta:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class _TensorMeta:
    size: tuple[int, ...]
    properties: Any
    chunks: list[_ChunkMeta]


class _ObjectMeta:
    """A bytes item with no bytes: a module's extra state the save left out (read as None)."""


def state_prefix(half: bool) -> str:
    """The module prefix of a parameter's name in the optimizer state (``optimizer.state.<prefix><name>.<field>``, and
    ``optimizer.param_to_group_meta.<prefix><name>.<setting>``): the FSDP wrappers, one more (Float16Module) under
    bf16 / fp16."""
    return FSDP_WRAPPER * (3 if half else 2)


def saved_names(name: str, glu: bool) -> list[tuple[str, int | None]]:
    """The names a parameter's global (TP1) name is saved under, with the half of its rows each holds (None: all):
    SwiGLU's fc1 as ``<name>_w`` (gate, half 0) and ``<name>_v`` (up, half 1). The inverse of the reader's renaming."""
    if glu and _GLU.match(name):
        return [(f"{name}_{h}", i) for i, h in enumerate(HALVES)]
    return [(name, None)]


def aliases(fqn: str) -> list[str]:
    """The other names of an fsdp_dtensor entry (an MTP layer's transformer layer under the other release's name,
    by the resharder's one MTP naming rule); none for every other entry."""
    at = fqn.find(_MTP)
    if at < 0:
        return []
    head, key = fqn[:at + 1], fqn[at + 1:]
    return [head + other for other in mtp_spellings(key)[1:]]


def is_alias(fqn: str, present: Any) -> bool:
    """Whether ``fqn`` is a second name of an entry also in ``present`` under another name (the first name in sorted
    order is the entry, the rest its aliases): a reader takes each entry once."""
    others = [a for a in aliases(fqn) if a in present]
    return bool(others) and fqn > min(others)


def _place(name: str) -> tuple[str, tuple[int, ...], str | None]:
    """torch_dist's name of a model tensor, its index along the stacked expert dim, and which SwiGLU half it is."""
    half = None
    m = _HALF.match(name)
    if m:
        name, half = m.group(1), m.group(2)
    m = _SEQUENTIAL.match(name)
    if m:
        return f"{m.group(1)}.experts.{m.group(3)}", (int(m.group(2)),), half
    m = _GROUPED.match(name)
    if m:
        return f"{m.group(1)}.experts.{m.group(2)}.{m.group(3)}", (int(m.group(4)),), half
    return name, (), half


def _tensor_name(fqn: str) -> tuple[str, str] | None:
    """(the model tensor's name, the state field) of an fsdp_dtensor tensor key (field ``""`` for a weight), or None
    for what is not model or optimizer state (RNG states)."""
    if fqn.startswith(FSDP_MODEL):
        return strip_modules(fqn[len(FSDP_MODEL):]), ""
    if fqn.startswith(FSDP_OPTIMIZER_STATE):
        name, _, field = fqn[len(FSDP_OPTIMIZER_STATE):].rpartition(".")
        return strip_modules(name), field
    return None


_TRANSLATED: dict[int, tuple[Any, Any]] = {}


def translated(md: Any, iter_dir: str) -> Any:
    """:func:`translate` of the fsdp_dtensor ``.metadata`` ``md``, made once per metadata object."""
    hit = _TRANSLATED.get(id(md))
    if hit is not None and hit[0] is md:
        return hit[1]
    out = translate(md, iter_dir)
    if len(_TRANSLATED) >= 8:
        _TRANSLATED.pop(next(iter(_TRANSLATED)))
    _TRANSLATED[id(md)] = (md, out)
    return out


def translate(md: Any, iter_dir: str) -> Any:
    """torch_dist's view of an fsdp_dtensor ``.metadata`` (same chunks, same bytes; see the module docstring)."""
    where = {(i.fqn, tuple(i.offset)): info for i, info in md.storage_data.items()
             if getattr(i, "offset", None) is not None}
    pieces: dict[str, list[tuple[tuple[int, ...], str | None, str, Any]]] = {}
    for fqn, tm in md.state_dict_metadata.items():
        if getattr(tm, "size", None) is None or is_alias(fqn, md.state_dict_metadata):
            continue
        named = _tensor_name(fqn)
        if named is None:
            continue
        name, field = named
        vname, lead, half = _place(name)
        target = f"optimizer.state.{field}.{vname}" if field else vname
        pieces.setdefault(target, []).append((lead, half, fqn, tm))
    path = os.path.join(iter_dir, ".metadata")
    state: dict[str, Any] = {}
    storage: dict[_Index, Any] = {}
    for target, parts in pieces.items():
        state[target] = _merge(target, parts, where, storage, path)
    has_state = any(t.startswith("optimizer.state.") for t in state)
    half = _half_dtype(md, iter_dir)
    for target in [t for t in state if not t.startswith("optimizer.")]:
        meta = state[target]
        if not str(meta.properties.dtype).endswith("float32"):
            continue
        if has_state:
            # Megatron-FSDP saves the fp32 main weights as the model's: they are the optimizer's masters
            alias = f"optimizer.state.param.{target}"
            state[alias] = meta
            for c in meta.chunks:
                storage[_Index(alias, c.offsets)] = storage[_Index(target, c.offsets)]
        if half is not None:  # a bf16 / fp16 run's model weights: its fp32 main weights, rounded as Megatron does
            state[target] = _TensorMeta(meta.size, types.SimpleNamespace(dtype=half), meta.chunks)
    for module in _extra_state_modules(state):
        state[module] = _ObjectMeta()
    return types.SimpleNamespace(state_dict_metadata=state, storage_data=storage, planner_data=None,
                                 storage_meta=getattr(md, "storage_meta", None))


def _half_dtype(md: Any, iter_dir: str) -> Any:
    """The model's dtype when the saving run was bf16 / fp16 (its saved ``args``), else None."""
    info = object_index(md).get("args")
    if info is None:
        return None
    reader = ObjectReader(iter_dir)
    try:
        args = reader.read("args", info)
    finally:
        reader.close()
    if getattr(args, "bf16", False):
        return dtypes.dtype("bfloat16")
    return dtypes.dtype("float16") if getattr(args, "fp16", False) else None


def _merge(target: str, parts: list[tuple[tuple[int, ...], str | None, str, Any]], where: dict[Any, Any],
           storage: dict[_Index, Any], path: str) -> _TensorMeta:
    """One torch_dist tensor from its fsdp_dtensor pieces (experts stacked, SwiGLU halves ``[w; v]``)."""
    base = {tuple(int(d) for d in tm.size) for _lead, _half, _fqn, tm in parts}
    halves = {half for _lead, half, _fqn, _tm in parts}
    leads = sorted({lead for lead, _half, _fqn, _tm in parts})
    if len(base) != 1 or (halves != {None} and halves != {"w", "v"}) or \
            (leads and leads[0] and leads != [(e,) for e in range(len(leads))]):
        raise PreflightError(f"the pieces of {target} disagree (shapes {sorted(base)}, SwiGLU halves "
                             f"{sorted(h or '-' for h in halves)}, experts {leads}): not an fsdp_dtensor save this "
                             "reader knows", path=path, code="inconsistent_shards",
                             fix="restore the iteration dir from a complete copy, or convert it with Megatron-FSDP")
    shape = next(iter(base))
    rows = shape[0] if shape else 0
    full = ((2 * rows,) + shape[1:]) if halves == {"w", "v"} else shape
    n_lead = len(leads[0]) if leads else 0
    size = ((len(leads),) if n_lead else ()) + full
    chunks: list[_ChunkMeta] = []
    dtype_props = parts[0][3].properties
    for lead, half, fqn, tm in parts:
        shift = rows if half == "v" else 0
        for c in tm.chunks:
            off = tuple(int(o) for o in c.offsets)
            sz = tuple(int(s) for s in c.sizes)
            info = where.get((fqn, off))
            if info is None:
                raise PreflightError(f"tensor {fqn}: the chunk at offset {off} has no entry in the storage index",
                                     path=path, code="corrupt_file",
                                     fix="restore the iteration dir from a complete copy")
            new_off = lead + ((off[0] + shift,) + off[1:] if off else ())
            new_sz = (1,) * n_lead + sz
            chunks.append(_ChunkMeta(new_off, new_sz))
            storage[_Index(target, new_off)] = info
    return _TensorMeta(size, dtype_props, chunks)


def _extra_state_modules(state: dict[str, Any]) -> list[str]:
    """The ``_extra_state`` items a Transformer Engine spec save would hold for these tensors (as torch_dist keys:
    ``<module>._extra_state/shard_<index>_<count>``, experts by index): every linear, TE's norms."""
    out: dict[str, None] = {}
    for name, meta in state.items():
        if name.startswith("optimizer."):
            continue
        module = name.rpartition(".")[0]
        leaf = module.rpartition(".")[2]
        if not (leaf.startswith("linear_") or leaf in _TE_NORM_MODULES):
            continue
        base = f"{module}._extra_state"
        if ".mlp.experts.experts." in base:
            count = meta.size[0]
            for e in range(count):
                out[f"{base}/shard_{e}_{count}"] = None
        else:
            out[f"{base}/shard_0_1"] = None
    return list(out)


def param_groups(iter_dir: str, *, trust: bool = False) -> list[dict[str, Any]]:
    """The optimizer's param groups of an fsdp_dtensor save: each distinct set of per-parameter settings
    (``optimizer.param_to_group_meta.<param>.<setting>``, ``step`` included), in first-seen order."""
    md = read_dcp_metadata(iter_dir, trust=trust)
    per_param: dict[str, dict[str, Any]] = {}
    reader = ObjectReader(iter_dir, trust=trust)
    try:
        for fqn, info in object_index(md).items():
            if not fqn.startswith(GROUP_META):
                continue
            param, _, setting = fqn[len(GROUP_META):].rpartition(".")
            per_param.setdefault(param, {})[setting] = reader.read(fqn, info)
    finally:
        reader.close()
    groups: list[dict[str, Any]] = []
    seen: set[str] = set()
    for settings in per_param.values():
        sig = repr(sorted(settings.items()))
        if sig not in seen:
            seen.add(sig)
            groups.append(dict(settings, params=[]))
    return groups
