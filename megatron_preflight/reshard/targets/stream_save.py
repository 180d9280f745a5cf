"""Write a target shard as a standard ``torch.save`` zip file, one tensor at a time.

``torch.save`` needs every tensor in memory at once; a resharded TP1 shard of a big model would then cost its whole
size in RAM. Here the object tree is pickled first with small stubs in place of tensors (exactly the records
``torch.save`` would write: ``_rebuild_tensor_v2`` over a persistent storage id), then each tensor is built from its
source slices about CHUNK_BYTES of whole rows at a time, in a few reused buffers (a contiguous source run read
straight into place with ``pread``), and written as its storage record by a second thread. Peak memory ≈ four
pieces. ``torch.load`` (and Megatron) read the result like any other checkpoint.

From a legacy source the pieces are numpy arrays of the elements' bytes (:data:`~..arrays.BYTES`) and the
pickle names torch's globals without importing torch: a legacy -> legacy reshard never loads it (~2 s of a process's
start). Torch tensors are built where a source is another format's, or a tap hashes the values.
"""

from __future__ import annotations

import io
import mmap
import os
import queue
import struct
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from megatron_preflight import crc, dtypes, pickling
from megatron_preflight.held_tensor import HeldTensor
from megatron_preflight.placeholders import placeholder_class
from megatron_preflight.reshard.arrays import BYTES, TORCH, Kit
from megatron_preflight.reshard.execute.executor import Span, Stage, build_rows, tiled_crc
from megatron_preflight.reshard.plan.types import FlatPlan, RankPlan, TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.targets.unit import Tap
from megatron_preflight.reshard.targets.write_behind import WriteBehind
from megatron_preflight.reshard.targets.zip_writer import TorchZipWriter, zip_size
from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import map_leaves

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 4 * 2**20  # a target tensor is built and written this many bytes (whole rows) at a time
PIECE_BUFFERS = 4  # the piece buffers of a file being written: one filled while the others wait for the writer

# dtype name -> the legacy storage class torch.save names for it (the reverse of the reader's table; the float8
# dtypes have none in torch)
_STORAGE_NAMES = {name: cls for cls, name in dtypes.STORAGE_DTYPES.items()
                  if cls != "UntypedStorage" and not cls.startswith("Float8")}
# what torch.save's pickle names, as the globals they are (written by name: torch need not be loaded)
_REBUILD = placeholder_class("torch._utils", "_rebuild_tensor_v2")
_SIZE = placeholder_class("torch", "Size")


class _StorageStub:
    def __init__(self, key: str, dtype: Any, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Size:
    """Pickles as ``torch.Size(shape)``."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce__(self) -> Any:
        return (_SIZE, (self.shape,))


class _TensorStub:
    """Pickles as ``torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())``."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self) -> Any:
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        return (_REBUILD, (self.storage, 0, _Size(self.shape), tuple(reversed(stride)), False, OrderedDict()))


class _Pickler(pickling.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageStub):
            cls = placeholder_class("torch", _STORAGE_NAMES[dtypes.name_of(obj.dtype) or ""])
            return ("storage", cls, obj.key, "cpu", obj.numel)
        return None


def shard_tree(header: dict[str, Any], plan: RankPlan) -> dict[str, Any]:
    """The object tree of a target ``model_optim_rng.pt``: ``header`` plus the planned model chunks and optimizer."""
    state: dict[str, Any] = dict(header)
    for chunk in plan.chunks:
        state[chunk] = OrderedDict()
    for tp in plan.tensors:
        state[tp.chunk][tp.key] = tp
    if plan.optimizer is not None:
        state["optimizer"] = plan.optimizer
    return state


def save_streaming(header: dict[str, Any], plan: RankPlan, files: SourceFiles, path: str, tap: Tap | None = None
                   ) -> int:
    """Write ``header`` plus the model chunks (and optimizer state) of ``plan`` to ``path``; returns the bytes of
    tensor data written."""
    return save_tree(shard_tree(header, plan), files, path, tap)


def _records(tree: Any) -> tuple[bytes, list[tuple[_StorageStub, Any]]]:
    """The pickled object tree (tensors as storage references) and the storages to write after it."""
    pending: list[tuple[_StorageStub, Any]] = []

    def stub(value: Any, _path: tuple = ()) -> Any:
        if isinstance(value, (TensorPlan, FlatPlan)):
            if value.shape is None:  # a carried value (extra state): a tensor inside it is a storage record too
                return map_leaves(value.value, stub)
            n = 1
            for s in value.shape:
                n *= s
            storage = _StorageStub(str(len(pending)), value.dtype, n)
            pending.append((storage, value))
            return _TensorStub(storage, value.shape)
        if isinstance(value, HeldTensor):
            storage = _StorageStub(str(len(pending)), value.dtype, len(value.data) // value.dtype.itemsize)
            pending.append((storage, value))
            return _TensorStub(storage, value.shape)
        if dtypes.is_tensor(value):
            value = value.contiguous()
            storage = _StorageStub(str(len(pending)), value.dtype, value.numel())
            pending.append((storage, value))
            return _TensorStub(storage, tuple(value.shape))
        return value

    state = map_leaves(tree, stub)
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)
    return buf.getvalue(), pending


_FORMAT_VERSION, _BYTEORDER, _VERSION = b"1", b"little", b"3\n"


def _archive(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0] or "archive"


def planned_size(tree: Any, filename: str) -> int:
    """The size of the file :func:`save_tree` writes for ``tree`` under the name ``filename``: no tensor is built, the
    pickled tree and the zip records are laid out as the writer lays them out (the pickle may differ by the memo of a
    repeated value: tens of bytes)."""
    data, pending = _records(tree)
    records = [("data.pkl", len(data)), (".format_version", len(_FORMAT_VERSION)), ("byteorder", len(_BYTEORDER))]
    records += [(f"data/{s.key}", s.numel * s.dtype.itemsize) for s, _ in pending]
    records += [("version", len(_VERSION)), (".data/serialization_id", len(_serialization_id("", 0)))]
    return zip_size(records, _archive(filename))


def save_tree(tree: Any, files: SourceFiles, path: str, tap: Tap | None = None) -> int:
    """Write ``tree`` as a torch file at ``path``, building each planned tensor (:class:`TensorPlan`,
    :class:`FlatPlan`) from its source slices a piece at a time (each piece shown to ``tap``); returns the bytes of
    tensor data written."""
    data, pending = _records(tree)
    kit = TORCH if tap is not None or not all(bytes_only(source) for _, source in pending) else BYTES
    written = 0
    # the file is written by a second thread while this one builds the next pieces (write_behind: both release the
    # GIL); every call on the archive goes through it, in order. Its queue holds every piece buffer's two calls
    # (append, give back) and a record's end and next begin: the piece buffers, not the queue, bound what waits
    # (a queue of 2 calls kept the builder one piece ahead and serialised the two: 0.92 -> 0.72 s for the 1.2 GB
    # TP2 -> TP1 reshard's data on tmpfs)
    with TorchZipWriter(path, _archive(path)) as zw, WriteBehind(depth=2 * PIECE_BUFFERS + 2) as behind:
        behind.submit(zw.write, "data.pkl", data)
        behind.submit(zw.write, ".format_version", _FORMAT_VERSION)
        behind.submit(zw.write, "byteorder", _BYTEORDER)
        buffers = _Buffers(behind, kit, PIECE_BUFFERS)
        stage = Stage(kit)
        for storage, source in pending:
            nbytes = storage.numel * storage.dtype.itemsize
            behind.submit(zw.begin, f"data/{storage.key}", nbytes)
            value = 0
            for plan, r0, part, buf, piece_crc in _pieces(source, files, buffers, kit, stage):
                raw = kit.as_bytes(part)
                # the record's CRC-32 is taken here (the writer thread, which waits on the file system, only writes):
                # from the CRC-32s the reads took of the piece's bytes, or over the bytes when they were not all read so
                value = crc.crc32(raw, value) if piece_crc is None else crc.combine(value, piece_crc, raw.nbytes)
                behind.submit(zw.append, raw, value)  # holds the piece till written
                if tap is not None and plan is not None:
                    tap.tensor(plan, r0, part)
                if buf is not None:
                    behind.submit(buffers.give_back, buf)  # after its bytes are written
                del part, buf, raw
                files.release_pages()
            behind.submit(zw.end)
            written += nbytes
        files.finish()  # the CRC-32 of each source record read only in part, before the file is complete
        behind.submit(zw.write, "version", _VERSION)
        behind.submit(zw.write, ".data/serialization_id", _serialization_id(path, written).encode())
    return written


def bytes_only(source: Any) -> bool:
    """Whether a storage to write (or verify) is built from legacy pieces (or held bytes) alone: then as numpy
    arrays of its bytes, without torch."""
    if isinstance(source, FlatPlan):
        return all(bytes_only(tp) for _, tp in source.parts)
    if isinstance(source, TensorPlan):
        return all(type(op.ref) is TensorRef for op in source.ops)
    return isinstance(source, HeldTensor)


_BLOB_PICKLES: dict[tuple[Any, tuple[int, ...]], bytes] = {}


def _blob_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The pickled rebuild call of a whole tensor (storage "0"): it depends on the dtype and shape alone, and a
    model's chunks have a few of them (cached)."""
    data = _BLOB_PICKLES.get((dtype, shape))
    if data is None:
        n = 1
        for size in shape:
            n *= size
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(_TensorStub(_StorageStub("0", dtype, n), shape))
        if len(_BLOB_PICKLES) >= 4096:
            _BLOB_PICKLES.clear()
        data = _BLOB_PICKLES[(dtype, shape)] = buf.getvalue()
    return data


def blob_size(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The bytes :func:`write_tensor_blob` writes for a tensor of ``dtype`` and ``shape`` (no tensor made): its
    frame and its data."""
    n = dtype.itemsize
    for size in shape:
        n *= size
    head, tail, _, _ = _blob_frame(dtype, tuple(shape), n)
    return len(head) + n + len(tail)


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage, contiguous (torch.save writes a tensor's whole storage: a view of a bigger
    one would carry the rest)."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def can_write_blob(t: torch.Tensor) -> bool:
    """Whether :func:`write_tensor_blob` writes ``t`` (a dtype with a storage class torch.save names; its whole
    storage)."""
    return dtypes.name_of(t.dtype) in _STORAGE_NAMES and owns_storage(t)


def write_tensor_blob(fh: Any, t: torch.Tensor) -> None:
    """``t`` as ``torch.save(t, fh)`` writes it — a torch zip archive at ``fh``'s position: the pickled rebuild call,
    the storage record, the format records — without ``torch.save``'s per-call cost (a torch_dist save writes one per
    chunk, ~10^4-10^5 of them): the archive around the data is the same for every tensor of a dtype and shape but for
    the data's CRC-32 (:func:`_blob_frame`), so a blob is three writes. ``t`` must pass :func:`can_write_blob`."""
    raw = TORCH.as_bytes(t)
    head, tail, at_head, at_tail = _blob_frame(t.dtype, tuple(t.shape), raw.nbytes)
    value = crc.crc32(raw)
    head, tail = bytearray(head), bytearray(tail)
    _CRC.pack_into(head, at_head, value)
    _CRC.pack_into(tail, at_tail, value)
    fh.write(head)
    fh.write(raw)
    fh.write(tail)


_CRC = struct.Struct("<L")
_BLOB_FRAMES: dict[tuple[Any, tuple[int, ...]], tuple[bytes, bytes, int, int]] = {}


def _blob_frame(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> tuple[bytes, bytes, int, int]:
    """The archive :class:`TorchZipWriter` writes around a tensor's data — the records before it and the data
    record's header, the records after it and the central directory — and where the data's CRC-32 goes in each
    (cached per dtype and shape; a model's chunks have a few). Found by laying the archive out twice, with two CRCs
    that differ in every bit: the data's own bytes are never read (an untouched anonymous mapping stands for them)."""
    key = (dtype, shape)
    frame = _BLOB_FRAMES.get(key)
    if frame is not None:
        return frame
    # (read-only, never touched: no pages made, nothing charged to the commit limit, whatever the chunk's size)
    hole: Any = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) if nbytes else bytearray()
    try:
        layouts = [_lay_out(dtype, shape, hole, given) for given in (0, 0xFFFFFFFF)]
    finally:
        if nbytes:
            hole.close()
    (head, tail), (head2, tail2) = layouts
    slots = [_crc_slot(a, b) for a, b in ((head, head2), (tail, tail2))]
    if len(_BLOB_FRAMES) >= 4096:
        _BLOB_FRAMES.clear()
    frame = _BLOB_FRAMES[key] = (head, tail, slots[0], slots[1])
    return frame


def _lay_out(dtype: torch.dtype, shape: tuple[int, ...], data: Any, given_crc: int) -> tuple[bytes, bytes]:
    """The blob's bytes before and after its data (``data``'s bytes left out), its data record's CRC given."""
    nbytes = memoryview(data).nbytes
    out = _Frame(data)
    zw = TorchZipWriter(None, "archive", fh=out)
    zw.write("data.pkl", _blob_pickle(dtype, shape))
    zw.write(".format_version", _FORMAT_VERSION)
    zw.write("byteorder", _BYTEORDER)
    zw.begin("data/0", nbytes, crc32=given_crc)  # (the one storage's key: _records numbers them from 0)
    zw.append(data)
    zw.end()
    zw.write("version", _VERSION)
    zw.write(".data/serialization_id", _serialization_id("archive", nbytes).encode())
    zw.close()
    return out.frame()


def _crc_slot(a: bytes, b: bytes) -> int:
    """Where two layouts that differ only in a CRC-32 (0 and all ones) differ: 4 bytes, exactly once."""
    at = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(at) != 4 or at[-1] - at[0] != 3:
        raise AssertionError(f"a tensor blob's layout holds its CRC-32 at {at}, not in one 4-byte field")
    return at[0]


class _Frame:
    """A file that keeps what is written to it but the bytes of ``hole`` (the blob's data, written once): the bytes
    before it and after it."""

    def __init__(self, hole: Any) -> None:
        self.hole = hole
        self._pos = 0
        self._parts: list[bytes] = []
        self._at: int | None = None  # how many parts came before the hole

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.obj is self.hole:
            self._at = len(self._parts)
        else:
            self._parts.append(bytes(view))
        self._pos += view.nbytes
        return view.nbytes

    def frame(self) -> tuple[bytes, bytes]:
        if self._at is None:
            raise AssertionError("the blob's data was not written")
        return b"".join(self._parts[:self._at]), b"".join(self._parts[self._at:])


class _Buffers:
    """The piece buffers of one file, reused: one is filled while the others wait for the writer thread, which hands
    each back once its bytes are written (no fresh pages to fault in and zero for every piece)."""

    def __init__(self, behind: WriteBehind, kit: Kit, count: int = 4) -> None:  # (PIECE_BUFFERS)
        self._behind = behind
        self._kit = kit
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(None)  # allocated on first use

    def take(self, nbytes: int) -> Any:
        while True:
            try:
                buf = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                self._behind.check()  # the writer failed: it hands nothing back
        if buf is None or self._kit.nbytes(buf) < nbytes:
            buf = self._kit.buffer(max(nbytes, CHUNK_BYTES))
        return buf

    def give_back(self, buf: Any) -> None:
        self._free.put(buf)


def _pieces(source: Any, files: SourceFiles, buffers: _Buffers, kit: Kit, stage: Stage) -> Any:
    """A target tensor in row chunks of about CHUNK_BYTES, each as (its plan, its first row, the rows, the buffer
    to hand back once they are written, the rows' CRC-32 when the reads that built them took it, else None) — a
    carried tensor: whole, no plan; a flat world tensor: its parameters' states one after the other (flattened),
    zeros between, no plan."""
    if isinstance(source, FlatPlan):
        pos = 0
        for start, tp in sorted(source.parts, key=lambda x: x[0]):
            if start > pos:
                yield None, 0, kit.zeros(start - pos, source.dtype), None, None
            pos = start
            for plan, r0, piece, buf, piece_crc in _pieces(tp, files, buffers, kit, stage):
                if dtypes.name_of(tp.dtype) != dtypes.name_of(source.dtype):  # other bytes than those read
                    piece, piece_crc = kit.converted(piece, tp.dtype, source.dtype), None
                pos += kit.nbytes(piece) // source.dtype.itemsize
                yield plan, r0, piece, buf, piece_crc
        if pos < source.numel:
            yield None, 0, kit.zeros(source.numel - pos, source.dtype), None, None
        return
    if isinstance(source, HeldTensor):
        yield None, 0, kit.held(source), None, None
        return
    if not isinstance(source, TensorPlan):
        yield None, 0, source.contiguous(), None, None
        return
    shape = source.shape
    assert shape is not None
    row = source.dtype.itemsize
    for s in shape[1:]:
        row *= s
    if not shape or shape[0] == 0:
        bounds = [(0, shape[0] if shape else 1)]
    else:
        step = max(1, CHUNK_BYTES // max(row, 1))
        bounds = [(r0, min(r0 + step, shape[0])) for r0 in range(0, shape[0], step)]
    for r0, r1 in bounds:
        buf = buffers.take(max(r1 - r0, 1) * row)
        spans: list[Span] = []
        rows = build_rows(source, files, r0, r1, release=True, out=buf, spans=spans, kit=kit, stage=stage)
        yield source, r0, rows, buf, tiled_crc(spans, kit.nbytes(rows))


def _serialization_id(path: str, nbytes: int) -> str:
    """A stable id for the file (torch stamps one per file; its value is not interpreted on load)."""
    return f"{zlib.crc32(f'{os.path.basename(path)}:{nbytes}'.encode()):040d}"
