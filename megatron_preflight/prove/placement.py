"""Where a planned tensor of a run's rank sits in its global tensor: the boxes it holds (the split rule, the run's
layout, the rank's TP / ETP coordinates; vocab padding rows left out), the tensor's global name (in the run's spec or
in the checkpoint's), and its expected value rebuilt from the checkpoint. What ``--preflight verify`` hashes on every
rank."""

from __future__ import annotations

from typing import Any

from megatron_preflight.reshard.execute.executor import build_tensor
from megatron_preflight.reshard.plan.rules import Rule, canonical_name, segments
from megatron_preflight.reshard.plan.types import TensorPlan
from megatron_preflight.reshard.resharder import Resharder
from megatron_preflight.reshard.sources.files import SourceFiles

Box = tuple[tuple[slice, ...], tuple[int, ...], tuple[int, ...]]  # (local slice, global shape, global offsets)


def boxes(r: Resharder, tp: TensorPlan, coords: dict[str, int]) -> list[Box]:
    """Each box of the global tensor that the planned tensor ``tp`` of the rank at ``coords`` holds."""
    assert tp.gkey is not None and tp.shape is not None
    rule = r.index[tp.gkey].rule
    shape = tuple(tp.shape)
    full = tuple(slice(0, s) for s in shape)
    if rule.dim is None or not shape:
        return [(full, shape, (0,) * len(shape))]
    dim = rule.dim
    rank, size = (coords["etp"], r.tgt.etp_eff) if rule.group == "etp" else (coords["tp"], r.tgt.tp)
    global_len = shape[dim] * size
    real = None
    if rule.kind == "vocab":
        real = r.vocab.real if r.vocab is not None else None
        rule = Rule("column", rule.group)
    out: list[Box] = []
    for gstart, n, lstart in segments(rule, global_len, size, rank):
        if real is not None:
            n = max(0, min(n, real - gstart))
            if n == 0:
                continue
        gshape = list(shape)
        gshape[dim] = real if real is not None else global_len
        local = list(full)
        local[dim] = slice(lstart, lstart + n)
        offsets = [0] * len(shape)
        offsets[dim] = gstart
        out.append((tuple(local), tuple(gshape), tuple(offsets)))
    return out


def global_name(r: Resharder, tp: TensorPlan) -> str:
    """The tensor's key at TP1·PP1·EP1 (global layer and expert numbers): the name its fingerprint is stored under."""
    assert tp.gkey is not None
    return canonical_name(r.index[tp.gkey].info.render(tp.gkey.layer, tp.gkey.expert))


def checkpoint_name(r: Resharder, tp: TensorPlan) -> str:
    """The tensor's key at TP1·PP1·EP1 in the checkpoint's own layer spec: the name the checkpoint's fingerprints
    use (a run that bridges specs holds it under another: a TE checkpoint's ``linear_fc1.layer_norm_weight`` is a
    local-spec run's ``pre_mlp_layernorm.weight``)."""
    assert tp.gkey is not None
    key = r.source_keys.get(tp.gkey, tp.gkey)
    return canonical_name(r.checkpoint.tensors[key].info.render(key.layer, key.expert))


def expected(tp: TensorPlan, files: SourceFiles) -> Any:
    """The planned tensor, rebuilt from the checkpoint."""
    return build_tensor(tp, files)


def global_indices(local_shape: tuple[int, ...], where: list[Box], start: int, end: int) -> Any:
    """The global flat index of each element ``start:end`` of the flattened local tensor (``-1`` outside every box:
    vocab padding rows)."""
    import torch  # deferred: indices are tensors

    pos = torch.arange(start, end, dtype=torch.int64)
    out = torch.full_like(pos, -1)
    rest = pos.clone()
    multi = []
    for size in reversed(local_shape):
        multi.append(rest % size)
        rest = rest // size
    multi.reverse()
    for local, gshape, offsets in where:
        inside = torch.ones_like(pos, dtype=torch.bool)
        index = torch.zeros_like(pos)
        stride = 1
        for d in reversed(range(len(local_shape))):
            lo, hi = local[d].start, local[d].stop
            inside &= (multi[d] >= lo) & (multi[d] < hi)
            index += (multi[d] - lo + offsets[d]) * stride
            stride *= gshape[d]
        out = torch.where(inside, index, out)
    return out
