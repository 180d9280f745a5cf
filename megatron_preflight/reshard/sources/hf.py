"""Hugging Face safetensors as a source of the resharder: :class:`HfReader` reads a
:class:`~megatron_preflight.layout.hf.safetensors.SafeRef` (row blocks of safetensors tensors, each a contiguous run of
bytes) with plain file I/O into fresh tensors, never through a mapping: a rank's rows of a tensor (its share of a
vocab, a fused QKV, SwiGLU's ``[gate; up]``) are read alone (:meth:`HfReader.rows`), a tensor split along another dim
whole, once (kept until the next). Measured (benchmarks/bench_hf_import.py, 1 GiB Mixtral-shaped, TP2 EP2): with the
one-run tensors mapped instead, each rank's peak RSS was its state plus every page it touched (1,191 MiB for 495 MiB
held)."""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, Any

from megatron_preflight import crc, dtypes
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.hf import files, quant, stacked
from megatron_preflight.layout.hf.safetensors import SafeRef

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


@functools.cache
def _fp4_pairs(dtype: Any) -> torch.Tensor:
    """Each byte's two e2m1 values (the low nibble first), one row per byte value."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    lut = torch.tensor(stacked.FP4_VALUES, dtype=torch.float32)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=1).to(dtype)


def _pow2(exps: torch.Tensor, dtype: Any) -> torch.Tensor:
    """2^(e - 127) of e8m0 codes ``exps`` (uint8, none 255) in ``dtype`` (bf16 or fp32: the code is their exponent
    field; code 0, 2^-127, is a subnormal there)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    if dtype == torch.bfloat16:
        scale = (exps.to(torch.int16) << 7).view(torch.bfloat16)
    else:
        scale = (exps.to(torch.int32) << 23).view(torch.float32)
    if bool((exps == 0).any()):
        scale = torch.where(exps == 0, torch.tensor(2.0 ** -127, dtype=dtype), scale)
    return scale


_CHUNK = 1 << 22  # values dequantized at a time (their float32 temporary: 16 MiB)


def _values(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The stored values of quantized bytes ``raw`` (uint8; layout/hf/quant.py): FP8 e4m3 one a byte; a
    pack-quantized INT8 one a byte, INT4 two (the low nibble first), each stored plus 2^(bits - 1)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    if kind == quant.FP8:
        return raw.view(torch.float8_e4m3fn)
    if kind == quant.INT8:
        return raw.to(torch.int16) - 128
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(-1).to(torch.int8) - 8


class HfReader:
    """Reads the SafeRefs of one Hugging Face model dir (each file opened once)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._fds: dict[str, int] = {}
        self._last: tuple[SafeRef, torch.Tensor] | None = None
        # the last expert matrix stored [in, out] read whole (its parts' rows are its columns): ((file, start, bytes), it)
        self._matrix: tuple[tuple[str, int, int], torch.Tensor] | None = None
        self._shapes: set[tuple[str, int]] = set()  # the pack-quantized weights' stored shapes already checked

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = files.open_regular(files.member(self.model_dir, name, self.model_dir))
        return self._fds[name]

    def _pread(self, name: str, start: int, out: memoryview) -> None:
        fd, got = self._fd(name), 0
        while got < len(out):
            n = os.preadv(fd, [out[got:]], start + got)
            if n <= 0:
                raise CorruptFileError(f"the file ends at byte {start + got:,}, inside a tensor (truncated)",
                                       path=os.path.join(self.model_dir, name), fix="download the model again",
                                       code="corrupt_file")
            got += n

    def tensor(self, shard: str, ref: SafeRef, verify: bool = True) -> torch.Tensor:
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        if self._last is not None and self._last[0] is ref:
            return self._last[1]
        dtype = dtypes.to_torch(ref.dtype)
        t = torch.empty(ref.shape, dtype=dtype)
        if ref.quant:
            self._dequantize(ref, 0, t)
            self._last = (ref, t)
            return t.add_(ref.add) if ref.add else t
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for r in ref.runs:
            self._pread(r.file, r.start, buf[r.dst:r.dst + r.nbytes])
        if ref.add:
            t.add_(ref.add)
        self._last = (ref, t)
        return t

    def rows(self, shard: str, ref: SafeRef, first: int, n: int) -> torch.Tensor | None:
        """Rows ``first .. first + n`` (dim 0), reading only the runs' bytes they hold."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        if not ref.shape:
            return None
        if self._last is not None and self._last[0] is ref:
            return self._last[1].narrow(0, first, n)
        out = torch.empty((n, *ref.shape[1:]), dtype=dtypes.to_torch(ref.dtype))
        if ref.quant:
            self._dequantize(ref, first, out)
            return out.add_(ref.add) if ref.add else out
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        lo = first * ref.row_bytes
        hi = lo + n * ref.row_bytes
        for r in ref.runs:
            a, b = max(lo, r.dst), min(hi, r.dst + r.nbytes)
            if a < b:
                self._pread(r.file, r.start + a - r.dst, buf[a - lo:b - lo])
        return out.add_(ref.add) if ref.add else out

    def item(self, shard: str, ref: SafeRef) -> Any:
        return self.tensor(shard, ref).item()

    def _dequantize(self, ref: SafeRef, first: int, out: torch.Tensor) -> None:
        """Rows ``first .. first + len(out)`` of the dequantized tensor ``ref`` into ``out``: each FP8 run's rows read
        with the scale rows that cover them (layout/hf/quant.py), multiplied in float32, cast to ``out``'s dtype."""
        last = first + out.shape[0]
        for q in ref.quant:
            a, b = max(first, q.dst_row0), min(last, q.dst_row0 + q.rows)
            if a >= b:
                continue
            if isinstance(q, stacked.XRun):
                self._stacked(q, a, b, out[a - first:b - first])
                continue
            if q.shape_check:
                self._check_shape(q)
            # (in chunks of rows: the float32 values of a chunk are the one full-width temporary)
            step = max(1, _CHUNK // max(q.cols, 1))
            for c in range(a, b, step):
                self._scaled(q, q.src_row0 + c - q.dst_row0, out[c - first:min(b, c + step) - first])

    def _scaled(self, q: quant.QRun, s0: int, dst: torch.Tensor) -> None:
        """Rows ``s0 .. s0 + len(dst)`` of the quantized tensor of ``q`` (FP8 or packed integers) read with the scale
        rows that cover them, multiplied in float32 straight into ``dst`` (cast on the way)."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        k, cols = dst.shape[0], q.cols
        raw = torch.empty(k * q.row_bytes, dtype=torch.uint8)
        self._pread(q.file, q.start + s0 * q.row_bytes, memoryview(raw.numpy()))
        values = _values(raw, q.values).reshape(k, cols).to(torch.float32)
        br, bc = q.block
        lo, hi = s0 // br, (s0 + k - 1) // br + 1
        sdt = dtypes.to_torch(dtypes.dtype(q.scale_dtype))
        scale = torch.empty((hi - lo, q.scale_cols), dtype=sdt)
        width = q.scale_cols * scale.element_size()
        self._pread(q.scale_file, q.scale_start + lo * width, memoryview(scale.view(torch.uint8).numpy()).cast("B"))
        scale = scale.to(torch.float32)
        if not bool(torch.isfinite(scale).all()):
            raise CorruptFileError(f"tensor {q.scale_name!r} holds a non-finite scale (rows {lo}..{hi - 1})",
                                   path=os.path.join(self.model_dir, q.scale_file), code="corrupt_file",
                                   fix="download the model again")
        dst = dst.reshape(k, cols)
        if br == 1 and cols % bc == 0:  # a scale per row and group of columns: broadcast, nothing spread
            torch.mul(values.view(k, cols // bc, bc), scale.unsqueeze(-1), out=dst.view(k, cols // bc, bc))
            return
        # each block row's scales spread over its columns (block-row count x columns, not rows x columns), then the
        # rows of each block row multiplied by them
        scale = scale.repeat_interleave(bc, 1)[:, :cols]
        row = s0
        while row < s0 + k:
            end = min((row // br + 1) * br, s0 + k)
            torch.mul(values[row - s0:end - s0], scale[row // br - lo], out=dst[row - s0:end - s0])
            row = end

    def _check_shape(self, q: quant.QRun) -> None:
        """Refuses a pack-quantized weight whose stored ``weight_shape`` is not the [R, C] it is read as (a column
        count that is no multiple of the values a word holds: padded)."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        file, start, dtype, want = q.shape_check
        if (file, start) in self._shapes:
            return
        got = torch.empty(2, dtype=dtypes.to_torch(dtypes.dtype(dtype)))
        self._pread(file, start, memoryview(got.view(torch.uint8).numpy()))
        if tuple(got.tolist()) != tuple(want):
            raise CorruptFileError(f"tensor {q.name + quant.SHAPE!r} holds "
                                   f"{got.tolist()}; its packed weight reads as {list(want)} (columns that are no "
                                   "multiple of the values a 32-bit word holds are not read)",
                                   path=os.path.join(self.model_dir, file), code="corrupt_file",
                                   fix="use a bf16 copy of the model")
        self._shapes.add((file, start))

    def _stacked(self, x: stacked.XRun, a: int, b: int, out: torch.Tensor) -> None:
        """Rows ``a .. b`` of a SafeRef (within the run ``x``) into ``out``: rows of one expert's stored matrix, every
        ``step``-th, read as a column of a matrix stored ``[in, out]``, or dequantized from MXFP4 blocks."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        lo, hi = x.src_rows(a, b)
        (file, start, n), *scale = x.byte_ranges(a, b)
        if x.dtype == stacked.MXFP4:
            raw = torch.empty(n, dtype=torch.uint8)
            self._pread(file, start, memoryview(raw.numpy()))
            exp = torch.empty(scale[0][2], dtype=torch.uint8)
            self._pread(scale[0][0], scale[0][1], memoryview(exp.numpy()))
            blocks = raw.view(hi - lo, x.cols // 2)[::x.step]
            exps = exp.view(hi - lo, x.cols // stacked.MX_GROUP)[::x.step]
            if bool((exps == stacked.E8M0_NAN).any()):
                raise CorruptFileError(f"tensor {x.stored!r} holds an e8m0 scale of {stacked.E8M0_NAN} (NaN: a "
                                       f"non-finite value) among the scales of {x.name!r}",
                                       path=os.path.join(self.model_dir, x.scale_file), code="corrupt_file",
                                       fix="download the model again")
            # each byte's two values from a 256-row table, times 2^(e - 127) built from its bits: exact in bf16 and
            # fp32 (an e2m1 value has two significant bits), computed in the output's dtype where it is one of them
            # (measured on one 2880 x 2880 expert: 29 M values/s with index tensors and ldexp, 287 M/s so in bf16)
            k = b - a
            work = out.dtype if out.dtype in (torch.bfloat16, torch.float32) else torch.float32
            values = torch.index_select(_fp4_pairs(work), 0, blocks.reshape(-1).to(torch.int32))
            scale = _pow2(exps, work)
            dst = out.view(k, -1, stacked.MX_GROUP)
            if work == out.dtype:
                torch.mul(values.view(k, -1, stacked.MX_GROUP), scale.unsqueeze(-1), out=dst)
            else:
                dst.copy_(values.view(k, -1, stacked.MX_GROUP) * scale.unsqueeze(-1))
            return
        if x.transposed and self._matrix is not None and self._matrix[0] == (file, start, n):
            t = self._matrix[1]  # (an expert's gate rows, then its up rows: one read of its matrix)
        else:
            t = torch.empty(n // dtypes.dtype(x.dtype).itemsize, dtype=dtypes.to_torch(dtypes.dtype(x.dtype)))
            self._pread(file, start, memoryview(t.view(torch.uint8).numpy()))
            self._matrix = ((file, start, n), t) if x.transposed else None
        if x.transposed:
            rows = t.view(x.cols, x.out)[:, lo:hi:x.step].t()
        else:
            rows = t.view(hi - lo, x.cols)[::x.step]
        out.view(b - a, x.cols).copy_(rows)

    def sample_bytes(self, shard: str, ref: SafeRef, k: int) -> bytes | None:
        return None  # (a model dir holds no replicas)

    def extent(self, shard: str, ref: SafeRef) -> tuple[str, int, int] | None:
        if len(ref.runs) != 1 or not ref.shape or ref.quant or ref.add:
            return None
        r = ref.runs[0]
        return os.path.join(self.model_dir, r.file), r.start, ref.row_bytes

    def read_rows(self, shard: str, ref: SafeRef, row0: int, out: Any) -> int | None:
        """Rows from ``row0`` into ``out`` (as many as it holds), run by run: their CRC-32."""
        if not ref.shape or ref.quant or ref.add:  # (a computed tensor's bytes are not the file's)
            return None
        buf = memoryview(out).cast("B")
        lo = row0 * ref.row_bytes
        hi = lo + len(buf)
        if hi > math.prod(ref.shape) * ref.dtype.itemsize:
            return None
        value = 0
        for r in ref.runs:
            a, b = max(lo, r.dst), min(hi, r.dst + r.nbytes)
            if a < b:
                part = buf[a - lo:b - lo]
                self._pread(r.file, r.start + a - r.dst, part)
                value = crc.combine(value, crc.crc32(part), b - a)
        return value

    def finish(self) -> None:
        pass

    def release(self, shard: str, ref: SafeRef) -> None:
        self._last = None
        self.release_pages()

    def release_pages(self) -> None:
        self._last = self._matrix = None

    def close(self) -> None:
        self._last = self._matrix = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
