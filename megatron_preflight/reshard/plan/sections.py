"""The section sizes of HybridModel's sectioned projections, from the tensors themselves, checked against the args.

A Mamba-2 mixer's ``in_proj`` rows are ``[z | x | B | C | dt]`` = (d_inner, d_inner, G·N, G·N, H) and its depthwise
conv's channels ``[x | B | C]``; a gated delta net's ``in_proj`` rows are ``[query | key | value | z | beta | alpha]``
= (Kd, Kd, Vd, Vd, Hv, Hv) and its conv's ``[query | key | value]``. Every section is split over TP on its own, so the
rows of TP1 are not the concatenation of the TP ranks' rows. The sizes follow from the global lengths of the layer's
other tensors (Mamba: ``norm.weight`` = d_inner, ``D`` = H; GDN: ``out_proj`` columns = Vd, ``dt_bias`` = Hv), so they
are right whatever names a release gives its args; where the saved args give them too, both must agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.plan.rules import SECTION_FAMILIES, Rule
from megatron_preflight.reshard.plan.types import GlobalEntry, GlobalKey

_MODULE = {"mamba_in": "mixer.", "mamba_conv": "mixer.", "gdn_in": "self_attention.", "gdn_conv": "self_attention."}


def _int_arg(args: Any, name: str) -> int | None:
    value = getattr(args, name, None) if args is not None else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _lengths(index: dict[GlobalKey, GlobalEntry], key: GlobalKey, module: str) -> dict[str, int]:
    """The global length along the split dim of every split tensor of ``key``'s module (suffix after the module)."""
    cut = key.suffix.index(module) + len(module)
    prefix = key.suffix[:cut]
    out: dict[str, int] = {}
    for other, entry in index.items():
        if other.layer == key.layer and other.suffix.startswith(prefix) and entry.rule.dim is not None:
            length = entry.global_len()
            if length is not None:
                out[other.suffix[cut:]] = length
    return out


def _mamba(lengths: dict[str, int], args: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    d_inner, heads = lengths.get("norm.weight"), lengths.get("D") or lengths.get("dt_bias")
    conv = next((lengths[n] for n in ("conv1d_weight", "conv1d.weight") if n in lengths), None)
    if d_inner is None:
        head_dim, n_heads = _int_arg(args, "mamba_head_dim"), _int_arg(args, "mamba_num_heads") or heads
        d_inner = head_dim * n_heads if head_dim and n_heads else None
    if d_inner is None or heads is None or conv is None or (conv - d_inner) % 2 or conv <= d_inner:
        return "its norm, D and conv1d tensors do not give d_inner, the heads and the state"
    bc = (conv - d_inner) // 2  # ngroups · d_state
    groups, state = _int_arg(args, "mamba_num_groups"), _int_arg(args, "mamba_state_dim")
    if groups and state and groups * state != bc:
        return (f"its conv1d has {conv} channels = d_inner {d_inner} + 2 x {bc}, but the args say mamba_num_groups "
                f"{groups} x mamba_state_dim {state} = {groups * state}")
    return (d_inner, d_inner, bc, bc, heads), (d_inner, bc, bc)


def _gdn(lengths: dict[str, int], args: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    v_dim, v_heads, conv = lengths.get("out_proj.weight"), lengths.get("dt_bias"), lengths.get("conv1d.weight")
    if v_dim is None or v_heads is None or conv is None or (conv - v_dim) % 2 or conv <= v_dim:
        return "its out_proj, dt_bias and conv1d tensors do not give the key, value and head sizes"
    qk = (conv - v_dim) // 2
    key_dim, key_heads = _int_arg(args, "linear_key_head_dim"), _int_arg(args, "linear_num_key_heads")
    val_dim, val_heads = _int_arg(args, "linear_value_head_dim"), _int_arg(args, "linear_num_value_heads")
    if key_dim and key_heads and key_dim * key_heads != qk:
        return f"its conv1d gives {qk} key channels, the args {key_heads} key heads x {key_dim}"
    if val_dim and val_heads and (val_dim * val_heads != v_dim or val_heads != v_heads):
        return f"its out_proj and dt_bias give {v_dim} value channels in {v_heads} heads, the args " \
               f"{val_heads} x {val_dim}"
    return (qk, qk, v_dim, v_dim, v_heads, v_heads), (qk, qk, v_dim)


def resolve(index: dict[GlobalKey, GlobalEntry], args: Any, where: str | None = None) -> None:
    """Replace every section family rule in ``index`` by its ``sections`` rule (in place). Raises a clear error
    when the layer's tensors do not give consistent sizes."""
    for key, entry in index.items():
        family = entry.rule.kind
        if family not in SECTION_FAMILIES:
            continue
        module = _MODULE[family]
        lengths = _lengths(index, key, module)
        found = (_mamba if family.startswith("mamba") else _gdn)(lengths, args)
        if isinstance(found, str):
            raise PreflightError(f"{entry.info.render(key.layer, key.expert)}: the sections of this "
                                 f"{'Mamba' if family.startswith('mamba') else 'gated delta net'} projection cannot be "
                                 f"sized: {found}", path=where, code="inconsistent_shards",
                                 fix="the checkpoint's tensors and args disagree: inspect it with `megatron-preflight "
                                     "inspect`, or restore it from a good copy")
        parts = found[0] if family.endswith("_in") else found[1]
        total = entry.global_len()
        if total is not None and sum(parts) != total:
            raise PreflightError(f"{entry.info.render(key.layer, key.expert)} has {total} rows, but its layer's other "
                                 f"tensors give sections {parts} ({sum(parts)} rows)", path=where,
                                 code="inconsistent_shards",
                                 fix="the checkpoint's tensors disagree with each other: restore it from a good copy")
        index[key] = dataclasses.replace(entry, rule=Rule("sections", entry.rule.group, parts))


def sectioned(rule: Rule) -> bool:
    return rule.kind == "sections" or rule.kind in SECTION_FAMILIES


def adopt(fields: dict[GlobalKey, Any], index: dict[GlobalKey, GlobalEntry]) -> None:
    """Give the optimizer state of every sectioned parameter its parameter's resolved rule (in place): the state
    fields are indexed from the same files, tensor by tensor, and split as the parameter is."""
    for gkey, per_name in fields.items():
        model = index.get(gkey)
        if model is None or model.rule.kind != "sections":
            continue
        for name, field in per_name.items():
            if isinstance(field, GlobalEntry) and field.rule.kind in SECTION_FAMILIES:
                per_name[name] = dataclasses.replace(field, rule=model.rule)
