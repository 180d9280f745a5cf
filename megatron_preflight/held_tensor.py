"""A small tensor's bytes held without torch: a value a checkpoint carries (a scalar optimizer ``step``, a tensor in
a carried top-level entry) while torch is not loaded. A legacy writer saves it as a storage record, exactly as
``torch.save`` saves the tensor it stands for; :meth:`HeldTensor.to_torch` makes the tensor where torch is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_preflight import dtypes


@dataclass(frozen=True, eq=False)
class HeldTensor:
    """A contiguous tensor: its dtype (a :class:`~megatron_preflight.dtypes.DType` or torch's), shape and bytes."""

    dtype: Any
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != math.prod(self.shape) * self.dtype.itemsize:
            raise ValueError(f"{len(self.data)} bytes do not make a {self.dtype} tensor of shape {self.shape}")

    @classmethod
    def scalar(cls, value: float | int | bool) -> HeldTensor:
        """What ``torch.tensor(value)`` makes: a 0-dim float32, int64 or bool tensor."""
        name = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else "float32"
        return cls(dtypes.dtype(name), (), dtypes.element_bytes(value, name))

    def item(self) -> float | int | bool:
        """A one-element tensor's value (as ``tensor.item()``: ``float(step)`` works on either)."""
        name = dtypes.name_of(self.dtype) or ""
        if name not in dtypes.READABLE or len(self.data) != self.dtype.itemsize:
            raise TypeError(f"a {self.dtype} tensor of shape {self.shape} has no single value to read without torch")
        return dtypes.element_value(self.data, name)

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def to_torch(self) -> Any:
        """The tensor itself (imports torch)."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        dtype = dtypes.to_torch(self.dtype)
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else \
            torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape).clone()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldTensor) and dtypes.name_of(self.dtype) == dtypes.name_of(other.dtype) and \
            tuple(self.shape) == tuple(other.shape) and self.data == other.data

    __hash__ = None  # type: ignore[assignment]  # (a value, compared by content)

    def __repr__(self) -> str:
        return f"HeldTensor({self.shape}, {self.dtype})"
