"""Transformer Engine's per-module ``_extra_state`` in a torch_dist source: described without torch for a verdict,
and TE's no-FP8 default (what a freshly built module saves) made from a sibling module's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import map_leaves

PICKLED_NONE = b"\x80\x04N."  # pickle.dumps(None): TE 2.0-2.3's extra state of a module without FP8


def no_fp8_copy(value: Any) -> Any:
    """A copy of a TE extra state that holds no FP8 metadata (empty, or a pickled None), else None."""
    if isinstance(value, TensorValue):
        return value if value.shape in ((0,), (len(PICKLED_NONE),)) else None
    if getattr(value, "dtype", None) is not None and hasattr(value, "numel") and value.dim() == 1:
        if value.numel() == 0 or bytes(value.tolist()) == PICKLED_NONE:
            return value.clone()
    return None


@dataclass(frozen=True)
class TensorValue:
    """A tensor inside a sharded object (a TE extra state), described without torch: its dtype and shape."""

    dtype: Any
    shape: tuple[int, ...]


def described(value: Any) -> Any:
    """``value`` with each tensor reference replaced by its :class:`TensorValue` (no torch)."""
    return map_leaves(value, lambda v, _p: TensorValue(v.dtype, tuple(v.shape)) if isinstance(v, TensorRef) else v)
