"""The two kinds of array a plan is executed into: torch tensors (a state dict for a job; the torch_dist, fsdp_dtensor
and HF writers) and numpy arrays of the elements' bytes (a legacy output written without ``import torch``: a copy
never needs a value's meaning, only its width, so a bf16 element is a uint16 and an fp8 one a uint8).

A :class:`Kit` is what :func:`~megatron_preflight.reshard.execute.executor.build_rows` asks of its arrays; the
numpy one reads legacy sources only (a :class:`~megatron_preflight.torch_file.TensorRef`: its file mapped as bytes).
"""

from __future__ import annotations

from typing import Any

from megatron_preflight import dtypes

_FLOATS = ("bfloat16", "float16", "float32", "float64")


def has_values(dtype: Any) -> bool:
    """Whether :func:`float_values` reads ``dtype``'s values (the floats numpy knows, and bf16)."""
    return dtypes.name_of(dtype) in _FLOATS


def float_values(t: Any, dtype: Any) -> Any:
    """The values of a :data:`BYTES` array of ``dtype``'s elements as a numpy float array (a bf16 element widened
    exactly to fp32); None for a dtype that is not one of those floats (an integer, fp8)."""
    import numpy as np  # deferred: numpy only where arrays are made

    name = dtypes.name_of(dtype)
    if name == "bfloat16":
        return (t.astype(np.uint32) << 16).view(np.float32)
    return t.view(np.dtype(name)) if name in _FLOATS else None


def float_bits(values: Any, dtype: Any) -> Any:
    """``values`` (a numpy float array; for bf16, values fp32 holds exactly) rounded to ``dtype`` (one of the floats
    of :func:`float_values`), to nearest even as torch rounds, as a :data:`BYTES` array of its elements."""
    import numpy as np  # deferred, as above

    name = dtypes.name_of(dtype)
    if name != "bfloat16":
        with np.errstate(over="ignore", invalid="ignore"):  # (out of range: inf, as torch gives)
            return values.astype(np.dtype(name)).view(dtypes.byte_element(dtype))
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)  # (fp32 or narrower: exact)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # nearest, ties to even
    nan = np.isnan(values)
    if nan.any():  # a NaN stays one (the rounding could carry it into the infinities): torch's quiet NaN
        rounded[nan] = ((bits[nan] >> 16).astype(np.uint16) & 0x8000) | 0x7FC0
    return rounded


def _slices(dim: int, start: int, length: int) -> tuple[slice, ...]:
    return (*(slice(None),) * dim, slice(start, start + length))


class Kit:
    """Torch tensors (the default)."""

    name = "torch"

    def element(self, dtype: Any) -> Any:
        """The element type an array of ``dtype`` is made of."""
        return dtypes.to_torch(dtype)

    def new(self, shape: tuple[int, ...], dtype: Any, zero: bool) -> Any:
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        elem = self.element(dtype)
        return torch.zeros(shape, dtype=elem) if zero else torch.empty(shape, dtype=elem)

    def buffer(self, nbytes: int) -> Any:
        """A flat byte buffer to build rows in (reused by a writer)."""
        import torch  # deferred, as above

        return torch.empty(nbytes, dtype=torch.uint8)

    def view(self, buf: Any, dtype: Any, shape: tuple[int, ...], n: int) -> Any:
        """The first ``n`` elements of ``dtype`` in the byte buffer ``buf``, as an array of ``shape``."""
        elem = self.element(dtype)
        return buf[:n * elem.itemsize].view(elem).view(shape)

    def narrow(self, t: Any, dim: int, start: int, length: int) -> Any:
        return t.narrow(dim, start, length)

    def copy(self, d: Any, s: Any) -> None:
        """``s`` into ``d`` (one shape)."""
        d.copy_(s)

    def zero(self, t: Any) -> None:
        t.zero_()

    def nbytes(self, t: Any) -> int:
        return t.numel() * t.element_size()

    def address(self, t: Any) -> int:
        return t.data_ptr()

    def contiguous(self, t: Any) -> bool:
        return t.is_contiguous()

    def as_bytes(self, t: Any) -> Any:
        """A contiguous array's bytes, as a flat numpy uint8 array (what the zip writer and CRC take)."""
        import torch  # deferred, as above

        return t.reshape(-1).view(torch.uint8).numpy()

    def source(self, files: Any, shard: str, ref: Any) -> Any:
        return files.tensor(shard, ref)

    def rows(self, files: Any, shard: str, ref: Any, first: int, n: int) -> Any:
        return files.rows(shard, ref, first, n)

    def zeros(self, n: int, dtype: Any) -> Any:
        return self.new((n,), dtype, True)

    def converted(self, t: Any, src: Any, dst: Any) -> Any:
        """``t`` (elements of ``src``) as values of ``dst``."""
        return t.to(self.element(dst))

    def held(self, value: Any) -> Any:
        """A carried :class:`~megatron_preflight.held_tensor.HeldTensor` as an array."""
        return value.to_torch()

    def written(self, out: Any, ref: Any) -> Any:
        """A tensor of a written legacy file (a :class:`~megatron_preflight.torch_file.TorchFile`), read back."""
        return out.tensor(ref)

    def same_bits(self, a: Any, b: Any) -> bool:
        """Whether two arrays hold the same bits in the same shape (compared in place)."""
        return dtypes.same_bits(a, b)

    def any_set(self, t: Any) -> bool:
        """Whether any element of ``t`` is not zero."""
        return bool(t.any())

    def flags(self, n: int) -> Any:
        """``n`` booleans, all false."""
        import torch  # deferred, as above

        return torch.zeros(n, dtype=torch.bool)


class BytesKit(Kit):
    """Numpy arrays of unsigned integers as wide as each dtype's elements: no torch (a legacy source and target)."""

    name = "bytes"

    def element(self, dtype: Any) -> Any:
        return dtypes.byte_element(dtype)

    def new(self, shape: tuple[int, ...], dtype: Any, zero: bool) -> Any:
        import numpy as np  # deferred, as above

        return (np.zeros if zero else np.empty)(shape, dtype=self.element(dtype))

    def buffer(self, nbytes: int) -> Any:
        import numpy as np  # deferred, as above

        return np.empty(nbytes, dtype=np.uint8)

    def view(self, buf: Any, dtype: Any, shape: tuple[int, ...], n: int) -> Any:
        elem = self.element(dtype)
        return buf[:n * elem.itemsize].view(elem).reshape(shape)

    def narrow(self, t: Any, dim: int, start: int, length: int) -> Any:
        return t[_slices(dim, start, length)]

    def copy(self, d: Any, s: Any) -> None:
        d[...] = s

    def zero(self, t: Any) -> None:
        t[...] = 0

    def nbytes(self, t: Any) -> int:
        return t.nbytes

    def address(self, t: Any) -> int:
        return t.__array_interface__["data"][0]

    def contiguous(self, t: Any) -> bool:
        return t.flags.c_contiguous

    def as_bytes(self, t: Any) -> Any:
        import numpy as np  # deferred, as above

        return t.reshape(-1).view(np.uint8)

    def source(self, files: Any, shard: str, ref: Any) -> Any:
        return files.array(shard, ref)

    def rows(self, files: Any, shard: str, ref: Any, first: int, n: int) -> Any:
        return None  # (a legacy piece's rows are a view of its mapping)

    def converted(self, t: Any, src: Any, dst: Any) -> Any:
        """Between the float dtypes numpy reads (bf16 as its top half of an fp32), rounded to nearest even as torch
        rounds; any other pair through torch (loaded for it)."""
        values = float_values(t, src)
        # (float64 -> bf16 would round twice through fp32: torch's)
        if values is not None and dtypes.name_of(dst) in _FLOATS and \
                not (dtypes.name_of(src) == "float64" and dtypes.name_of(dst) == "bfloat16"):
            return float_bits(values, dst)
        import torch  # deferred: only for a value conversion numpy does not make

        value = torch.from_numpy(t.copy()).view(dtypes.to_torch(src)).to(dtypes.to_torch(dst))
        return value.view(dtypes.int_view(dst)).numpy().view(self.element(dst))

    def held(self, value: Any) -> Any:
        import numpy as np  # deferred, as above

        return np.frombuffer(value.data, dtype=self.element(value.dtype)).reshape(value.shape)

    def written(self, out: Any, ref: Any) -> Any:
        return out.array(ref)

    def same_bits(self, a: Any, b: Any) -> bool:
        import numpy as np  # deferred, as above

        return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and np.array_equal(a.view(b.dtype), b)

    def any_set(self, t: Any) -> bool:
        return bool(t.any())  # (any bit: a -0.0 is not a zero's bytes)

    def flags(self, n: int) -> Any:
        import numpy as np  # deferred, as above

        return np.zeros(n, dtype=bool)


TORCH = Kit()
BYTES = BytesKit()

