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
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError, environment_error, require_regular_file
from megatron_preflight.prove import common_state, placement
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors, value_of
from megatron_preflight.prove.stored import path_for
from megatron_preflight.reshard.checkpoint_index import open_index
from megatron_preflight.reshard.optimizer.plain import MASTER
from megatron_preflight.reshard.plan.types import CopyOp, TensorPlan
from megatron_preflight.reshard.resharder import Resharder
from megatron_preflight.reshard.sources.files import SourceFiles

log = logging.getLogger(__name__)

FORMAT = 1
_MASK = (1 << 64) - 1
_CHUNK = 1 << 16  # elements hashed at a time: the temporaries (3 x 512 KiB) stay in the CPU's cache

_M1, _M2, _K = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


class _Hasher:
    """Sums ``mix(bits XOR index·K)`` over chunks of elements, in place in preallocated uint64 buffers (numpy: its
    uint64 arithmetic wraps mod 2^64 and its shifts are logical; one chunk stays in cache through the ~12 passes, so
    a 4-byte element costs a few ns — a torch version allocating a temporary per pass was ~16x slower)."""

    def __init__(self) -> None:
        import numpy as np  # deferred: hashing reads tensors

        self.np = np
        self.z = np.empty(_CHUNK, dtype=np.uint64)
        self.tmp = np.empty(_CHUNK, dtype=np.uint64)
        self.m1, self.m2, self.k = np.uint64(_M1), np.uint64(_M2), np.uint64(_K)
        self.total = 0

    def add(self, bits: Any, index: Any) -> None:
        """``bits``: the elements' raw bits (a 1-D integer array of their width, sign-extended to 64 bits as
        :func:`_words` says); ``index``: their global flat indices (1-D, the same length, at most _CHUNK)."""
        np = self.np
        n = bits.shape[0]
        z, tmp = self.z[:n], self.tmp[:n]
        with np.errstate(over="ignore"):
            np.multiply(index.astype(np.uint64, copy=False), self.k, out=z)
            np.bitwise_xor(z, bits.astype(np.int64, copy=False).view(np.uint64), out=z)
            for shift, mult in ((30, self.m1), (27, self.m2), (31, None)):
                np.right_shift(z, np.uint64(shift), out=tmp)
                np.bitwise_xor(z, tmp, out=z)
                if mult is not None:
                    np.multiply(z, mult, out=z)
        self.total = (self.total + int(z.sum(dtype=np.uint64))) & _MASK


def _words(t: Any) -> Any:
    """The elements' raw bits, flattened, as a numpy array of integers of their width (1-byte elements as uint8,
    wider ones as signed ints: the sign extension to 64 bits is injective)."""
    return _int_view(t).numpy()


def _int_view(t: Any) -> Any:
    """The elements' raw bits, flattened, as a tensor of integers of their width, where ``t`` lives."""
    import torch  # deferred: hashing reads tensors

    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return list(reversed(out))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_DEVICE_CHUNK = 1 << 22  # elements per pass on a device: 3 int64 temporaries of 32 MiB


def _device_sum(words: Any, index: Any) -> int:
    """Σ mix(bits XOR index·K) mod 2^64 with torch ops on the tensors' own device (a GPU: at memory bandwidth, no
    copy to the host). The same arithmetic as :class:`_Hasher` in int64 (wrapping multiplies; logical shifts as
    arithmetic shifts masked); the sum is taken in two 32-bit halves, so no int64 sum overflows."""
    import torch  # deferred: hashing reads tensors

    z = index.to(torch.int64).mul_(_signed(_K))
    z.bitwise_xor_(words.to(torch.int64))
    tmp = torch.empty_like(z)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z.bitwise_xor_(tmp.bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(_signed(mult))
    low = int(torch.bitwise_and(z, 0xFFFFFFFF, out=tmp).sum().item())
    high = int(z.bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF).sum().item())
    return (low + (high << 32)) & _MASK


def digest_box_on_device(t: Any, global_shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """:func:`digest_box` computed where ``t`` lives (used for a GPU tensor; on a CPU the numpy path is ~6x faster),
    in passes of :data:`_DEVICE_CHUNK` elements: the same value."""
    import torch  # deferred: hashing reads tensors

    shape = tuple(t.shape)
    words = _int_view(t)
    if not shape:
        return _device_sum(words, torch.zeros(1, dtype=torch.int64, device=t.device))
    if words.numel() == 0:
        return 0
    strides = _strides(tuple(global_shape))
    row = torch.zeros((), dtype=torch.int64, device=t.device)  # global flat index of each element of one row
    for d in range(1, len(shape)):
        row = row[..., None] + (torch.arange(shape[d], dtype=torch.int64, device=t.device) + offsets[d]) * strides[d]
    row = row.reshape(-1)
    inner = row.numel()
    first = (torch.arange(shape[0], dtype=torch.int64, device=t.device) + offsets[0]) * strides[0]
    total = 0
    if inner >= _DEVICE_CHUNK:  # long rows: each row in pieces
        for r in range(shape[0]):
            for c0 in range(0, inner, _DEVICE_CHUNK):
                c1 = min(inner, c0 + _DEVICE_CHUNK)
                total += _device_sum(words[r * inner + c0:r * inner + c1], row[c0:c1] + first[r])
        return total & _MASK
    rows_per = _DEVICE_CHUNK // inner
    for r0 in range(0, shape[0], rows_per):
        r1 = min(shape[0], r0 + rows_per)
        total += _device_sum(words[r0 * inner:r1 * inner], (first[r0:r1, None] + row[None, :]).reshape(-1))
    return total & _MASK


def digest_box(t: Any, global_shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The partial digest of ``t``, a box of a global tensor of ``global_shape`` at ``offsets`` (a tensor on a GPU
    is hashed there: :func:`digest_box_on_device`)."""
    import numpy as np  # deferred: hashing reads tensors

    shape = tuple(t.shape)
    if len(shape) != len(global_shape) or len(offsets) != len(shape):
        raise ValueError(f"a box of shape {shape} at {offsets} does not fit a global tensor of {global_shape}")
    if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
        return digest_box_on_device(t, global_shape, offsets)
    h = _Hasher()
    words = _words(t)
    if not shape:
        h.add(words, np.zeros(1, dtype=np.int64))
        return h.total
    if words.size == 0:
        return 0
    strides = _strides(tuple(global_shape))
    # the global flat index of each element of one row of the box (all dims but the first), computed once
    row = np.zeros((), dtype=np.int64)
    for d in range(1, len(shape)):
        axis = (np.arange(shape[d], dtype=np.int64) + offsets[d]) * strides[d]
        row = row[..., None] + axis
    row = row.reshape(-1)
    inner = row.shape[0]
    first = (np.arange(shape[0], dtype=np.int64) + offsets[0]) * strides[0]
    if inner >= _CHUNK:  # long rows: each row in pieces
        for r in range(shape[0]):
            base = r * inner
            for c0 in range(0, inner, _CHUNK):
                c1 = min(inner, c0 + _CHUNK)
                h.add(words[base + c0:base + c1], row[c0:c1] + first[r])
        return h.total
    rows_per = _CHUNK // inner
    for r0 in range(0, shape[0], rows_per):
        r1 = min(shape[0], r0 + rows_per)
        h.add(words[r0 * inner:r1 * inner], (first[r0:r1, None] + row[None, :]).reshape(-1))
    return h.total


def digest_indexed(values: Any, indices: Any) -> tuple[int, int]:
    """(partial digest, elements hashed) of flat ``values`` at global flat ``indices`` (negative: not hashed); values
    on a GPU are hashed there."""
    if getattr(getattr(values, "device", None), "type", "cpu") != "cpu":
        words, index = _int_view(values), indices.to(values.device)
        keep = index >= 0
        words, index = words[keep], index[keep]
        total = 0
        for s in range(0, words.numel(), _DEVICE_CHUNK):
            total += _device_sum(words[s:s + _DEVICE_CHUNK], index[s:s + _DEVICE_CHUNK])
        return total & _MASK, int(words.numel())
    words, index = _words(values), indices.numpy()
    keep = index >= 0
    if not keep.all():
        words, index = words[keep], index[keep]
    h = _Hasher()
    for s in range(0, words.shape[0], _CHUNK):
        h.add(words[s:s + _CHUNK], index[s:s + _CHUNK])
    return h.total, int(words.shape[0])


def digest(t: Any) -> int:
    """The digest of a whole global tensor."""
    return digest_box(t, tuple(t.shape), (0,) * t.dim())


def combine(partials: list[int]) -> int:
    """The digest of a tensor from the partial digests of disjoint boxes that cover it."""
    return sum(partials) & _MASK


MAX_FILE_BYTES = 256 << 20  # ~2M tensors' fingerprints: far above any checkpoint's (DeepSeek-V3: ~140k entries)
_HEX = frozenset("0123456789abcdef")
_REMAKE = "remove it and run `megatron-preflight fingerprint` on the checkpoint to store them again"


def load(root: str, iteration: int | str) -> dict[str, Any] | None:
    """The stored fingerprints of an iteration, None when there are none. Read with bounded memory (a file over
    :data:`MAX_FILE_BYTES` is refused unread), parsed as JSON (nothing executed) and checked entry by entry: a damaged,
    truncated, edited or foreign file is one error naming it, never a traceback."""
    path = path_for(root, iteration)
    if not os.path.lexists(path):
        return None

    def bad(what: str) -> PreflightError:
        return PreflightError(f"this is not a fingerprint file megatron-preflight can use: {what}", path=path,
                              fix=_REMAKE, code="fingerprint")

    try:
        require_regular_file(path)
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise bad(f"{size:,} bytes, more than any checkpoint's fingerprints take ({MAX_FILE_BYTES:,})")
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(MAX_FILE_BYTES + 1))
    except PreflightError:
        raise
    except OSError as exc:
        raise environment_error(exc) from None
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({str(exc)[:120]}: truncated or edited?)") from None
    problem = _malformed(doc)
    if problem:
        raise bad(problem)
    if str(doc["iteration"]) != str(iteration):
        raise bad(f"it holds the fingerprints of iteration {doc['iteration']}, stored under iteration {iteration}'s "
                  "name (copied or renamed)")
    return doc


def _malformed(doc: Any) -> str | None:
    """What is wrong with a parsed fingerprint file (None: its structure is sound)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("format") != FORMAT:
        return f"format {doc.get('format')!r}, not {FORMAT} (another tool, or another version of this one)"
    if not isinstance(doc.get("iteration"), (int, str)) or isinstance(doc.get("iteration"), bool):
        return "no iteration"
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        return "no tensors"
    for name, e in tensors.items():
        if not (isinstance(e, dict) and _is_digest(e.get("digest")) and isinstance(e.get("dtype"), str)
                and _is_shape(e.get("shape"))):
            return f"the entry of {str(name)[:200]} is not a digest, a dtype and a shape"
    common = doc.get("common", {})
    if not isinstance(common, dict) or not isinstance(common.get("param_groups", []), list):
        return "its common state is not an object with a list of param groups"
    boxes = doc.get("boxes", {})
    if not isinstance(boxes, dict):
        return "its boxes are not an object"
    for name, parts in boxes.items():
        if name not in tensors or not isinstance(parts, list) or not all(
                isinstance(b, list) and len(b) == 3 and _is_shape(b[0]) and _is_digest(b[1]) and isinstance(b[2], int)
                for b in parts):
            return f"the slices of {str(name)[:200]} are not (offsets, digest, elements)"
    return None


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 16 and set(v) <= _HEX


def _is_shape(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 8 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in v)


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


Partials = dict[str, dict[tuple, tuple[int, int]]]  # global name -> box (offsets, sizes) -> (partial digest, numel)


def fingerprint_checkpoint(root: str, *, iteration: Any = None, trust: bool = False, weights_only: bool = False,
                           streamed: Partials | None = None, stats: dict[str, int] | None = None) -> dict[str, Any]:
    """The fingerprints of every global tensor of a checkpoint (weights, and the optimizer state in model space),
    read once, one tensor at a time — except the tensors ``streamed`` covers whole (the partial digests a writer's
    taps took as it wrote them: see :class:`Fingerprinting`), which are not read at all. ``stats`` gets how many
    tensors were taken from ``streamed`` and how many read."""
    import torch  # noqa: F401 - deferred: loaded before indexing, so the sources make tensors (TE extra state, dtypes)

    index = open_index(root, iteration=iteration, trust_checkpoint=trust)
    index.require_readable()
    g = global_resharder(index, not weights_only, None)
    tensors: dict[str, Any] = {}
    boxes: dict[str, list[list[Any]]] = {}
    counts = {"streamed": 0, "read": 0}
    files = SourceFiles(g.layout.iter_dir or "", trust=trust, crc=True)  # every byte read: each record's CRC too
    try:
        for printed in each_fingerprint(g, files, streamed):
            tensors[printed.name] = printed.entry
            counts[printed.how] += 1
            if len(printed.boxes) > 1:
                boxes[printed.name] = [[list(o), f"{d:016x}", n] for o, d, n, _ in printed.boxes]
    finally:
        files.close()
    if stats is not None:
        stats.update(counts)
    return document(g, index.layout.iteration, os.path.abspath(root), tensors, boxes,
                    common=common_state.document(index, g.choice.plain) if g.writes_optimizer else None)


def document(g: Resharder, iteration: Any, source: str, tensors: dict[str, Any],
             boxes: dict[str, list[list[Any]]] | None = None, common: dict[str, Any] | None = None) -> dict[str, Any]:
    """A fingerprint file's content (``boxes``: per tensor split over several boxes, each box's partial digest, so a
    later check names the shard that holds a differing slice; ``common``: the common state a resume reads,
    :func:`common_state.document`)."""
    doc = {"format": FORMAT, "iteration": iteration, "source": source,
           "vocab_rows": g.vocab.real if g.vocab is not None else None,
           "optimizer_step": g.plain_step() if g.writes_optimizer else None, "tensors": tensors}
    if boxes:
        doc["boxes"] = boxes
    if common is not None:
        doc["common"] = common
    return doc


@dataclass
class Printed:
    """One global tensor's fingerprint as :func:`each_fingerprint` took it: its ``entry`` in the file, whether it was
    ``streamed`` or ``read``, and (read, split over several source slices) each slice's box: (global offsets, partial
    digest, elements, the copy that read it — its shard and its replicas')."""

    name: str
    plan: Any
    entry: dict[str, Any]
    how: str
    boxes: list[tuple[tuple[int, ...], int, int, CopyOp]] = field(default_factory=list)


def planned(g: Resharder) -> dict[str, Any]:
    """Every global tensor ``g`` plans that has a fingerprint, by global name (a TE module's extra state is per-rank
    metadata, FP8 scales, not a tensor of the model: left out)."""
    return {name: tp for name, tp in named_tensors(global_plan(g), g.writes_optimizer).items()
            if not name.endswith("_extra_state")}


def each_fingerprint(g: Resharder, files: SourceFiles, streamed: Partials | None = None) -> Iterator[Printed]:
    """The fingerprint of every global tensor ``g`` plans (values that are not tensors left out), one tensor read
    at a time."""
    for name, tp in planned(g).items():
        printed = fingerprint_of(g, name, tp, files, streamed)
        if printed is not None:
            yield printed


def fingerprint_of(g: Resharder, name: str, tp: Any, files: SourceFiles, streamed: Partials | None = None
                   ) -> Printed | None:
    """One planned tensor's fingerprint (None: not a tensor), from ``streamed`` when it covers the tensor whole,
    else read."""
    import torch  # noqa: F401 - deferred: loaded before reading, so the sources make tensors (TE extra state, dtypes)

    real = g.vocab.real if g.vocab is not None else None
    if isinstance(tp, TensorPlan) and tp.shape is not None:
        shape = list(tp.shape)
        if tp.pad_from is not None and real is not None:
            shape[0] = real  # vocab padding rows left out
        known = _whole(streamed.get(name), shape) if streamed else None
        if known is not None:
            return Printed(name, tp, {"digest": f"{known:016x}", "shape": shape,
                                      "dtype": str(dtypes.to_torch(tp.dtype)).removeprefix("torch.")}, "streamed")
    value = value_of(tp, files)
    if not hasattr(value, "dtype"):
        return None  # None extra state: nothing to hash
    if getattr(tp, "pad_from", None) is not None and real is not None:
        value = value[:real]  # vocab padding rows left out
    boxes = _op_boxes(tp, value) if isinstance(tp, TensorPlan) else []
    whole = combine([d for _, d, _, _ in boxes]) if boxes else digest(value)
    return Printed(name, tp, {"digest": f"{whole:016x}", "shape": list(value.shape),
                              "dtype": str(value.dtype).removeprefix("torch.")}, "read", boxes)


def _op_boxes(tp: TensorPlan, value: Any) -> list[tuple[tuple[int, ...], int, int, CopyOp]]:
    """The partial digest of each source slice of ``value`` (the box a copy wrote; rows past ``value``'s, vocab
    padding, left out), when the copies cover it exactly and each along one dim; [] otherwise (one box, or a form
    these boxes cannot describe)."""
    shape = tuple(value.shape)
    if len(tp.ops) < 2 or not shape or any(op.dst is None for op in tp.ops):
        return []
    out, covered = [], 0
    for op in tp.ops:
        dim, start, length = op.dst
        if dim == 0:
            length = min(length, shape[0] - start)
        if length <= 0:
            continue
        piece = value.narrow(dim, start, length)
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        out.append((offsets, digest_box(piece, shape, offsets), piece.numel(), op))
        covered += piece.numel()
    return out if covered == value.numel() and len({b[0] for b in out}) == len(out) else []


def _whole(boxes: dict[tuple, tuple[int, int]] | None, shape: list[int]) -> int | None:
    """The digest of a tensor from streamed boxes, when they cover it exactly (disjoint boxes, counted once)."""
    if not boxes:
        return None
    numel = 1
    for s in shape:
        numel *= s
    if sum(n for _, n in boxes.values()) != numel:
        return None
    return combine([d for d, _ in boxes.values()])


# the names a writer gives an fp32 master (a distributed optimizer's ``param``, a torch_dist plain optimizer's
# ``fp32_param``) and the one the global view reads it under
_MASTER_ALIASES = ("param", "fp32_param")


class StreamTap:
    """One unit's tap (see reshard/targets/unit.py): the partial digest of every box of a global tensor that the unit
    writes, per global name — summed over the pieces the writer streams, so nothing is read back."""

    def __init__(self, r: Resharder, coords: dict[str, int]) -> None:
        self.r, self.coords = r, coords
        self.parts: Partials = {}

    def tensor(self, plan: TensorPlan, r0: int, rows: Any) -> None:
        param = plan.param if plan.param is not None else plan
        if param.gkey is None or plan.shape is None or param.shape is None or param.key.endswith("_extra_state"):
            return
        name = placement.global_name(self.r, param)
        if plan.param is not None:
            state = plan.key.rsplit("#", 1)[1]
            name += "#" + (MASTER if state in _MASTER_ALIASES else state)
        boxes = self.parts.setdefault(name, {})
        if not plan.shape:
            boxes[((), ())] = (digest_box(rows.reshape(()), (), ()), 1)
            return
        rows = rows.reshape((-1, *plan.shape[1:]))
        r1 = r0 + rows.shape[0]
        for local, gshape, offsets in placement.boxes(self.r, param, self.coords):
            lo, hi = max(local[0].start, r0), min(local[0].stop, r1)
            if lo >= hi:
                continue
            piece = rows[(slice(lo - r0, hi - r0), *local[1:])]
            at = (offsets[0] + lo - local[0].start, *offsets[1:])
            key = (tuple(offsets), tuple(sl.stop - sl.start for sl in local))
            d, n = boxes.get(key, (0, 0))
            boxes[key] = (combine([d, digest_box(piece, gshape, at)]), n + piece.numel())

    def result(self) -> Partials:
        return self.parts


class Fingerprinting:
    """``reshard --fingerprint``: taps every unit the writer writes, then writes the output's fingerprint file into
    the temp root before the rename — named and shaped by the output's own global view (as ``megatron-preflight
    fingerprint`` would), each digest from the streamed partials; a tensor they do not cover whole (a form the taps
    cannot place, or replicas that disagree) is read back from the output and hashed."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def open(self, r: Resharder, coords: dict[str, int]) -> StreamTap:
        return StreamTap(r, coords)

    def finish(self, r: Resharder, results: list[Any], tmp_root: str, dst_root: str) -> list[str]:
        merged: Partials = {}
        disagree: set[str] = set()
        for part in results:
            for name, boxes in (part or {}).items():
                into = merged.setdefault(name, {})
                for key, (d, n) in boxes.items():
                    if key in into and into[key] != (d, n):
                        disagree.add(name)  # replicas written differently: read it back
                    into.setdefault(key, (d, n))
        for name in disagree:
            log.warning("fingerprint: the written replicas of %s differ; reading it back", name)
            merged.pop(name)
        doc = fingerprint_checkpoint(tmp_root, iteration=r.layout.iteration if r.layout.iteration is not None else 0,
                                     trust=True, weights_only=not r.writes_optimizer, streamed=merged,
                                     stats=self.stats)
        doc["source"] = os.path.abspath(dst_root)
        path = store(tmp_root, doc["iteration"], doc)
        return [os.path.join(dst_root, os.path.relpath(path, tmp_root))]
