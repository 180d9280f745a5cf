"""A discovered :class:`Layout` as compact bytes, so rank 0 reads the checkpoint once and every other rank receives it.

What is sent is what the other ranks use: every shard's metadata (keys, TensorRefs, optimizer state, the saved args)
but not the shards' RNG states (per-rank values no other rank reads: the resharder drops them at another layout, see
:data:`megatron_preflight.reshard.carried.NOT_MAPPABLE`), each shard's args as its difference from the first shard's (they
differ in a field or two), the whole pickled and zlib-compressed (shards repeat one another's key names and shapes).
:func:`loads` gives back the layout exactly, less those RNG states.

The layout holds inert placeholders for the Megatron classes the checkpoint names, which plain pickle cannot name;
they are reduced to the function that makes them. The bytes are made by rank 0 of the same job from objects it built
itself, never taken from a checkpoint.
"""

from __future__ import annotations

import copy
import io
import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.layout.model import Layout
from megatron_preflight.placeholders import Placeholder, placeholder_class

MAGIC = b"MPL1"
NOT_SENT = ("rng_state",)  # per-shard entries left out (see the module docstring)
LEVEL = 6


@dataclass
class ArgsDelta:
    """A shard's saved args as their difference from the first shard's."""

    changed: dict[str, Any] = field(default_factory=dict)
    removed: tuple[str, ...] = ()


def delta(base: Any, args: Any) -> Any:
    """``args`` as an :class:`ArgsDelta` from ``base`` (both Megatron's args), or ``args`` itself."""
    if not (hasattr(base, "__dict__") and type(args) is type(base)):
        return args
    a, b = vars(base), vars(args)
    changed = {k: v for k, v in b.items() if k not in a or not _same(a[k], v)}
    return ArgsDelta(changed, tuple(k for k in a if k not in b))


def _same(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - a value without a plain truth value is sent as is
        return False


def apply_delta(base: Any, d: ArgsDelta) -> Any:
    """The args ``d`` was made from."""
    args = copy.copy(base)
    for k in d.removed:
        delattr(args, k)
    for k, v in d.changed.items():
        setattr(args, k, v)
    return args


def _placeholder(module: str, name: str, new_args: tuple, args: tuple, kwargs: dict, state: Any,
                 called: bool) -> Placeholder:
    cls = placeholder_class(module, name)
    obj = cls.__new__(cls, *new_args)
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


def slim(layout: Layout) -> Layout:
    """The layout as the other ranks get it: shard metadata without :data:`NOT_SENT` (a shallow copy)."""
    out = copy.copy(layout)
    out.shards = []
    for shard in layout.shards:
        s = copy.copy(shard)
        if isinstance(shard.meta, dict):
            s.meta = {k: v for k, v in shard.meta.items() if k not in NOT_SENT}
        out.shards.append(s)
    return out


def dumps(layout: Layout) -> bytes:
    out = slim(layout)
    base = None
    for s in out.shards:
        args = s.meta.get("args") if isinstance(s.meta, dict) else None
        if args is None:
            continue
        if base is None:
            base = args
        elif args is not base:
            s.meta["args"] = delta(base, args)
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(out)
    return MAGIC + zlib.compress(buf.getvalue(), LEVEL)


def loads(data: bytes) -> Layout:
    if not data.startswith(MAGIC):
        raise TypeError("not a layout sent by megatron-preflight's rank 0")
    layout = pickle.loads(zlib.decompress(data[len(MAGIC):]))  # noqa: S301 - rank 0's own bytes (module docstring)
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a Layout, got {type(layout).__name__}")
    base = None
    for s in layout.shards:
        args = s.meta.get("args") if isinstance(s.meta, dict) else None
        if isinstance(args, ArgsDelta):
            s.meta["args"] = apply_delta(base, args)
        elif args is not None and base is None:
            base = args
    return layout
