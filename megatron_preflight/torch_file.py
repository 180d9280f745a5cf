"""Read ``torch.save`` zip files without reading tensor bytes, and materialise single tensors lazily (mmap).

A torch zip file holds ``<archive>/data.pkl`` (the object tree, with tensors as references to storages) and one
uncompressed record ``<archive>/data/<key>`` per storage. :func:`read_torch_file` unpickles only ``data.pkl``
(through :mod:`megatron_preflight.safe_pickle`) and returns :class:`TensorRef` objects in place of tensors, so a 1 GB
shard costs what a 1 MB shard costs. :meth:`TorchFile.tensor` maps one storage record and returns a tensor view
(copy-on-write mmap: the file is never written).
"""

from __future__ import annotations

import functools
import io
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.crc import combine, crc32
from megatron_preflight.errors import CorruptFileError, PreflightError, require_regular_file
from megatron_preflight.safe_pickle import bounded_load
from megatron_preflight.zip_directory import Record, read_directory

if TYPE_CHECKING:
    import zipfile

_STORED = 0  # zipfile.ZIP_STORED (zipfile itself is loaded only for a layout read_directory leaves to it)


@dataclass(frozen=True)
class StorageType:
    """Stand-in for ``torch.FloatStorage`` & co. inside a pickle: just the dtype."""

    dtype: Any


@dataclass(frozen=True)
class StorageRef:
    """One storage record of a torch zip file."""

    key: str
    dtype: Any  # a torch.dtype, or a dtypes.DType when read without torch
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor described by metadata only: where its bytes are, its dtype, shape and strides."""

    file: str
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def window(self, start: int, shape: tuple[int, ...]) -> TensorRef:
        """Elements ``start .. start + prod(shape)`` of this 1-D tensor (a flat optimizer buffer), as a contiguous
        tensor of ``shape`` (every source format's refs answer this: a torch_dist region cuts its slabs)."""
        return TensorRef(self.file, self.storage, self.offset + start, tuple(shape), row_major(tuple(shape)))

    def __repr__(self) -> str:
        return f"TensorRef({tuple(self.shape)}, {self.dtype})"


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` / ``stride`` lays its elements out contiguously in row-major order (the stride
    of a dim of size 1 does not matter)."""
    if len(shape) != len(stride):
        return False
    return all(n == 1 or st == want for n, st, want in zip(shape, stride, row_major(shape), strict=True))


def row_pitch(shape: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    """The elements from one row (dim 0) of a tensor to the next, when each row is stored contiguously row-major and
    rows do not overlap (a column slice of a matrix: its row stride; a contiguous tensor: its row size); else None."""
    if not shape or len(shape) != len(stride) or not is_row_major(shape[1:], stride[1:]):
        return None
    row = math.prod(shape[1:])
    if shape[0] == 1:
        return row
    return stride[0] if stride[0] >= row else None


def _rebuild_tensor_hook(file: str):
    def rebuild(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
        try:
            ref = TensorRef(file, storage, int(storage_offset), tuple(int(s) for s in size),
                            tuple(int(s) for s in stride))
        except (TypeError, ValueError):
            raise CorruptFileError(f"a tensor's size {size!r} / stride {stride!r} / offset {storage_offset!r} are not "
                                   "integers", path=file, fix="restore the file from a complete copy",
                                   code="corrupt_file") from None
        _check_extent(ref)
        return ref

    return rebuild


def _check_extent(ref: TensorRef) -> None:
    """A tensor lies inside its storage: sizes, strides and offset are not negative and its last element is within
    the storage's element count (metadata only; a forged or damaged file would read past it or fail deep in torch)."""
    if not isinstance(ref.storage, StorageRef):
        raise CorruptFileError("a tensor does not refer to a storage record", path=ref.file, code="corrupt_file")
    if ref.offset < 0 or any(s < 0 for s in ref.shape) or any(st < 0 for st in ref.stride) \
            or len(ref.stride) != len(ref.shape):
        raise CorruptFileError(f"a tensor has a negative or malformed size {ref.shape} / stride {ref.stride} / offset "
                               f"{ref.offset}", path=ref.file, fix="restore the file from a complete copy",
                               code="corrupt_file")
    if ref.numel == 0:
        return
    last = ref.offset + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride, strict=True))
    if last >= ref.storage.numel:
        raise CorruptFileError(
            f"a tensor of shape {ref.shape} (offset {ref.offset}, stride {ref.stride}) reaches element {last:,} of "
            f"storage {ref.storage.key}, which holds {ref.storage.numel:,}: its size exceeds its storage",
            path=ref.file, fix="the file is damaged or forged: restore it from a complete copy", code="corrupt_file")


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *args):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    """A tensor saved with Python attributes (Megatron's fp32 master copies carry its TP attributes): the tensor; the
    attributes and the type marker are not needed to read or reshard it."""
    return func(*args)


class _TensorType:
    """Stands in for ``torch.Tensor`` as the ``new_type`` argument of ``_rebuild_from_type_v2`` (never called)."""


def _overrides(file: str) -> dict[tuple[str, str], Any]:
    hooks = dict(_static_overrides(dtypes.torch_loaded()))
    hooks[("torch._utils", "_rebuild_tensor_v2")] = hooks[("torch._utils", "_rebuild_tensor")] = \
        _rebuild_tensor_hook(file)
    return hooks


@functools.lru_cache(maxsize=2)
def _static_overrides(torch_loaded: bool) -> dict[tuple[str, str], Any]:
    """The hooks that do not name the file (made once per form of dtype, ``torch_loaded``: torch's, or named ones;
    a torch_dist checkpoint opens one blob per chunk)."""
    hooks: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TensorType,
        ("torch.nn.parameter", "Parameter"): lambda data=None, requires_grad=True: data,
    }
    for name, dtype_name in dtypes.STORAGE_DTYPES.items():
        hooks[("torch", name)] = hooks[("torch.storage", name)] = StorageType(dtypes.dtype(dtype_name))
    return hooks


# the pickle bytes of a file that held one tensor -> that tensor's ref (a torch_dist checkpoint's chunks of one shape
# pickle the same bytes: a hit skips the unpickler; the storage record is still checked against each file)
# (keyed with whether torch is loaded: its dtypes are torch's then, named ones before)
_ONE_TENSOR: dict[tuple[bool, bytes], TensorRef] = {}


class _MappedWindow(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a mapped file, as a read-only file of its own (a torch_dist ``.distcp``
    file holds one ``torch.save`` blob per chunk): reads are slices of the mapping, no system calls."""

    def __init__(self, mapping: mmap.mmap, start: int, length: int) -> None:
        super().__init__()
        self._map, self._start, self._length, self._pos = mapping, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._length, self._pos + size)
        if end <= self._pos:
            return b""
        data = self._map[self._start + self._pos: self._start + end]
        self._pos = end
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def _open_checked(path: str) -> tuple[Any, int]:
    """``path`` opened for reading, with its size: a regular, non-empty, readable file, or a clear error."""
    require_regular_file(path)
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise PreflightError(f"cannot read the file ({exc.strerror})", path=path,
                             fix="check that it exists and that this user can read it", code="unreadable_file") from None
    if size == 0:
        raise CorruptFileError("the file is empty (0 bytes); the save that wrote it was interrupted",
                               path=path, fix="load an earlier iteration with --ckpt-step, or re-save it",
                               code="empty_file")
    try:
        return open(path, "rb"), size
    except OSError as exc:
        raise PreflightError(f"cannot open the file ({exc.strerror})", path=path,
                             fix="check the file's permissions", code="unreadable_file") from None


def map_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file mapped copy-on-write (the file is never written; pages are read on access), after the checks
    every open makes. Shared by the :class:`TorchFile` windows of its blobs (a torch_dist ``.distcp`` file)."""
    fh, _ = _open_checked(os.fspath(path))
    with fh:
        try:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise PreflightError(f"cannot map the file ({exc})", path=os.fspath(path),
                                 fix="check that it is a regular file on a filesystem that supports mmap",
                                 code="unreadable_file") from None


class TorchFile:
    """An open ``torch.save`` zip file: metadata via :meth:`load_metadata`, tensors via :meth:`tensor`. With
    ``window=(start, length)``, the zip file is that byte range of ``path``, read through ``mapping`` (the file's
    :func:`map_file`: one mapping shared by all the blobs of a ``.distcp`` file) or a mapping of its own."""

    def __init__(self, path: str | os.PathLike, *, trust: bool = False, window: tuple[int, int] | None = None,
                 mapping: mmap.mmap | None = None, check_crc: bool = True) -> None:
        self.path = os.fspath(path)
        self.trust = trust
        self.check_crc = check_crc  # each storage record's CRC-32, on its first read (:meth:`tensor`)
        self._window = window
        self._zip: zipfile.ZipFile | None = None
        self._mmap: mmap.mmap | None = mapping  # with a window: the file's mapping (map_file), maybe shared
        self._fh: Any = None
        self._archive = ""
        self._offsets: dict[str, tuple[int, int]] = {}
        self._records: dict[str, Record] = {}
        self._crc_checked: set[str] = set()  # storage records whose bytes matched their CRC-32
        self._crc_chain: dict[str, tuple[int, int]] = {}  # record -> (bytes read in order so far, their CRC-32)
        # whether mapped pages may have been read since the last release_pages: set when a view or a mapped read is
        # made (a view made before a release and read after it keeps its pages until something sets it again)
        self._touched = True
        self._open()

    # -- opening -------------------------------------------------------------------------------------------------
    def _open(self) -> None:
        self._base = 0
        if self._window is not None:  # one blob of a bigger file: read through the file's mapping
            start, length = self._window
            if self._mmap is None:
                self._mmap = map_file(self.path)
            size = len(self._mmap)
            if start < 0 or length <= 0 or start + length > size:
                self.close()
                raise CorruptFileError(f"bytes {start:,}..{start + length:,} are listed in the metadata but the file has "
                                       f"{size:,} (truncated)", path=self.path, code="corrupt_file",
                                       fix="restore the file from a complete copy")
            self._base, size = start, length
            self._fh = _MappedWindow(self._mmap, start, length)
        else:
            self._fh, size = _open_checked(self.path)
        records = read_directory(self._read_at, size)
        if records is None:  # not the plain layout torch.save writes: zipfile reads it, or says what is wrong
            records = self._zipfile_records()
        self._records = records
        pkl = [n for n in records if n.endswith("/data.pkl") or n == "data.pkl"]
        if not pkl:
            self.close()
            raise CorruptFileError("the zip file has no data.pkl record, so it is not a torch checkpoint",
                                   path=self.path, fix="point at the Megatron checkpoint directory", code="corrupt_file")
        self._archive = pkl[0][: -len("data.pkl")]
        self._size = size

    def _read_at(self, offset: int, n: int) -> bytes:
        assert self._fh is not None
        if self._window is None:  # a positional read: n bytes, not a buffer refill after a seek; thread-safe
            return os.pread(self._fh.fileno(), n, offset) if n > 0 else b""
        self._touched = True  # (a window reads through the mapping)
        self._fh.seek(offset)
        return self._fh.read(n)

    def _zipfile_records(self) -> dict[str, Record]:
        """The records as :mod:`zipfile` reads them (a layout :func:`read_directory` leaves to it), or a clear
        error."""
        assert self._fh is not None
        import zipfile  # deferred: torch.save's own layout never needs it

        try:
            self._zip = zipfile.ZipFile(self._fh)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            self._fh.seek(0)
            head = self._fh.read(2)
            self.close()
            if head[:1] == b"\x80":
                msg = ("this is an old (pre-zip, torch < 1.6) torch file, or a truncated one; "
                       "its metadata cannot be read without loading all of it")
            else:
                msg = "this is not a torch file, or it is truncated or corrupt (no zip directory at its end)"
            raise CorruptFileError(msg, path=self.path,
                                   fix="restore the file from a complete copy, or load an earlier iteration with --ckpt-step",
                                   code="corrupt_file") from None
        return {i.filename: Record(i.filename, i.header_offset, i.compress_type, i.compress_size, i.file_size, i.CRC)
                for i in self._zip.infolist()}

    def close(self) -> None:
        for obj in (self._zip, self._fh):
            try:
                if obj is not None:
                    obj.close()
            except Exception:
                pass
        self._zip = None
        self._fh = None
        # An mmap with live tensor views cannot be closed; it is released when those tensors are.
        self._mmap = None

    def __enter__(self) -> "TorchFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- metadata ------------------------------------------------------------------------------------------------
    def load_metadata(self) -> Any:
        """The unpickled object tree, with :class:`TensorRef` in place of every tensor. Reads only ``data.pkl``."""
        data = self._record_bytes(self._archive + "data.pkl")

        def persistent_load(pid: Any) -> Any:
            if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
                raise CorruptFileError(f"unexpected persistent id {pid!r}", path=self.path, code="corrupt_file")
            _, stype, key, _location, numel = pid[:5]
            dtype = stype.dtype if isinstance(stype, StorageType) else dtypes.dtype("uint8")
            try:
                numel = int(numel)
            except (TypeError, ValueError):
                raise CorruptFileError(f"storage {key!r} has a non-integer size {numel!r}", path=self.path,
                                       code="corrupt_file") from None
            return self._storage(StorageRef(str(key), dtype, numel))

        if not self.trust:  # a torch_dist chunk blob: its pickle is the same bytes as many others' (same shape)
            known = _ONE_TENSOR.get((dtypes.torch_loaded(), data))
            if known is not None:
                return TensorRef(self.path, self._storage(known.storage), known.offset, known.shape, known.stride)
        try:
            out = bounded_load(data, source=self.path, overrides=_overrides(self.path),
                               persistent_load=persistent_load, trust=self.trust)
        except PreflightError:
            raise
        except Exception as exc:  # malformed pickle stream
            raise CorruptFileError(f"its pickle is malformed ({type(exc).__name__}: {exc})", path=self.path,
                                   fix="restore the file from a complete copy", code="corrupt_file") from None
        if type(out) is TensorRef and not self.trust:
            if len(_ONE_TENSOR) >= 1024:
                _ONE_TENSOR.clear()
            _ONE_TENSOR[(dtypes.torch_loaded(), data)] = out
        return out

    def _storage(self, ref: StorageRef) -> StorageRef:
        """``ref`` once its record is in this zip file and holds its elements (else a clear error)."""
        info = self._records.get(f"{self._archive}data/{ref.key}")
        if info is None:
            raise CorruptFileError(f"storage record data/{ref.key} is missing from the zip file", path=self.path,
                                   fix="restore the file from a complete copy", code="corrupt_file")
        if ref.numel < 0 or info.file_size < ref.numel * ref.dtype.itemsize:
            raise CorruptFileError(
                f"storage data/{ref.key} should hold {ref.numel:,} {ref.dtype} elements "
                f"({ref.numel * ref.dtype.itemsize:,} bytes) but its record has {info.file_size:,} bytes", path=self.path,
                fix="restore the file from a complete copy", code="corrupt_file")
        return ref

    # -- tensor data ---------------------------------------------------------------------------------------------
    def _record_offset(self, key: str) -> tuple[int, int]:
        if key in self._offsets:
            return self._offsets[key]
        name = f"{self._archive}data/{key}"
        info = self._records.get(name)
        if info is None:
            raise CorruptFileError(f"storage record {name} is missing", path=self.path, code="corrupt_file")
        if info.compress_type != _STORED:
            raise CorruptFileError(f"storage record {name} is compressed", path=self.path, code="corrupt_file")
        self._offsets[key] = (self._data_start(info), info.file_size)
        return self._offsets[key]

    def _data_start(self, info: Record) -> int:
        """Where the bytes of a stored record begin (after its local header), checked to lie inside the file."""
        raw_name = info.name.encode("utf-8")
        header = self._read_at(info.header_offset, 30 + len(raw_name))
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CorruptFileError(f"bad zip header for {info.name}", path=self.path, code="corrupt_file")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        if info.name.isascii() and (name_len != len(raw_name) or header[30:] != raw_name):
            raise CorruptFileError(f"the zip directory's entry for {info.name} points at another record's header",
                                   path=self.path, code="corrupt_file", fix="restore the file from a complete copy")
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.compress_size > self._size:
            raise CorruptFileError(f"record {info.name} runs past the end of the file (truncated)",
                                   path=self.path, code="corrupt_file", fix="restore the file from a complete copy")
        return start

    def _record_bytes(self, name: str) -> bytes:
        """A small record's bytes (``data.pkl``), checked against the CRC-32 the directory holds for it."""
        info = self._records[name]
        if info.compress_type != _STORED:  # torch.save stores; another writer may have compressed it
            import zipfile  # deferred: torch.save's own layout never needs it

            try:
                if self._zip is None:
                    self._zip = zipfile.ZipFile(self._fh)
                return self._zip.read(name)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
                raise CorruptFileError(f"cannot read its {name} record ({exc})", path=self.path,
                                       fix="restore the file from a complete copy", code="corrupt_file") from None
        data = self._read_at(self._data_start(info), info.file_size)
        if len(data) != info.file_size or crc32(data) != info.crc:
            raise CorruptFileError(f"its {name} record does not match the checksum in the zip directory (a damaged "
                                   f"or partly written file)", path=self.path,
                                   fix="restore the file from a complete copy", code="corrupt_file")
        return data

    def release_pages(self) -> None:
        """Drop the mapped pages read so far from this process's memory (they are re-read from the file if needed).
        Keeps the resident set at about one tensor while streaming through a big shard."""
        if self._mmap is None or not self._touched:  # (rows read with pread touch no mapped page: a streaming
            return  # writer asks after every piece, and each release walks the whole mapping)
        self._touched = False
        if self._window is None:
            release_mapped(self._mmap, 0, len(self._mmap))
        else:  # a window of a big file (a torch_dist chunk): only its pages, not the whole mapping's range
            release_mapped(self._mmap, self._base, self._window[1])

    def byte_extent(self, ref: TensorRef) -> tuple[int, int] | None:
        """(offset, pitch): where in :attr:`path` the bytes of ``ref`` begin and the bytes from one of its rows (dim
        0) to the next, when each row is stored contiguously (see :func:`row_pitch`): a reader can ``pread`` any run
        of its rows. None for other strides."""
        pitch = row_pitch(ref.shape, ref.stride)
        if pitch is None or ref.numel == 0:
            return None
        start, nbytes = self._record_offset(ref.storage.key)
        size = ref.dtype.itemsize
        last = ref.offset + (ref.shape[0] - 1) * pitch + math.prod(ref.shape[1:])
        if last * size > nbytes:
            return None  # metadata checks keep a tensor inside its storage: a record shorter than that reads nothing
        return self._base + start + ref.offset * size, pitch * size

    def sample_bytes(self, ref: TensorRef, k: int) -> bytes | None:
        """The bytes of ``ref``'s first, middle and last ``k`` elements (all of them when it has at most ``3 k``), read
        without a tensor (a replica's sampled check: ~10^4 pieces in a large MoE), when it is contiguous; None
        otherwise (and for an empty one). Thread-safe (positional reads), CRC-32 not taken."""
        at = self.byte_extent(ref)
        if at is None:
            return None
        offset, pitch = at
        size = ref.dtype.itemsize
        if ref.shape[0] > 1 and pitch != math.prod(ref.shape[1:]) * size:
            return None  # rows apart: not one run
        n = ref.numel
        if n <= 3 * k:
            return self._read_abs(offset, n * size)
        parts = [self._read_abs(offset + first * size, k * size) for first in (0, n // 2, n - k)]
        return None if None in parts else b"".join(parts)  # type: ignore[arg-type]

    def _read_abs(self, offset: int, n: int) -> bytes | None:
        """``n`` bytes at ``offset`` of :attr:`path` (None when the file ends first)."""
        if self._window is not None:
            assert self._mmap is not None
            self._touched = True
            data = self._mmap[offset:offset + n]
        else:
            assert self._fh is not None
            data = os.pread(self._fh.fileno(), n, offset)
        return data if len(data) == n else None

    def item(self, ref: TensorRef) -> Any:
        """A one-element tensor's value as a Python number, read without torch (a step, a loss scale); ``ref`` itself
        for a bigger tensor or a dtype this does not decode."""
        name = dtypes.name_of(ref.dtype)
        if ref.numel != 1 or name not in dtypes.READABLE:
            return ref
        start, nbytes = self._record_offset(ref.storage.key)
        size = ref.dtype.itemsize
        if (ref.offset + 1) * size > nbytes:
            raise CorruptFileError(f"storage {ref.storage.key} is shorter than its tensor", path=self.path,
                                   code="corrupt_file", fix="restore the file from a complete copy")
        return dtypes.element_value(self._read_at(start + ref.offset * size, size), name)

    def tensor(self, ref: TensorRef, verify: bool = True) -> Any:
        """The tensor ``ref`` points at, as a view of a copy-on-write mmap (lazy: pages are read on access).
        ``verify=False``: its record's CRC-32 is not taken now (a caller that reads a few elements, and checks the
        record later or not at all)."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        dtype = dtypes.to_torch(ref.dtype)
        if ref.numel == 0:
            return torch.empty(ref.shape, dtype=dtype)
        start, nbytes = self._mapped_record(ref, verify)
        flat = torch.frombuffer(self._mmap, dtype=dtype, count=nbytes // dtype.itemsize, offset=self._base + start)
        return flat.as_strided(ref.shape, ref.stride, ref.offset)

    def array(self, ref: TensorRef, verify: bool = True) -> Any:
        """:meth:`tensor` without torch: a numpy view of the mapping whose elements are unsigned integers as wide as
        ``ref``'s (its bytes, not its values: what a copy needs)."""
        import numpy as np  # deferred: numpy only where arrays are made (a verdict loads neither it nor torch)

        elem = dtypes.byte_element(ref.dtype)
        if ref.numel == 0:
            return np.empty(ref.shape, dtype=elem)
        start, nbytes = self._mapped_record(ref, verify)
        return strided_array(self._mmap, self._base + start, nbytes, ref)

    def record_extent(self, key: str) -> tuple[int, int]:
        """(offset in :attr:`path`, bytes) of storage record ``data/<key>``."""
        start, nbytes = self._record_offset(key)
        return self._base + start, nbytes

    def check_record(self, key: str, got: int) -> None:
        """Raise :class:`CorruptFileError` unless ``got`` is the CRC-32 the zip directory holds for record
        ``data/<key>`` (a record read by other means than this file's own)."""
        _start, nbytes = self._record_offset(key)
        self._crc_verdict(key, nbytes, got)

    def _mapped_record(self, ref: TensorRef, verify: bool) -> tuple[int, int]:
        """(start, bytes) of ``ref``'s storage record, the file mapped, the record's CRC-32 checked on its first read
        (``verify``)."""
        start, nbytes = self._record_offset(ref.storage.key)
        self._map()
        if verify and self.check_crc and ref.storage.key not in self._crc_checked:
            self._crc_chain.pop(ref.storage.key, None)
            self._check_crc(ref.storage.key, start, nbytes)
        self._touched = True
        return start, nbytes

    def read_rows(self, ref: TensorRef, row0: int, out: Any, fd: int | None = None) -> int | None:
        """Read rows ``row0 .. row0 + len(out) / row bytes`` (dim 0) of ``ref`` into the writable buffer ``out`` with
        plain file I/O (one ``pread`` on ``fd``, this file's own descriptor by default: no mapping, no page faults,
        the GIL released) when those rows are one contiguous run of the file, and return the CRC-32 of the bytes read
        (a writer of them needs no second pass); None (nothing read) when they are not one run.
        The record's CRC-32 is chained from those of the reads when they go through it in order, and checked once
        its last byte has been read (or by :meth:`finish_crc`, which reads the rest); any other order checks the
        whole record first. A window (a blob of a bigger file) reads only through the file's ``fd``."""
        if fd is None:
            if self._window is not None or self._fh is None:
                return None
            fd = self._fh.fileno()
        at = self.byte_extent(ref)
        if at is None:
            return None
        offset, pitch = at
        row = math.prod(ref.shape[1:]) * ref.dtype.itemsize
        with memoryview(out) as view, view.cast("B") as data:
            n = len(data)
            rows = n // row if row else 0
            if not rows or n % row or row0 < 0 or row0 + rows > ref.shape[0] or (rows > 1 and pitch != row):
                return None  # not whole rows of it, or strided rows (several runs)
            first, done = offset + row0 * pitch, 0
            while done < n:
                got = os.preadv(fd, [data[done:]], first + done)
                if got <= 0:
                    raise CorruptFileError(f"storage record data/{ref.storage.key} ends early (the file is shorter "
                                           "than its zip directory says: truncated)", path=self.path,
                                           code="corrupt_file", fix="restore the file from a complete copy")
                done += got
            value = crc32(data)
            if self.check_crc and ref.storage.key not in self._crc_checked:
                start, nbytes = self._record_offset(ref.storage.key)
                self._chain_crc(ref.storage.key, start, nbytes, first - self._base - start, n, value)
        return value

    def _chain_crc(self, key: str, start: int, nbytes: int, first: int, n: int, piece: int) -> None:
        """Bytes ``first .. first + n`` of a record, whose CRC-32 is ``piece``, were read."""
        at, value = self._crc_chain.get(key, (0, 0))
        if first != at:  # not the next bytes of the record: check it whole now (as a mapped read would)
            self._crc_chain.pop(key, None)
            self._map()
            self._check_crc(key, start, nbytes)
            return
        at, value = at + n, combine(value, piece, n)
        if at < nbytes:
            self._crc_chain[key] = (at, value)
            return
        self._crc_chain.pop(key, None)
        self._crc_verdict(key, nbytes, value)

    def finish_crc(self) -> None:
        """Check the records :meth:`read_rows` read only in part: the CRC-32 over the bytes not read yet, chained to
        the bytes that were (raises :class:`CorruptFileError` on a mismatch)."""
        for key, (at, value) in list(self._crc_chain.items()):
            start, nbytes = self._record_offset(key)
            self._map()
            assert self._mmap is not None
            with memoryview(self._mmap) as whole, whole[self._base + start + at:self._base + start + nbytes] as rest:
                value = crc32(rest, value)
            release_mapped(self._mmap, self._base + start + at, nbytes - at)
            del self._crc_chain[key]
            self._crc_verdict(key, nbytes, value)

    def _map(self) -> None:
        if self._mmap is None:
            assert self._fh is not None
            self._mmap = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_COPY)

    def _crc_verdict(self, key: str, nbytes: int, got: int) -> None:
        problem = self._crc_error(key, nbytes, got)
        if problem is not None:
            raise problem
        self._crc_checked.add(key)

    def _check_crc(self, key: str, start: int, nbytes: int) -> None:
        """The first time a storage record is read: its bytes against the CRC-32 ``torch.save`` stored for it in the
        zip directory (computed over the mapping as it is paged in; nothing copied). A flipped bit on disk or in a
        copy (bit rot) is found here, before any of its values is used."""
        problem = self.crc_problem(key, start, nbytes)
        if problem is not None:
            raise problem
        self._crc_checked.add(key)

    def crc_problem(self, key: str, start: int, nbytes: int) -> CorruptFileError | None:
        """The error a storage record's bytes make against their CRC-32 (None: they match), computed over the
        mapping as it is paged in (nothing copied)."""
        assert self._mmap is not None
        self._touched = True
        with memoryview(self._mmap) as whole, whole[self._base + start:self._base + start + nbytes] as data:
            got = crc32(data)
        return self._crc_error(key, nbytes, got)

    def _crc_error(self, key: str, nbytes: int, got: int) -> CorruptFileError | None:
        name = f"{self._archive}data/{key}"
        want = self._records[name].crc
        if got == want:
            return None
        return CorruptFileError(f"storage record {name} ({nbytes:,} bytes of tensor data) does not match the CRC-32 "
                                f"its zip directory holds ({got:08x}, stored {want:08x}): the file changed after it "
                                "was saved (bit rot, a damaged copy, or an edit)", path=self.path,
                                fix="restore the file from a good copy (or the checkpoint from its source); nothing "
                                    "was written from it", code="corrupt_file")


def strided_array(buffer: Any, start: int, nbytes: int, ref: TensorRef) -> Any:
    """``ref`` as a read-only numpy view of its storage record's ``nbytes`` at ``start`` of ``buffer``: unsigned
    integers as wide as its elements (the extent was checked against the storage when the metadata was read)."""
    import numpy as np  # deferred, as in TorchFile.array

    elem = dtypes.byte_element(ref.dtype)
    size = elem.itemsize
    flat = np.frombuffer(buffer, dtype=elem, count=nbytes // size, offset=start)
    return np.lib.stride_tricks.as_strided(flat[ref.offset:], ref.shape, tuple(st * size for st in ref.stride),
                                           writeable=False)


def release_mapped(mapping: mmap.mmap, start: int, length: int) -> None:
    """``MADV_DONTNEED`` over bytes ``[start, start + length)`` of ``mapping`` (widened to whole pages): its pages
    leave the resident set and are read again from the file on the next access. Called through libc, which releases
    the GIL for the call (unmapping a tensor's pages takes milliseconds: another thread compares meanwhile);
    ``mmap.madvise`` (which holds it) where libc is not reachable. Best effort: a failure leaves the pages mapped."""
    if not hasattr(mmap, "MADV_DONTNEED") or length <= 0:
        return
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(len(mapping), start + length)
    if hi <= lo:
        return
    import ctypes  # deferred: a verdict releases no pages

    from megatron_preflight import libc  # deferred, as ctypes (which it loads)

    if libc.HAS_MADVISE:
        try:
            anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (a transient buffer export)
            base = ctypes.addressof(anchor)
            del anchor
            if libc.madvise(base + lo, hi - lo, mmap.MADV_DONTNEED):
                return
        except (TypeError, ValueError, BufferError):  # a read-only mapping has no writable buffer: below
            pass
    try:  # no libc to call (not Linux / glibc): mmap.madvise, under the GIL
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        pass


def zip_trailer_problem(path: str) -> str | None:
    """Why ``path`` is not a complete zip file, from its last bytes only (the end-of-central-directory record and the
    directory's extent): None when it looks complete. Catches a truncated save without parsing the file."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            tail_len = min(size, 1 << 16)
            fh.seek(size - tail_len)
            tail = fh.read(tail_len)
    except OSError as exc:
        return f"cannot read the file ({exc.strerror})"
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return "the file has no zip directory at its end: it is truncated (an interrupted save) or not a torch file"
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    if cd_offset != 0xFFFFFFFF and cd_offset + cd_size > size - (len(tail) - at):
        return "the file's zip directory points past its end: it is truncated or damaged"
    return None


def read_torch_file(path: str | os.PathLike, *, trust: bool = False) -> Any:
    """Metadata of a torch file (tensors as :class:`TensorRef`)."""
    with TorchFile(path, trust=trust) as f:
        return f.load_metadata()
