"""The byte ranges of its source files a rank's plan reads — what a remote checkpoint must fetch before the rank
builds its state dict (remote/mirror.py), and nothing else.

- a torch_dist / fsdp_dtensor piece: every saved chunk its boxes overlap, each chunk's blob whole (a chunk is one
  saving rank's piece: the blob's header and its bytes);
- a Hugging Face tensor: its byte runs, only the rows the op copies when it splits rows (dim 0); an FP8 run's rows
  and the scale rows that cover them;
- anything else (a legacy shard's tensor): its whole file (a legacy checkpoint is fetched whole)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.layout.hf.safetensors import SafeRef
from megatron_preflight.layout.hf.stacked import XRun
from megatron_preflight.reshard.plan.types import CopyOp, RankPlan, TensorPlan, flat_parts, planned
from megatron_preflight.reshard.sources.torch_dist_reader import RegionRef, dist_reader

Ranges = dict[str, list[tuple[int, int]]]  # file path -> (offset, length)


def read_plans(plan: RankPlan) -> list[TensorPlan]:
    """Every tensor the plan builds from source slices: model and optimizer state, and each parameter's state inside
    a distributed optimizer's world tensors."""
    out = list(planned(plan))
    for _, fp in flat_parts(plan.dist_optimizer):
        out += [tp for _, tp in fp.parts]
    return [tp for tp in out if tp.shape is not None]


def plan_byte_ranges(plan: RankPlan, iter_dir: str, *, trust: bool = False, extra: Iterable[Any] = ()) -> Ranges:
    """file path -> the (offset, length) ranges ``plan`` reads of it (see the module docstring); ``extra``: other
    source pieces read whole beside the plan (the sampled fp32 masters and weights of a distributed optimizer)."""
    out: Ranges = defaultdict(list)
    reader = None
    refs = [(ref, op) for tp in read_plans(plan) for op in tp.ops for ref in (op.ref, *(r for _, r in op.replicas))]
    refs += [(ref, None) for ref in extra]
    for ref, op in refs:
        if isinstance(ref, RegionRef):
            reader = reader or dist_reader(iter_dir, trust=trust)  # (opens no file: the chunk index only)
            for slab in ref.slabs:
                for c in reader.chunks_meeting(slab):
                    out[os.path.join(iter_dir, c.file)].append((c.start, c.length))
        elif isinstance(ref, SafeRef):
            _safe_ranges(ref, op, iter_dir, out)
        elif getattr(ref, "file", None):
            out[ref.file].append((0, 1 << 62))  # (clipped to the file's size by whoever fetches)
    return dict(out)


def _rows(ref: SafeRef, op: CopyOp | None) -> tuple[int, int]:
    """The rows [first, last) of ``ref`` the op copies (every row without one)."""
    rows = ref.shape[0] if ref.shape else 1
    if op is not None and op.src is not None and op.src[0] == 0:
        return op.src[1], op.src[1] + op.src[2]
    return 0, rows


def _safe_ranges(ref: SafeRef, op: CopyOp | None, model_dir: str, out: Ranges) -> None:
    first, last = _rows(ref, op)
    if ref.quant:
        for q in ref.quant:
            a, b = max(first, q.dst_row0), min(last, q.dst_row0 + q.rows)
            if a >= b:
                continue
            if isinstance(q, XRun):
                for file, start, n in q.byte_ranges(a, b):
                    out[os.path.join(model_dir, file)].append((start, n))
                continue
            s0, k = q.src_row0 + a - q.dst_row0, b - a
            out[os.path.join(model_dir, q.file)].append((q.start + s0 * q.row_bytes, k * q.row_bytes))
            if q.shape_check:  # (a pack-quantized weight's stored [R, C], checked as it is read)
                file, start, dtype, _ = q.shape_check
                out[os.path.join(model_dir, file)].append((start, 2 * dtypes.dtype(dtype).itemsize))
            br = q.block[0]
            lo, hi = s0 // br, (s0 + k - 1) // br + 1
            width = q.scale_cols * dtypes.dtype(q.scale_dtype).itemsize
            out[os.path.join(model_dir, q.scale_file)].append((q.scale_start + lo * width, (hi - lo) * width))
        return
    lo, hi = first * ref.row_bytes, last * ref.row_bytes
    for r in ref.runs:
        a, b = max(lo, r.dst), min(hi, r.dst + r.nbytes)
        if a < b:
            out[os.path.join(model_dir, r.file)].append((r.start + a - r.dst, b - a))


def relative(ranges: Ranges, root: str) -> dict[str, list[tuple[int, int]]]:
    """``ranges`` keyed by paths relative to ``root`` (``/``-separated: an object's key under its prefix)."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for path, rs in ranges.items():
        out[os.path.relpath(path, root).replace(os.sep, "/")].extend(rs)
    return dict(out)


def total(ranges: Any) -> int:
    return sum(n for rs in ranges.values() for _, n in rs)
