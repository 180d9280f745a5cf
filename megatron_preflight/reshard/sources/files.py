"""The source of one checkpoint, read on demand: the one place a piece reference is turned into a tensor.

Every source format reads the references it makes through a :class:`Reader` (legacy: :class:`LegacyReader` for a
:class:`~megatron_preflight.torch_file.TensorRef`; torch_dist: :class:`DistReader` for a :class:`RegionRef`).
:data:`READERS` maps each reference type to its reader; a new format adds its reference type, its reader and one row.
The types are named there, not imported: a format's reader loads when a reference of its own is met (a legacy
verdict never imports torch_dist's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from megatron_preflight import dtypes
from megatron_preflight.held_tensor import HeldTensor
from megatron_preflight.reshard.sources.legacy import LegacyReader
from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import map_leaves

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


class Reader(Protocol):
    """What a source format provides: tensors for its references (or their rows read into a buffer), pages dropped, files
    closed."""

    def tensor(self, shard: str, ref: Any, verify: bool = True) -> torch.Tensor: ...

    def rows(self, shard: str, ref: Any, first: int, n: int) -> torch.Tensor | None: ...

    def item(self, shard: str, ref: Any) -> Any: ...

    def sample_bytes(self, shard: str, ref: Any, k: int) -> bytes | None: ...

    def extent(self, shard: str, ref: Any) -> tuple[str, int, int] | None: ...

    def read_rows(self, shard: str, ref: Any, row0: int, out: Any) -> int | None: ...

    def finish(self) -> None: ...

    def release(self, shard: str, ref: Any) -> None: ...

    def release_pages(self) -> None: ...

    def close(self) -> None: ...


def _dist_reader(iter_dir: str, trust: bool, crc: bool) -> Reader:
    # deferred: for a torch_dist (or fsdp_dtensor) source only
    from megatron_preflight.reshard.sources.torch_dist_reader import dist_reader

    return dist_reader(iter_dir, trust=trust, crc=crc)


def _hf_reader(iter_dir: str, trust: bool, crc: bool) -> Reader:
    from megatron_preflight.reshard.sources.hf import HfReader  # deferred: for a Hugging Face source only

    return HfReader(iter_dir)


def _name(kind: type) -> tuple[str, str]:
    return kind.__module__, kind.__qualname__


# reference type (module, name) -> how to open its format's reader (iter dir, trust, crc); a reference's own type is
# looked up first, then its bases
READERS: dict[tuple[str, str], Callable[[str, bool, bool], Reader]] = {
    ("megatron_preflight.reshard.sources.torch_dist_reader", "RegionRef"): _dist_reader,
    ("megatron_preflight.layout.hf.safetensors", "SafeRef"): _hf_reader,
    _name(TensorRef): lambda iter_dir, trust, crc: LegacyReader(iter_dir, trust, crc=crc),
}


class SourceFiles:
    """The readers of one source iteration dir, opened on first use; counts the bytes materialised here."""

    def __init__(self, iter_dir: str, trust: bool = False, crc: bool = True) -> None:
        self.iter_dir = iter_dir
        self.trust = trust
        # each storage record's CRC-32 on its first read (torch_file.TorchFile), by every reader but diff (where a
        # changed byte is a difference it reports) and the metadata-only paths
        self.crc = crc
        self._readers: dict[tuple[str, str], Reader] = {}
        self.bytes_read = 0

    def reader(self, ref: Any) -> Reader:
        for kind in type(ref).__mro__:
            name = _name(kind)
            make = READERS.get(name)
            if make is not None:
                if name not in self._readers:
                    self._readers[name] = make(self.iter_dir, self.trust, self.crc)
                return self._readers[name]
        raise TypeError(f"no source reader for {type(ref).__name__}")

    def tensor(self, shard: str, ref: TensorRef, verify: bool = True) -> torch.Tensor:
        """The tensor ``ref`` points at (a lazy mmap view; a torch_dist piece is assembled from its chunks).
        ``verify=False``: a legacy record's CRC-32 is left for later (a sampled look at a few elements)."""
        return self.reader(ref).tensor(shard, ref, verify)

    def array(self, shard: str, ref: TensorRef, verify: bool = True) -> Any:
        """:meth:`tensor` without torch, for a legacy piece: a numpy view of its elements' bytes (a lazy mmap view;
        each element an unsigned integer of its dtype's width)."""
        reader = self.reader(ref)
        if not isinstance(reader, LegacyReader):
            raise TypeError(f"a {type(ref).__name__} is read as a tensor (torch), not as bytes")
        return reader.array(shard, ref, verify)

    def rows(self, shard: str, ref: TensorRef, first: int, n: int) -> torch.Tensor | None:
        """Rows ``first .. first + n`` (dim 0) of the piece ``ref`` read alone, where its format reads them cheaper
        than the whole piece (a Hugging Face tensor made of several files' runs: a rank's share of a fused QKV or
        SwiGLU fc1); None: take them from :meth:`tensor`."""
        return self.reader(ref).rows(shard, ref, first, n)

    def extent(self, shard: str, ref: TensorRef) -> tuple[str, int, int] | None:
        """(file, byte offset, row pitch in bytes): where the piece ``ref`` (``ref.shape``, ``ref.dtype``) lies when
        each of its rows (dim 0) is one contiguous row-major run of bytes, ``pitch`` apart, so that it can be read
        with plain file I/O; None when it cannot (other strides, or assembled from several chunks)."""
        return self.reader(ref).extent(shard, ref)

    def read_rows(self, shard: str, ref: Any, row0: int, out: Any) -> int | None:
        """Read rows from ``row0`` (dim 0) of the piece ``ref`` into the writable buffer ``out`` (as many rows as it
        holds) with plain file I/O, when its format's reader can and the rows are one contiguous run of bytes, and
        return the CRC-32 of the bytes read; None (nothing read) otherwise: read :meth:`tensor` instead. Call
        :meth:`finish` before trusting what was read."""
        value = self.reader(ref).read_rows(shard, ref, row0, out)
        if value is not None:
            self.bytes_read += memoryview(out).nbytes
        return value

    def finish(self) -> None:
        """The checks :meth:`read_rows` leaves to the end (each partly read record's CRC-32); raises on a mismatch."""
        for r in self._readers.values():
            r.finish()

    def item(self, shard: str, ref: TensorRef) -> Any:
        """A one-element tensor as a number."""
        return self.reader(ref).item(shard, ref)

    def sample_bytes(self, shard: str, ref: Any, k: int) -> bytes | None:
        """The bytes of ``ref``'s first, middle and last ``k`` elements (all when it has at most ``3 k``) read without
        a tensor, where its format can (a contiguous legacy piece); None: take them from :meth:`tensor`."""
        return self.reader(ref).sample_bytes(shard, ref, k)

    def release(self, shard: str, ref: TensorRef) -> None:
        """Drop the mapped pages ``ref`` was read from."""
        self.reader(ref).release(shard, ref)

    def materialize(self, shard: str, value: Any) -> Any:
        """A copy of ``value`` with every TensorRef inside replaced by its tensor (for carried non-model state); by
        a :class:`~megatron_preflight.held_tensor.HeldTensor` of its bytes while torch is not loaded (a legacy
        writer saves it as the tensor)."""
        held = not dtypes.torch_loaded()

        def leaf(v: Any, _path: tuple) -> Any:
            if not isinstance(v, TensorRef):
                return v
            if held and isinstance(self.reader(v), LegacyReader):
                data = self.array(shard, v).tobytes()  # (C order, whatever its strides)
                self.bytes_read += len(data)
                return HeldTensor(v.dtype, tuple(v.shape), data)
            t = self.tensor(shard, v).clone()
            self.bytes_read += t.numel() * t.element_size()
            return t

        return map_leaves(value, leaf)

    def release_pages(self) -> None:
        for r in self._readers.values():
            r.release_pages()

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
