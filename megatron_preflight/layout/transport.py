"""A discovered :class:`Layout` as bytes, so rank 0 reads the checkpoint once and every other rank receives it.

The layout holds the metadata of every shard (keys, TensorRefs, the saved args) and inert placeholders for the
Megatron classes the checkpoint names, which plain pickle cannot name; they are reduced to the function that makes
them. The bytes are made by rank 0 of the same job from objects it built itself, never taken from a checkpoint.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from megatron_preflight.layout.model import Layout
from megatron_preflight.safe_pickle import Placeholder, placeholder_class


def _placeholder(module: str, name: str, new_args: tuple, args: tuple, kwargs: dict, state: Any,
                 called: bool) -> Placeholder:
    cls = placeholder_class(module, name)
    obj = Placeholder.__new__(cls, *new_args)
    obj._args, obj._kwargs, obj._state, obj._called = args, kwargs, state, called
    return obj


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, Placeholder) and obj is not Placeholder:
            return placeholder_class, (obj._module, obj._name)
        if isinstance(obj, Placeholder):
            return _placeholder, (obj._module, obj._name, obj._new_args, obj._args, obj._kwargs, obj._state,
                                  obj._called)
        return NotImplemented


def dumps(layout: Layout) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(layout)
    return buf.getvalue()


def loads(data: bytes) -> Layout:
    layout = pickle.loads(data)  # noqa: S301 - our own bytes from rank 0 of this job (see the module docstring)
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a Layout, got {type(layout).__name__}")
    return layout
