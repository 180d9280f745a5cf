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


PICKLED_EMPTY_DICT = b"\x80\x04}\x94."  # pickle.dumps({}): TE 2.0-2.8 ops-based norms without FP8


def holds_no_fp8(value: Any) -> bool:
    """Whether an extra state carries no FP8 metadata: None (what a save without TE extra state, e.g. Megatron-FSDP's,
    stands for), or one of TE's empty values (an empty tensor, a pickled None or {})."""
    if value is None:
        return True
    if isinstance(value, TensorValue):
        return value.shape in ((0,), (len(PICKLED_NONE),), (len(PICKLED_EMPTY_DICT),))
    if getattr(value, "dtype", None) is not None and hasattr(value, "numel") and value.dim() == 1:
        return value.numel() == 0 or bytes(value.tolist()) in (PICKLED_NONE, PICKLED_EMPTY_DICT)
    return False


@dataclass(frozen=True)
class TensorValue:
    """A tensor inside a sharded object (a TE extra state), described without torch: its dtype and shape."""

    dtype: Any
    shape: tuple[int, ...]


def described(value: Any) -> Any:
    """``value`` with each tensor reference replaced by its :class:`TensorValue` (no torch)."""
    return map_leaves(value, lambda v, _p: TensorValue(v.dtype, tuple(v.shape)) if isinstance(v, TensorRef) else v)
