"""Experts stored stacked: one tensor per layer holding every expert's matrix, read as the per-expert tensors a
family's rows name (transformers 5's declared weight conversions: the declaration, and its inverse for an export).

A family declares each stacked tensor (:class:`Stacked`): its name under the layer (``mlp.experts.gate_up_proj``),
the per-expert tensors it holds (``gate_proj.weight``, ``up_proj.weight``), whether their rows alternate
(GPT-OSS's ``gate_up_proj``: gate row ``i`` is row ``2i``, up row ``i`` row ``2i + 1``) or follow each other, and
whether each expert's matrix is stored ``[in, out]`` (transformers' GPT-OSS: a row of the per-expert weight is a
column of the stored one). Each per-expert tensor is then a :class:`Part`: a virtual entry of the model's tensor
table with its rows located in the stored one, so the family's rows (:mod:`.families.rows`) treat it as any
other HF tensor.

MXFP4 (GPT-OSS as the hub publishes it, ``quantization_config.quant_method: mxfp4``): the stacked tensor ``X`` is
stored as ``X_blocks``, uint8 ``[E, out, in / 32, 16]`` (two e2m1 values a byte, the low nibble first) beside
``X_scales``, uint8 ``[E, out, in / 32]`` (an e8m0 exponent, biased by 127, per 32 values), always ``[out, in]``
whatever the float form's orientation. A part's rows dequantize from their own block rows and scales alone.

Reading a part's rows: :class:`XRun` (held by a :class:`~.safetensors.SafeRef`), executed by
:class:`~megatron_preflight.reshard.sources.hf.HfReader`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.hf.safetensors import SafeTensor

BLOCKS, SCALES = "_blocks", "_scales"
MX_GROUP = 32  # values per e8m0 scale
MX_BYTES = 16  # bytes per group (two e2m1 values a byte)
E8M0_BIAS = 127
E8M0_NAN = 255  # the one e8m0 code that is not a power of two
# e2m1's 16 values by code (sign bit 3): the OCP MX spec's
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Stacked:
    """One stacked tensor a family's layers store: ``stored`` (under the layer, e.g. ``mlp.experts.gate_up_proj``)
    holds, for each expert ``j``, the tensors ``{experts}.{j}.{part}`` for each of ``parts`` (``{experts}``: the
    stored name's module, ``mlp.experts``); ``interleaved``: the parts' rows alternate (else each part's rows follow
    the previous part's); ``transposed``: each expert's matrix is stored ``[in, out]`` (a bias: ``[out]``);
    ``written``: an export writes it stacked."""

    stored: str
    parts: tuple[str, ...]
    interleaved: bool = False
    transposed: bool = False
    # an export writes this stacked form (else the per-expert tensors, as transformers saves the family: the files
    # on the hub may hold either, and both read alike)
    written: bool = True

    def module(self) -> str:
        return self.stored.rsplit(".", 1)[0]

    def part_names(self, layer: str, expert: int) -> list[str]:
        return [f"{layer}{self.module()}.{expert}.{p}" for p in self.parts]

    def out_row(self, part: int, row: int, rows: int) -> int:
        """The stored matrix's output row that is row ``row`` of part ``part`` (each part ``rows`` rows)."""
        return row * len(self.parts) + part if self.interleaved else part * rows + row


class Part(NamedTuple):
    """A per-expert tensor read from a stacked one (a virtual entry of the tensor table: the first six fields are a
    :class:`~.safetensors.SafeTensor`'s, so whatever reads one reads this)."""

    name: str
    file: str
    dtype: str  # the values' dtype (MXFP4: the dtype they are dequantized to)
    shape: tuple[int, ...]  # (rows, in) or (rows,)
    start: int  # the expert's matrix in the stored tensor (MXFP4: in its blocks)
    end: int
    how: Stacked
    part: int
    out: int  # the expert matrix's output rows (all parts)
    cols: int  # its input columns (a bias: 1)
    stored_dtype: str  # "mxfp4", or the stored float dtype
    scales: SafeTensor | None  # MXFP4: the scales tensor
    scale_start: int  # MXFP4: the expert's first scale byte
    stored: str  # the stored tensor's name (MXFP4: its scales'), for messages

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class XRun(NamedTuple):
    """Rows ``dst_row0 .. dst_row0 + rows`` of a :class:`~.safetensors.SafeRef` are output rows ``row0, row0 + step,
    ..`` of one expert's stored matrix (``out`` x ``cols``; ``transposed``: stored ``cols`` x ``out``)."""

    name: str  # the per-expert tensor, for messages
    file: str
    start: int
    dtype: str  # stored float dtype, or "mxfp4"
    out: int
    cols: int
    transposed: bool
    row0: int
    step: int
    rows: int
    dst_row0: int
    scale_file: str = ""
    scale_start: int = 0
    stored: str = ""  # the stored tensor (MXFP4: its scales), for messages

    def src_rows(self, a: int, b: int) -> tuple[int, int]:
        """(first, last + 1) stored output rows that rows ``a .. b`` of the SafeRef (within this run) come from."""
        first = self.row0 + (a - self.dst_row0) * self.step
        return first, first + (b - a - 1) * self.step + 1

    def byte_ranges(self, a: int, b: int) -> list[tuple[str, int, int]]:
        """(file, start, bytes) read for rows ``a .. b`` of the SafeRef (within this run)."""
        lo, hi = self.src_rows(a, b)
        if self.dtype == MXFP4:
            row, scale = self.cols // 2, self.cols // MX_GROUP
            return [(self.file, self.start + lo * row, (hi - lo) * row),
                    (self.scale_file, self.scale_start + lo * scale, (hi - lo) * scale)]
        item = _itemsize(self.dtype)
        if self.transposed:  # (a column of the stored matrix: the whole matrix is read)
            return [(self.file, self.start, self.out * self.cols * item)]
        return [(self.file, self.start + lo * self.cols * item, (hi - lo) * self.cols * item)]


MXFP4 = "mxfp4"


def _itemsize(dtype: str) -> int:
    return dtypes.dtype(dtype).itemsize


def expand(tensors: dict[str, Any], declared: tuple[Stacked, ...], value_dtype: str, mxfp4: bool, model_dir: str) \
        -> tuple[dict[str, Any], dict[str, list[str]], list[PreflightError]]:
    """The tensor table with each declared stacked tensor replaced by its parts (the stored tensors kept out of it);
    (the table, stored tensor -> the stored names it stands for, the stacked tensors whose shape does not fit).
    ``mxfp4``: the model's quantization is MXFP4 (a stacked weight may be stored as blocks and scales)."""
    if not declared:
        return tensors, {}, []
    out = dict(tensors)
    covers: dict[str, list[str]] = {}
    errors: list[PreflightError] = []
    for how in declared:
        suffix = "." + how.stored
        blocks_suffix = suffix + BLOCKS
        for name in list(tensors):
            if name.endswith(suffix):
                layer = name[:-len(how.stored)]
                problem = _float_parts(out, tensors[name], how, layer, model_dir)
                stored = [name]
            elif mxfp4 and name.endswith(blocks_suffix) and (name[:-len(BLOCKS)] + SCALES) in tensors:
                layer = name[:-len(how.stored) - len(BLOCKS)]
                scales = tensors[name[:-len(BLOCKS)] + SCALES]
                problem = _mx_parts(out, tensors[name], scales, how, layer, value_dtype, model_dir)
                stored = [name, scales.name]
            else:
                continue
            if problem is not None:
                errors.append(problem)
                continue
            for s in stored:
                out.pop(s, None)
            covers[layer + how.stored] = stored
    return out, covers, errors


def _bad(t: SafeTensor, how: Stacked, want: str, model_dir: str) -> PreflightError:
    return PreflightError(f"tensor {t.name!r} is {t.dtype} of shape {list(t.shape)}: stacked experts "
                          f"({', '.join(how.parts)}) need {want}", path=os.path.join(model_dir, t.file),
                          fix="check that config.json belongs to these weights (download the model again)",
                          code="hf_shape")


def _float_parts(out: dict[str, Any], t: SafeTensor, how: Stacked, layer: str, model_dir: str) \
        -> PreflightError | None:
    n = len(how.parts)
    if len(t.shape) not in (2, 3) or t.shape[0] == 0:
        return _bad(t, how, "[experts, out] (a bias) or [experts, out, in] / [experts, in, out]", model_dir)
    experts = t.shape[0]
    if len(t.shape) == 2:
        outs, cols, transposed = t.shape[1], 1, False
    else:
        transposed = how.transposed
        cols, outs = (t.shape[1], t.shape[2]) if transposed else (t.shape[2], t.shape[1])
    if outs % n:
        return _bad(t, how, f"output rows a multiple of {n}", model_dir)
    per = (outs * cols) * (t.nbytes // max(1, math.prod(t.shape)))
    shape = (outs // n,) if len(t.shape) == 2 else (outs // n, cols)
    for j in range(experts):
        for p, name in enumerate(how.part_names(layer, j)):
            out[name] = Part(name, t.file, t.dtype, shape, t.start + j * per, t.start + (j + 1) * per, how, p, outs,
                             cols, t.dtype, None, 0, t.name)
    return None


def _mx_parts(out: dict[str, Any], blocks: SafeTensor, scales: SafeTensor, how: Stacked, layer: str,
              value_dtype: str, model_dir: str) -> PreflightError | None:
    n = len(how.parts)
    if blocks.dtype != "uint8" or len(blocks.shape) != 4 or blocks.shape[3] != MX_BYTES:
        return _bad(blocks, how, f"uint8 MXFP4 blocks [experts, out, in / {MX_GROUP}, {MX_BYTES}]", model_dir)
    experts, outs, groups, _ = blocks.shape
    if scales.dtype != "uint8" or tuple(scales.shape) != (experts, outs, groups):
        return PreflightError(f"tensor {scales.name!r} is {scales.dtype} of shape {list(scales.shape)}; the MXFP4 "
                              f"blocks {list(blocks.shape)} need uint8 of shape {[experts, outs, groups]} (one e8m0 "
                              f"exponent per {MX_GROUP} values)", path=os.path.join(model_dir, scales.file),
                              fix="download the model again (the blocks and their scales come from the same files)",
                              code="hf_quantized")
    if outs % n:
        return _bad(blocks, how, f"output rows a multiple of {n}", model_dir)
    cols = groups * MX_GROUP
    per, per_scale = outs * groups * MX_BYTES, outs * groups
    for j in range(experts):
        for p, name in enumerate(how.part_names(layer, j)):
            out[name] = Part(name, blocks.file, value_dtype, (outs // n, cols), blocks.start + j * per,
                             blocks.start + (j + 1) * per, how, p, outs, cols, MXFP4, scales,
                             scales.start + j * per_scale, scales.name)
    return None


def run(part: Part, src0: int, rows: int, dst_row0: int) -> XRun:
    """The rows ``src0 .. src0 + rows`` of ``part`` as an :class:`XRun` landing at ``dst_row0``."""
    n, per = len(part.how.parts), part.out // len(part.how.parts)
    row0 = part.how.out_row(part.part, src0, per)
    step = n if part.how.interleaved else 1
    mx = part.stored_dtype == MXFP4
    return XRun(part.name, part.file, part.start, part.stored_dtype, part.out, part.cols,
                part.how.transposed and not mx and len(part.shape) == 2, row0, step, rows, dst_row0,
                part.scales.file if mx and part.scales is not None else "", part.scale_start, part.stored)


def stored_of(declared: tuple[Stacked, ...], name: str) -> tuple[Stacked, str, int, int] | None:
    """(its declaration, the layer prefix, the expert, the part) of a per-expert tensor name a stacked tensor holds."""
    for how in declared:
        module = how.module() + "."
        for p, part in enumerate(how.parts):
            tail = "." + part
            if not name.endswith(tail) or module not in name:
                continue
            head = name[:-len(tail)]
            layer_module, _, expert = head.rpartition(".")
            if expert.isdigit() and layer_module.endswith(how.module()):
                return how, layer_module[:-len(how.module())], int(expert), p
    return None
