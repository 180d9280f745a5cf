"""The tensor table of a Hugging Face model's safetensors files, from their JSON headers only.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}``, offsets relative to the end of the header) and the raw row-major bytes. A sharded model adds
``model.safetensors.index.json`` (``weight_map: name -> file``). Nothing here unpickles or reads a tensor byte.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_preflight import dtypes
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.hf import files
from megatron_preflight.layout.hf.names import INDEX
from megatron_preflight.torch_file import StorageRef, TensorRef, row_major

SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20  # a DeepSeek-V3 shard's header is ~100 kB; anything this large is not a header

# safetensors' dtype names -> torch's
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {k: dtypes.dtype(v).itemsize for k, v in DTYPES.items()}  # safetensors' name -> bytes per element


class SafeTensor(NamedTuple):  # (a tuple: a DeepSeek-V3 dir holds 46k of them, read in well under a second)
    """One tensor of a safetensors file: where its bytes lie (absolute offsets in ``file``)."""

    name: str
    file: str  # file name inside the model dir
    dtype: str  # torch's name (float32, bfloat16, ...)
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class TensorTable:
    """Every tensor of a model dir, the files that hold them and what is wrong with them."""

    tensors: dict[str, SafeTensor] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # file name -> bytes
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)  # (code, path, message, fix)


def read_header(path: str) -> tuple[dict, int, bool]:
    """(the JSON header, the byte offset where tensor data begins, whether its text holds a JSON ``true`` / ``false``)
    of one safetensors file (a regular file only; nesting, size and duplicate names bounded by
    :func:`~.files.parse_json`; a number with a fraction or exponent kept as its text: no shape or offset is one)."""
    fd = files.open_regular(path)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CorruptFileError("the file is shorter than a safetensors header", path=path,
                                   fix="download the file again", code="corrupt_file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CorruptFileError(f"its header claims {n:,} bytes: this is not a safetensors file", path=path,
                                   fix="download the file again", code="corrupt_file")
        raw = os.pread(fd, n, 8)
    except OSError as exc:
        raise CorruptFileError(f"cannot read the file ({exc.strerror})", path=path, fix="check its permissions",
                               code="unreadable_file") from None
    finally:
        os.close(fd)
    if len(raw) < n:
        raise CorruptFileError("the file ends inside its header (truncated)", path=path,
                               fix="download the file again", code="corrupt_file")
    header = files.parse_json(raw, path, "download the file again", counted=("dtype", "shape", "data_offsets"),
                              floats_as_text=True)
    if not isinstance(header, dict):
        raise CorruptFileError("its header is not a JSON object", path=path, fix="download the file again",
                               code="corrupt_file")
    return header, 8 + n, b"true" in raw or b"false" in raw


_new = tuple.__new__  # (a SafeTensor made without the named tuple's own __new__, a Python call: 92k of them)


def _kind(code: Any, shape: tuple) -> tuple[str, int]:
    """(torch's dtype name, bytes) of a header entry's dtype and shape; TypeError / KeyError when they are not a
    safetensors dtype and a shape of non-negative ints."""
    if any(type(d) is not int for d in shape) or (shape and min(shape) < 0):  # (before any product: "2" * 10**12)
        raise TypeError
    return DTYPES[code], math.prod(shape) * ITEMSIZE[code]


def _file_tensors(model_dir: str, name: str, table: TensorTable, named_by: str) -> None:
    path = files.member(model_dir, name, named_by)
    header, base, bools = read_header(path)
    size = os.path.getsize(path)
    table.files[name] = size
    tensors = table.tensors
    # (dtype code, shape) -> checked (dtype, bytes): experts share a few. A shape equal to a checked one is the same
    # shape of ints (a float dim is text here), unless the header holds a bool, equal to 1 or 0: then none is kept
    kinds: dict[tuple, tuple[str, int]] = {}
    los: list[int] = []
    his: list[int] = []
    top = base
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            shape = tuple(info["shape"])
            lo, hi = info["data_offsets"]
            kind = kinds.get((info["dtype"], shape))
            if kind is None:
                kind = _kind(info["dtype"], shape)
                if not bools:
                    kinds[(info["dtype"], shape)] = kind
            if type(lo) is not int or type(hi) is not int:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(f"tensor {key!r}: its header entry is malformed ({info!r:.200})", path=path,
                                   fix="download the file again", code="corrupt_file") from None
        if hi - lo != kind[1] or lo < 0:
            raise CorruptFileError(f"tensor {key!r}: {hi - lo} bytes for shape {list(shape)} of {info['dtype']}",
                                   path=path, fix="download the file again", code="corrupt_file")
        t = _new(SafeTensor, (key, name, kind[0], shape, base + lo, base + hi))
        if tensors.setdefault(key, t) is not t:
            raise CorruptFileError(f"tensor {key!r} is defined in this file and in {tensors[key].file}: which one is "
                                   "the model's is not known", path=path, fix="download the model again",
                                   code="corrupt_file")
        if hi > lo:
            los.append(lo)
            his.append(hi)
            if base + hi > top:
                top = base + hi
    spans = sorted(zip(los, his, strict=True))  # (C-level passes: a DeepSeek-V3 dir has 92k entries)
    if any(map(operator.lt, [lo for lo, _ in spans[1:]], [hi for _, hi in spans[:-1]])):
        _overlap(header, path)
    if top > size:
        cut = [k for k, t in tensors.items() if t.file == name and t.end > size]
        table.problems.append(("truncated_file", path, f"the file is truncated: it has {size:,} bytes, its header "
                               f"places tensors up to byte {top:,}; {len(cut)} tensor(s) cut: "
                               + ", ".join(repr(k) for k in cut[:8]) + (", ..." if len(cut) > 8 else ""),
                               "download the file again"))


def _overlap(header: dict, path: str) -> None:
    """Raises naming two tensors of ``header`` whose bytes overlap (the table found that some do)."""
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], key) for key, info in header.items()
                   if key != "__metadata__" and info["data_offsets"][1] > info["data_offsets"][0])
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise CorruptFileError(f"tensors {a!r} and {b!r} share bytes (their data_offsets overlap): writing one "
                                   "would change the other", path=path, fix="download the file again",
                                   code="corrupt_file")


def tensor_table(model_dir: str) -> TensorTable:
    """The tensor table of ``model_dir``: from ``model.safetensors.index.json`` (every file it names) or from the
    ``*.safetensors`` files present. A file the index names that is missing, or a tensor the index places in a file
    that does not hold it, is a problem."""
    table = TensorTable()
    index_path = os.path.join(model_dir, INDEX)
    if os.path.lexists(index_path):
        fix = "download model.safetensors.index.json again"
        index = files.load_json(files.member(model_dir, INDEX, model_dir), fix)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or set(map(type, weight_map.values())) - {str}:  # (C-level: 92k names)
            raise CorruptFileError("the index is not a JSON object with a weight_map of tensor -> file name",
                                   path=index_path, fix=fix, code="corrupt_file")
        names = sorted(set(weight_map.values()))
        for name in names:
            path = files.member(model_dir, name, index_path)
            if not os.path.lexists(path):
                count = sum(1 for v in weight_map.values() if v == name)
                table.problems.append(("missing_file", path,
                                       f"the index places {count} tensor(s) in this file, which is missing",
                                       "download the missing shard (or the whole model) again"))
                continue
            _file_tensors(model_dir, name, table, index_path)
        absent = weight_map.keys() - table.tensors.keys()  # (C speed: a DeepSeek-V3's index names 92k tensors)
        for key in [k for k in weight_map if k in absent] if absent else ():  # (in the index's order)
            name = weight_map[key]
            if name in table.files:
                table.problems.append(("missing_tensor", os.path.join(model_dir, name),
                                       f"the index places tensor {key!r} in this file, which does not hold it",
                                       "download the model again"))
        return table
    for name in sorted(e for e in os.listdir(model_dir) if e.endswith(".safetensors")):
        _file_tensors(model_dir, name, table, model_dir)
    return table


class Run(NamedTuple):
    """One contiguous byte run of a safetensors file: ``nbytes`` from byte ``start`` of ``file`` land at byte
    ``dst`` of the tensor a :class:`SafeRef` describes."""

    file: str
    start: int
    nbytes: int
    dst: int


@dataclass(frozen=True, repr=False)
class SafeRef(TensorRef):
    """A tensor made of row blocks of safetensors tensors, each a contiguous run of bytes: rows of a row-major
    tensor stacked along dim 0 are its bytes concatenated (read by :mod:`megatron_preflight.reshard.sources.hf`)."""

    runs: tuple[Run, ...] = ()
    # computed rows, then ``runs`` is empty: FP8 rows dequantized into this tensor's dtype (layout/hf/quant.py's QRun),
    # rows of stacked experts (layout/hf/stacked.py's XRun: strided, transposed, or dequantized from MXFP4)
    quant: tuple[Any, ...] = ()
    add: float = 0.0  # added to every value read (families/rows.Mapping.add): the values are computed, not copied

    def __repr__(self) -> str:
        if self.quant:
            return f"SafeRef({tuple(self.shape)}, {self.dtype} from {len(self.quant)} computed run(s))"
        return f"SafeRef({tuple(self.shape)}, {self.dtype}, {len(self.runs)} run(s))"

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    def window(self, start: int, shape: tuple[int, ...]) -> SafeRef:
        """Elements ``start ..`` of this tensor (flattened) as a contiguous tensor of ``shape``."""
        if self.quant or self.add:  # (a flat window of an HF weight: never asked; a model dir has no optimizer state)
            raise ValueError("a window of a computed tensor")
        item = self.dtype.itemsize
        lo, hi = start * item, (start + math.prod(shape)) * item
        runs = []
        for r in self.runs:
            a, b = max(lo, r.dst), min(hi, r.dst + r.nbytes)
            if a < b:
                runs.append(Run(r.file, r.start + a - r.dst, b - a, a - lo))
        n = math.prod(shape)
        return SafeRef(self.file, StorageRef(self.storage.key, self.dtype, n), 0, tuple(shape),
                       row_major(tuple(shape)), runs=tuple(runs))


@functools.cache
def _dtype(name: str) -> Any:
    return dtypes.dtype(name)


_row_major = functools.lru_cache(maxsize=4096)(row_major)  # (a model has a few hundred shapes, 31k tensors)


def safe_ref(key: str, dtype: str, shape: tuple[int, ...], runs: tuple[Run, ...], quant: tuple[Any, ...] = (),
             add: float = 0.0) -> SafeRef:
    """The ref of a tensor of ``shape`` made of ``runs`` (or of dequantized FP8 ``quant`` runs)."""
    dt = _dtype(dtype)
    shape = tuple(shape)
    n = math.prod(shape)
    first = runs[0].file if runs else quant[0].file if quant else ""
    # (the frozen dataclasses' __init__ sets each field through object.__setattr__: a DeepSeek-V3 builds 31k refs,
    # so each is given its filled __dict__, every field in it)
    storage = _make(StorageRef)
    _set(storage, "__dict__", {"key": key, "dtype": dt, "numel": n})
    ref = _make(SafeRef)
    _set(ref, "__dict__", {"file": first, "storage": storage, "offset": 0, "shape": shape, "stride": _row_major(shape),
                           "runs": runs, "quant": quant, "add": add})
    return ref


_make, _set = object.__new__, object.__setattr__
