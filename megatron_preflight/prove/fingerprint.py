"""Layout-independent fingerprints of a checkpoint's global tensors.

The digest of a global tensor ``T`` (flattened row-major, elements ``T[i]`` as their raw bits) is

    D(T) = Σ_i mix(bits(T[i]) XOR i·K)  mod 2^64

with ``mix`` the SplitMix64 finalizer (a bijection of 64-bit words: xor-shifts and odd multipliers) and ``K`` the
golden-ratio constant. Why it is sound:

* **Any slicing gives the same digest.** The sum is over elements, each term depending only on the element's value
  and its *global* flat index, and addition mod 2^64 is commutative and associative: a rank holding any box of
  ``T`` (a TP/EP/ETP split, a VPP chunk's layer, a distributed-optimizer shard, a slice that crosses any block
  boundary — there are no blocks) sums its terms; the partial sums of disjoint boxes that cover ``T`` add up to
  ``D(T)``. Replicas (the same box on several ranks) are counted once: a box is identified by its global offsets.
* **Any single-bit change changes it, always.** For a fixed index ``i``, ``v ↦ mix(v XOR i·K)`` is a bijection, so a
  changed value changes exactly one term, and the sum by a non-zero amount mod 2^64. Other corruptions (two
  elements swapped, a tensor in another tensor's slot) change it unless 64-bit sums collide (≈ 2^-64).
* Vocab padding rows are left out (only the real rows are hashed): they hold nothing and depend on the TP size.

``megatron-preflight fingerprint CKPT`` stores them next to the checkpoint, in
``<root>/megatron_preflight_fingerprints/iter_NNNNNNN.json`` (never inside the iteration dir Megatron reads).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors, value_of
from megatron_preflight.prove.stored import path_for
from megatron_preflight.reshard.checkpoint_index import open_index
from megatron_preflight.reshard.sources.files import SourceFiles

FORMAT = 1
_MASK = (1 << 64) - 1
_CHUNK = 1 << 22  # elements hashed at a time (bounded temporaries)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1, _M2, _K = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _shr(z: Any, k: int) -> Any:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: Any) -> Any:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _bits(t: Any) -> Any:
    """The elements' raw bits as int64 words (sign extension of the narrower integer view is injective)."""
    import torch  # deferred: hashing reads tensors

    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).to(torch.int64)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return list(reversed(out))


def digest_box(t: Any, global_shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The partial digest of ``t``, a box of a global tensor of ``global_shape`` at ``offsets``."""
    import torch  # deferred: hashing reads tensors

    shape = tuple(t.shape)
    if len(shape) != len(global_shape) or len(offsets) != len(shape):
        raise ValueError(f"a box of shape {shape} at {offsets} does not fit a global tensor of {global_shape}")
    if not shape:
        return int(_mix(_bits(t.reshape(1)) ^ 0).sum()) & _MASK
    strides = _strides(tuple(global_shape))
    inner = 1
    for size in shape[1:]:
        inner *= size
    # the global flat index of each element of one row of the box (all dims but the first), computed once
    row = torch.zeros((), dtype=torch.int64)
    for d in range(1, len(shape)):
        axis = (torch.arange(shape[d], dtype=torch.int64) + offsets[d]) * strides[d]
        row = row.unsqueeze(-1) + axis
    row = row.reshape(-1)
    total = 0
    rows_per = max(1, _CHUNK // max(inner, 1))
    for r0 in range(0, shape[0], rows_per):
        r1 = min(shape[0], r0 + rows_per)
        first = (torch.arange(r0, r1, dtype=torch.int64) + offsets[0]) * strides[0]
        index = (first.unsqueeze(-1) + row).reshape(-1)
        z = _mix(_bits(t[r0:r1]) ^ (index * _K))
        total = (total + int(z.sum())) & _MASK
    return total


def digest_indexed(values: Any, indices: Any) -> tuple[int, int]:
    """(partial digest, elements hashed) of flat ``values`` at global flat ``indices`` (negative: not hashed)."""
    keep = indices >= 0
    v, i = _bits(values)[keep], indices[keep]
    return int(_mix(v ^ (i * _K)).sum()) & _MASK, int(keep.sum())


def digest(t: Any) -> int:
    """The digest of a whole global tensor."""
    return digest_box(t, tuple(t.shape), (0,) * t.dim())


def combine(partials: list[int]) -> int:
    """The digest of a tensor from the partial digests of disjoint boxes that cover it."""
    return sum(partials) & _MASK


def load(root: str, iteration: int | str) -> dict[str, Any] | None:
    """The stored fingerprints of an iteration, None when there are none; a damaged file is an error naming it."""
    path = path_for(root, iteration)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise PreflightError(f"the fingerprint file cannot be read ({exc})", path=path,
                             fix="remove it and run `megatron-preflight fingerprint` again", code="fingerprint") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict):
        raise PreflightError("the fingerprint file is not one this version writes", path=path,
                             fix="remove it and run `megatron-preflight fingerprint` again", code="fingerprint")
    return doc


def store(root: str, iteration: int | str, doc: dict[str, Any]) -> str:
    """Write the fingerprints atomically (a temp file in the same dir, then rename)."""
    path = path_for(root, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def fingerprint_checkpoint(root: str, *, iteration: Any = None, trust: bool = False,
                           weights_only: bool = False) -> dict[str, Any]:
    """The fingerprints of every global tensor of a checkpoint (weights, and the optimizer state in model space),
    read once, one tensor at a time."""
    import torch  # noqa: F401 - deferred: loaded before indexing, so the sources make tensors (TE extra state, dtypes)

    index = open_index(root, iteration=iteration, trust_checkpoint=trust)
    index.require_readable()
    g = global_resharder(index, not weights_only, None)
    real = g.vocab.real if g.vocab is not None else None
    tensors: dict[str, Any] = {}
    files = SourceFiles(g.layout.iter_dir or "", trust=trust)
    try:
        for name, tp in named_tensors(global_plan(g), g.writes_optimizer).items():
            value = value_of(tp, files)
            if not hasattr(value, "dtype"):
                continue  # None extra state: nothing to hash
            if getattr(tp, "pad_from", None) is not None and real is not None:
                value = value[:real]  # vocab padding rows left out
            tensors[name] = {"digest": f"{digest(value):016x}", "shape": list(value.shape),
                             "dtype": str(value.dtype).removeprefix("torch.")}
    finally:
        files.close()
    return {"format": FORMAT, "iteration": index.layout.iteration, "source": os.path.abspath(root),
            "vocab_rows": real, "optimizer_step": g.plain_step() if g.writes_optimizer else None,
            "tensors": tensors}
