"""Execute a rank plan: read only the planned source slices into freshly allocated tensors (through the files'
mappings; a streaming writer's reused buffers take contiguous runs with plain file I/O: ``build_rows(out=)``)."""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from megatron_preflight import crc, dtypes
from megatron_preflight.held_tensor import HeldTensor
from megatron_preflight.reshard.arrays import TORCH, Kit
from megatron_preflight.reshard.plan.types import FlatPlan, RankPlan, TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.tree import map_leaves

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


def _narrow(t: torch.Tensor, spec: tuple[int, int, int] | None, kit: Kit = TORCH) -> torch.Tensor:
    if spec is None:
        return t
    return kit.narrow(t, *spec)


def build_tensor(tp: TensorPlan, files: SourceFiles, release: bool = False) -> torch.Tensor:
    """One planned target tensor, filled from its source slices (``release``: drop each source's mapped pages right
    after its slice is copied, so the resident set stays near the target tensor)."""
    assert tp.shape is not None
    return build_rows(tp, files, 0, tp.shape[0] if tp.shape else 1, release)


class Stage:
    """A reused buffer that a source's rows are read into (plain file I/O) when their place in the built rows is not
    contiguous (a tensor split along a later dim: each source's rows land in a column band), then copied into place:
    no mapping paged in, the record's CRC-32 chained from the reads."""

    def __init__(self, kit: Kit) -> None:
        self.kit = kit
        self._buf: Any = None

    def take(self, nbytes: int) -> Any:
        if self._buf is None or self.kit.nbytes(self._buf) < nbytes:
            self._buf = self.kit.buffer(nbytes)
        return self._buf


def build_rows(tp: TensorPlan, files: SourceFiles, r0: int, r1: int, release: bool = False,
               out: Any = None, spans: list[Span] | None = None, kit: Kit = TORCH, stage: Stage | None = None) -> Any:
    """Rows ``r0:r1`` (along dim 0) of a planned target tensor: what a streaming writer needs to hold at a time.

    With ``out`` (a flat uint8 buffer of at least the rows' bytes, reused by the caller) the rows are built in it, and
    a source slice that is one contiguous run of a file is read straight into place with plain file I/O
    (:meth:`SourceFiles.read_rows`); the caller then owes :meth:`SourceFiles.finish` before trusting the bytes.
    ``spans`` (with ``out``) gets a :data:`Span` per op: where its bytes went and their CRC-32 when they were read
    that way (:func:`tiled_crc` makes the rows' CRC-32 from them). ``kit``: the kind of array (torch tensors; or
    numpy arrays of the elements' bytes, :data:`~.arrays.BYTES`, from legacy sources without torch). ``stage`` (with
    ``out``): where whole source rows whose place is not contiguous are read first (:class:`Stage`)."""
    assert tp.shape is not None
    whole = not tp.shape or (r0 == 0 and r1 == tp.shape[0])
    shape = tp.shape if whole else (r1 - r0, *tp.shape[1:])
    if out is None:
        dst = kit.new(shape, tp.dtype, bool(tp.zero_fill))  # planned padding: zeros
    else:
        n = 1
        for size in shape:
            n *= size
        dst = kit.view(out, tp.dtype, shape, n)
        if tp.zero_fill:
            kit.zero(dst)
    for op in tp.ops:
        # d: where the op's part of rows r0:r1 goes; rows: the source rows it takes when it takes whole rows of one
        # run; pick: that part of the source tensor
        src_spec = _cut(op.src, getattr(op.ref, "shape", None))
        if whole:
            d, rows = _narrow(dst, op.dst, kit), _rows(src_spec, getattr(op.ref, "shape", None))
            pick = functools.partial(_narrow, spec=src_spec, kit=kit)
        elif op.dst is None or op.dst[0] != 0:  # whole tensor, or split along another dim: rows line up
            d, rows = _narrow(dst, op.dst, kit), (r0, r1 - r0) if src_spec is None else None
            pick = functools.partial(_rows_then, r0=r0, n=r1 - r0, spec=src_spec, kit=kit)
        else:  # split along dim 0: the part of this op that falls in r0:r1
            assert op.src is not None
            _, d_start, n = op.dst
            lo, hi = max(d_start, r0), min(d_start + n, r1)
            if lo >= hi:
                continue
            d, rows = kit.narrow(dst, 0, lo - r0, hi - lo), (op.src[1] + lo - d_start, hi - lo)
            pick = functools.partial(_rows_then, r0=rows[0], n=rows[1], spec=None, kit=kit)
        if out is not None and rows is not None:
            value = _read_direct(op, files, d, rows, tp.dtype, kit)
            if spans is not None:
                spans.append((kit.address(d) - kit.address(dst), kit.nbytes(d), value))
            if value is not None:
                continue
            if stage is not None and _read_staged(op, files, d, rows, tp.dtype, kit, stage):
                continue  # (its span has no CRC-32 of the bytes as placed: the writer takes it over the rows)
        elif spans is not None:
            spans.append((0, 0, None))  # copied through the mapping: no CRC-32 taken
        part = kit.rows(files, op.shard, op.ref, *rows) if rows is not None else None
        if part is not None:  # the op's rows read alone (pick takes exactly these rows)
            src = s = part
        else:
            src = kit.source(files, op.shard, op.ref)
            s = pick(src)
        if tuple(s.shape) != tuple(d.shape):
            raise RuntimeError(f"plan error for {tp.key}: source slice {tuple(s.shape)} vs target {tuple(d.shape)}")
        kit.copy(d, s)
        files.bytes_read += kit.nbytes(s)
        if release:
            del s, src
            files.release(op.shard, op.ref)
    return dst


def _rows_then(t: Any, r0: int, n: int, spec: tuple[int, int, int] | None, kit: Kit = TORCH) -> Any:
    return _narrow(kit.narrow(t, 0, r0, n), spec, kit)


def _cut(spec: tuple[int, int, int] | None, shape: tuple[int, ...] | None) -> tuple[int, int, int] | None:
    """``spec``, or None when it keeps its dim whole (a plan may name a source's full width: a TP merge along a
    later dim): then whole rows of the source are read."""
    if spec is None or shape is None or spec[0] >= len(shape):
        return spec
    dim, start, length = spec
    return None if start == 0 and length == shape[dim] else spec


def _rows(spec: tuple[int, int, int] | None, shape: tuple[int, ...] | None) -> tuple[int, int] | None:
    """(first row, rows) of a source piece of ``shape`` narrowed by ``spec`` when the narrowing keeps whole rows."""
    if not shape:
        return None
    if spec is None:
        return 0, shape[0]
    return (spec[1], spec[2]) if spec[0] == 0 else None


def _read_direct(op: Any, files: SourceFiles, d: Any, rows: tuple[int, int], dtype: Any, kit: Kit) -> int | None:
    """Read the op's source rows straight into ``d`` (elements of ``dtype``) when they are one run of a file, of
    ``d``'s shape and dtype: the CRC-32 of the bytes read; None when not read."""
    ref = op.ref
    if not kit.contiguous(d) or kit.nbytes(d) == 0 or tuple(d.shape) != (rows[1], *ref.shape[1:]) or \
            dtypes.name_of(ref.dtype) != dtypes.name_of(dtype):
        return None
    return files.read_rows(op.shard, ref, rows[0], kit.as_bytes(d))


def _read_staged(op: Any, files: SourceFiles, d: Any, rows: tuple[int, int], dtype: Any, kit: Kit, stage: Stage
                 ) -> bool:
    """Read the op's source rows (one run of a file, of ``d``'s shape and dtype) into ``stage``, then copy them into
    ``d`` (not contiguous); False when they are not one run (nothing read)."""
    ref = op.ref
    shape = (rows[1], *ref.shape[1:])
    if tuple(d.shape) != shape or dtypes.name_of(ref.dtype) != dtypes.name_of(dtype) or kit.nbytes(d) == 0:
        return False
    n = kit.nbytes(d) // ref.dtype.itemsize
    buf = stage.take(kit.nbytes(d))
    if files.read_rows(op.shard, ref, rows[0], kit.as_bytes(buf[:kit.nbytes(d)])) is None:
        return False
    kit.copy(d, kit.view(buf, dtype, shape, n))
    return True


# (byte offset in the built rows, bytes, their CRC-32 or None when none was taken): where one op's bytes went
Span = tuple[int, int, "int | None"]


def tiled_crc(spans: list[Span], nbytes: int) -> int | None:
    """The CRC-32 of built rows of ``nbytes`` bytes when ``spans`` (from :func:`build_rows`) cover them end to end,
    each with its CRC-32 (combined: no pass over the bytes); None otherwise (planned padding, a piece copied through
    a mapping): take it from the bytes."""
    value, at = 0, 0
    for start, n, piece in sorted(spans, key=lambda s: s[0]):
        if piece is None or start != at:
            return None
        value, at = crc.combine(value, piece, n), at + n
    return value if at == nbytes else None


def build_flat(fp: Any, files: SourceFiles) -> torch.Tensor:
    """A distributed optimizer's world tensor (:class:`~megatron_preflight.reshard.plan.types.FlatPlan`): each planned state flattened at its
    offset, zeros between."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    out = torch.zeros(fp.numel, dtype=fp.dtype)
    for start, tp in fp.parts:
        t = build_tensor(tp, files).reshape(-1)
        out[start:start + t.numel()] = t
    return out


def build_tree(tree: Any, files: SourceFiles) -> Any:
    """A copy of ``tree`` with every :class:`TensorPlan` (and world tensor plan) inside built into its tensor."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)


    def leaf(v: Any, _p: tuple) -> Any:
        if isinstance(v, FlatPlan):
            return build_flat(v, files)
        if isinstance(v, TensorPlan):
            return _value(v.value) if v.shape is None else build_tensor(v, files)
        if isinstance(v, HeldTensor):
            return v.to_torch()
        if isinstance(v, torch.Tensor):  # a value the plan carries: every state dict gets its own copy (torch's
            return v.clone()  # optimizers update their state in place)
        return v

    return map_leaves(tree, leaf)


def _value(value: Any) -> Any:
    """A carried value as a state dict holds it (bytes held without torch: the tensor)."""
    return value.to_torch() if isinstance(value, HeldTensor) else value


def execute(plan: RankPlan, files: SourceFiles) -> dict[str, Any]:
    """The model state dicts (``model`` or ``model0..N``) of the planned rank, and its ``optimizer`` state when the
    plan carries one."""
    out: dict[str, Any] = {c: OrderedDict() for c in plan.chunks}
    # copied out of the files' mappings: into fresh tensors that measured faster than pread (the DSV3-width slice of
    # bench_scale part G built in memory: 4.3-5.3 s mapped, 5.5-5.8 s with pread; docs/performance.md)
    for tp in plan.tensors:
        out[tp.chunk][tp.key] = _value(tp.value) if tp.shape is None else build_tensor(tp, files)
    if plan.optimizer is not None:
        out["optimizer"] = build_tree(plan.optimizer, files)
    return out
