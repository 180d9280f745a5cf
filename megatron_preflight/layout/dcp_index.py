"""What a verdict needs from a DCP ``.metadata``, gathered in the pass that bounds it.

A torch_dist ``.metadata`` is one pickle of every tensor's chunks and every item's place in the data files: for a
1 T-parameter MoE ~10^5 records and 5 * 10^6 opcodes. Once unpickled, it must be proved bounded (no walk over it may
expand: :func:`megatron_preflight.pickle_limits.check_shape`), and the verdict reads from it the data files' ends
(a file shorter than its items is truncated), whether each tensor's chunks tile its global shape and can be found,
and each tensor's global shape and dtype. Each of those was one more pass over ~10^5 records scattered in memory.

Here one pass gathers the rows those facts are computed from, checking on the way that every record has the shape
torch writes — records of the known kinds, their known fields, strings, ints and tuples of at most
:data:`MAX_DIMS` ints — which proves the bound itself: such a tree nests a fixed number of levels, and the
references a walk over it makes (shared records and shapes counted at each reference) are counted on the way against
the generic walk's limit. The other fields (planner data, storage meta, Megatron's own data) go through the generic walk.
A ``.metadata`` that departs from that shape anywhere is walked whole by the generic walk and its rows gathered
leniently (``getattr``, ``int``), as before: the bound never depends on the file being well formed, and the facts
are computed from the rows in one place either way.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight import dtypes
from megatron_preflight.pickle_limits import EXPANSION_FACTOR, EXPANSION_FLOOR, check_shape
from megatron_preflight.placeholders import Placeholder, Record, record_class

_DCP = "torch.distributed.checkpoint"
_INDEX = record_class(f"{_DCP}.metadata", "MetadataIndex")
_STORAGE = record_class(f"{_DCP}.filesystem", "_StorageInfo")
_TENSOR = record_class(f"{_DCP}.metadata", "TensorStorageMetadata")
_BYTES = record_class(f"{_DCP}.metadata", "BytesStorageMetadata")
_CHUNK = record_class(f"{_DCP}.metadata", "ChunkStorageMetadata")
_PROPERTIES = record_class(f"{_DCP}.metadata", "TensorProperties")

# each kind's fields (a subset may be present: dataclass defaults are not always pickled)
_INDEX_FIELDS = frozenset({"fqn", "offset", "index"})
_STORAGE_FIELDS = frozenset({"relative_path", "offset", "length", "transform_descriptors"})
_TENSOR_FIELDS = frozenset({"properties", "size", "chunks"})
_CHUNK_FIELDS = frozenset({"offsets", "sizes"})
_PROPERTIES_FIELDS = frozenset({"dtype", "layout", "requires_grad", "memory_format", "pin_memory"})
_TABLES = ("state_dict_metadata", "storage_data")
_ATOMS = frozenset((str, bytes, int, float, bool, type(None)))
MAX_DIMS = 64  # a tensor's rank (torch allows 64 dims)
MAX_CHUNK_PROBLEMS = 5

Shape = tuple[int, ...]


@dataclass
class TensorRow:
    """One tensor of the metadata: its global shape, dtype and chunks (offsets, sizes)."""

    shape: Shape
    dtype: str
    chunks: list[tuple[Shape, Shape]] | None  # None: none recorded (not checked)


class StoredItem(NamedTuple):
    """Where a bytes item (a sharded object: extra state, common state, ...) lies: as torch's ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int


@dataclass
class DcpFacts:
    """What a verdict reads from a ``.metadata`` (see the module doc)."""

    tensors: dict[str, tuple[Shape, str]] = field(default_factory=dict)  # fqn -> (global shape, dtype)
    file_ends: dict[str, int] = field(default_factory=dict)  # data file -> the end of its last item
    chunk_problems: list[tuple[str, str]] = field(default_factory=list)  # (fqn, why), the first few
    unreadable: list[str] = field(default_factory=list)  # entries not of the shape torch writes (lenient read)
    order: list[str] = field(default_factory=list)  # every entry of the tensor table (tensors and bytes items)
    objects: dict[str, StoredItem] = field(default_factory=dict)  # bytes item -> where it lies


class _Departs(Exception):
    """The metadata departs from the shape torch writes: walk it whole, gather leniently."""


def bounded_facts(obj: Any, stream_bytes: int, source: str) -> DcpFacts:
    """Prove ``obj`` (a ``.metadata`` just unpickled) bounded as :func:`check_shape` does, and gather its facts."""
    try:
        fields = _fields(obj)
        storage, tensors, rest, order = _strict_rows(fields, EXPANSION_FACTOR * stream_bytes + EXPANSION_FLOOR)
    except _Departs:
        check_shape(obj, stream_bytes, source)
        return _facts(*_lenient_rows(obj))
    others = [v for k, v in fields.items() if k not in _TABLES]
    check_shape([*fields, *others, *rest], stream_bytes, source)
    return _facts(storage, tensors, [], order)


def _fields(obj: Any) -> dict[Any, Any]:
    """The metadata's fields: a ``Metadata`` record's, or those of Megatron's own subclass (an opaque placeholder)."""
    if isinstance(obj, Record):
        return obj.__dict__
    if isinstance(obj, Placeholder) and type(obj._state) is dict and not obj._args and not obj._new_args:
        return obj._state
    raise _Departs


StorageRow = tuple[str, "Shape | None", str, int, int]  # fqn, chunk offset (None: a bytes item), file, offset, length


def _strict_rows(fields: dict[Any, Any], limit: float = math.inf,
                 ) -> tuple[list[StorageRow], dict[str, TensorRow], list[Any], list[str]]:
    """The rows of both tables, each record checked to have torch's shape on the way (else :class:`_Departs`), the
    values left for the generic walk, and the tensor table's order. A chunk list shared by several tensors is the
    amplifier this shape allows (torch never writes one): the pass departs at the first, and the generic walk counts
    it at each reference.
    Records and shapes shared within the tables expand a walk by a bounded factor (a shape holds at most
    :data:`MAX_DIMS` ints); the references a walk makes are counted against ``limit`` all the same, and the pass
    departs past it (the generic walk then refuses the file, as it would have)."""
    storage, tensors = fields.get("storage_data"), fields.get("state_dict_metadata")
    if type(storage) is not dict or type(tensors) is not dict:
        raise _Departs
    shape_kinds = (tuple, sys.modules["torch"].Size) if dtypes.torch_loaded() else (tuple,)

    def shape(value: Any) -> Shape:  # a tuple of ints: sum() of anything else is not an int, or raises
        if type(value) not in shape_kinds or len(value) > MAX_DIMS or type(sum(value)) is not int:
            raise _Departs
        return value

    rest: list[Any] = []
    rows: list[StorageRow] = []
    order: list[str] = []
    left = limit - 16 * len(storage)  # a storage entry: two records of at most four fields (names and values)
    try:
        for key, info in storage.items():
            if type(key) is not _INDEX or type(info) is not _STORAGE:
                raise _Departs
            k, v = key.__dict__, info.__dict__
            if not (k.keys() <= _INDEX_FIELDS and v.keys() <= _STORAGE_FIELDS):
                raise _Departs
            fqn, offset, index = k.get("fqn"), k.get("offset"), k.get("index")
            path, start, length = v.get("relative_path"), v.get("offset"), v.get("length")
            if not (type(fqn) is str and type(path) is str and type(start) is int and type(length) is int
                    and (index is None or type(index) is int)):
                raise _Departs
            if offset is not None:
                left -= len(shape(offset))
            rows.append((fqn, offset, path, start, length))
            if v.get("transform_descriptors") is not None:
                rest.append(v["transform_descriptors"])
        described: dict[str, TensorRow] = {}
        small: dict[int, Any] = {}  # the properties' values that are not atoms (dtypes, layouts), each once
        lists: set[int] = set()
        for fqn, meta in tensors.items():
            kind = type(meta)
            if type(fqn) is not str or kind is not _TENSOR:
                if kind is _BYTES and type(fqn) is str and not meta.__dict__:
                    order.append(fqn)
                    continue
                raise _Departs
            order.append(fqn)
            d = meta.__dict__
            chunks, props = d.get("chunks"), d.get("properties")
            if not (d.keys() <= _TENSOR_FIELDS and type(chunks) is list and type(props) is _PROPERTIES
                    and props.__dict__.keys() <= _PROPERTIES_FIELDS):
                raise _Departs
            if id(chunks) in lists:  # torch never shares one: a shared list multiplies every walk over it
                raise _Departs
            lists.add(id(chunks))
            pairs = []
            for chunk in chunks:
                c = chunk.__dict__ if type(chunk) is _CHUNK else None
                if c is None or not c.keys() <= _CHUNK_FIELDS:
                    raise _Departs
                offsets, sizes = shape(c.get("offsets")), shape(c.get("sizes"))
                left -= 6 + len(offsets) + len(sizes)
                if left < 0:
                    raise _Departs
                pairs.append((offsets, sizes))
            for value in props.__dict__.values():
                if type(value) not in _ATOMS:
                    small[id(value)] = value
            described[fqn] = TensorRow(shape(d.get("size")), str(props.__dict__.get("dtype")), pairs)
    except (TypeError, AttributeError):  # sum() over a non-number, a record kind without a dict
        raise _Departs from None
    if not all(map(_small, small.values())) or left < 0:
        raise _Departs
    return rows, described, rest, order


def _small(value: Any) -> bool:
    """An inert value of a few atoms: a dtype by name, torch's own value types, a placeholder of atom arguments."""
    if isinstance(value, dtypes.DType):
        return True
    if isinstance(value, Placeholder):
        return (value._state is None and not value._kwargs and
                all(type(a) in _ATOMS for a in (*value._args, *value._new_args)))
    return type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "layout", "memory_format")


def _lenient_rows(md: Any) -> tuple[list[StorageRow], dict[str, TensorRow], list[str], list[str]]:
    """The rows of a metadata that departs from torch's shape (bounded by the generic walk already): fields read by
    name, numbers converted; an entry that cannot be read is named instead."""
    if isinstance(md, Placeholder) and isinstance(md._state, dict):
        md = type("Fields", (), dict(md._state))
    rows: list[StorageRow] = []
    unreadable: list[str] = []
    storage = getattr(md, "storage_data", None)
    for key, info in (storage.items() if isinstance(storage, dict) else ()):
        try:
            offset = getattr(key, "offset", None)
            rows.append((getattr(key, "fqn", None), None if offset is None else tuple(map(int, offset)),
                         info.relative_path, int(info.offset), int(info.length)))
        except (AttributeError, TypeError, ValueError):
            unreadable.append(f"the storage entry of {getattr(key, 'fqn', key)!r}")
    described: dict[str, TensorRow] = {}
    order: list[str] = []
    tensors = getattr(md, "state_dict_metadata", None)
    for fqn, meta in (tensors.items() if isinstance(tensors, dict) else ()):
        if not isinstance(fqn, str):
            unreadable.append(f"the tensor table's key {fqn!r}")
            continue
        order.append(fqn)
        size, chunks = getattr(meta, "size", None), getattr(meta, "chunks", None)
        if size is None:
            continue
        try:
            pairs = None if chunks is None else [(tuple(map(int, c.offsets)), tuple(map(int, c.sizes))) for c in chunks]
            described[fqn] = TensorRow(tuple(map(int, size)), str(meta.properties.dtype), pairs)
        except (AttributeError, TypeError, ValueError):
            unreadable.append(f"tensor {fqn!r}")
    return rows, described, unreadable, order


def _facts(storage: list[StorageRow], tensors: dict[str, TensorRow], unreadable: list[str],
           order: list[str]) -> DcpFacts:
    """The facts from the rows: data files' ends, each tensor's chunks checked (each inside the global shape, found in
    the storage index, their volumes adding up to the whole tensor: overlapping chunks that also leave a gap of the
    same size are not told apart from a clean tiling; torch's own check is no stronger)."""
    facts = DcpFacts(unreadable=unreadable, order=order)
    ends, objects = facts.file_ends, facts.objects
    for fqn, offset, path, start, length in storage:
        end = start + length
        if end > ends.get(path, 0):
            ends[path] = end
        if offset is None and isinstance(fqn, str):
            objects[fqn] = StoredItem(path, start, length)
    stored = {(fqn, offset) for fqn, offset, _path, _start, _length in storage if offset is not None}
    for fqn, row in tensors.items():
        facts.tensors[fqn] = (tuple(row.shape), row.dtype)
        if len(facts.chunk_problems) < MAX_CHUNK_PROBLEMS:
            why = _chunk_problem(fqn, row, stored)
            if why:
                facts.chunk_problems.append((fqn, why))
    return facts


def _chunk_problem(fqn: str, row: TensorRow, stored: set[tuple[str, Shape]]) -> str:
    if row.chunks is None:
        return ""
    shape, dims = row.shape, len(row.shape)
    covered = 0
    for off, sz in row.chunks:
        inside = len(off) == len(sz) == dims
        for o, n, g in zip(off, sz, shape):  # noqa: B905 - the lengths are checked first
            if o < 0 or n < 0 or o + n > g:
                inside = False
        if not inside:
            return f"a chunk at offset {tuple(off)} of size {tuple(sz)} lies outside its global shape {tuple(shape)}"
        if stored and (fqn, off) not in stored:
            return f"the chunk at offset {tuple(off)} has no entry in the storage index (its bytes cannot be found)"
        covered += math.prod(sz)
    total = math.prod(shape)
    return f"its chunks cover {covered:,} of its {total:,} elements" if covered != total else ""
