"""Reading a torch_dist checkpoint's tensors: :class:`RegionRef` (a legacy-shaped piece made of boxes of global
tensors) and :class:`DistReader`, which copies the intersecting parts of the chunks that cover a box, mapping only
those byte ranges of the ``__*_*.distcp`` files (a piece that is one saved chunk is a view, not a copy).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.dist import is_fsdp_dir, read_dcp_metadata
from megatron_preflight.torch_file import StorageRef, TensorRef, TorchFile, map_file, row_major, row_pitch

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a global tensor: where it sits and where its ``torch.save`` blob lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative path of the .distcp file
    start: int
    length: int


@dataclass(frozen=True)
class Slab:
    """A box of global tensor ``fqn`` that lands at ``local_start`` along ``dim`` of the local piece.

    ``fragment``: ``fqn`` is stored *flattened by fragments* (the distributed optimizer's ``fully_sharded_model_space``
    form: megatron-core's "ND flattened" reformulation): the global tensor of shape ``lead + G`` (stacked layer /
    expert dims, then the parameter's) is saved as ``lead + F + (prod(fragment),)``, where ``F = G / fragment`` counts
    the fragments along each of the parameter's dims (the saving layout's split: TP, and twice TP for a SwiGLU
    fc1) and the last dim holds each fragment flattened row-major (its DP ranks' ranges as chunks). ``offsets`` and
    ``sizes`` stay in the unflattened ``lead + G`` coordinates."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int
    local_start: int
    fragment: tuple[int, ...] | None = None


@dataclass(frozen=True, repr=False)
class RegionRef(TensorRef):
    """A legacy-shaped tensor made of boxes of torch_dist global tensors (read by :class:`DistReader`)."""

    slabs: tuple[Slab, ...] = ()

    def __repr__(self) -> str:
        return f"RegionRef({tuple(self.shape)}, {self.dtype}, {[s.fqn for s in self.slabs][:1]})"

    def window(self, start: int, shape: tuple[int, ...]) -> RegionRef:
        """Elements ``start .. start + prod(shape)`` of this 1-D region (a flat optimizer buffer), as a tensor of
        ``shape``: the slabs cut to that range."""
        n = math.prod(shape)
        end = start + n
        slabs = []
        for s in self.slabs:
            lo, hi = max(start, s.local_start), min(end, s.local_start + s.sizes[-1])
            if lo < hi:
                slabs.append(Slab(s.fqn, (s.offsets[-1] + lo - s.local_start,), (hi - lo,), 0, lo - start))
        return RegionRef(self.file, StorageRef(self.storage.key, self.dtype, n), 0, tuple(shape),
                         row_major(tuple(shape)), slabs=tuple(slabs))


class DistReader:
    """Reads :class:`RegionRef` tensors of one torch_dist iteration dir (chunk blobs opened once, mapped lazily)."""

    def __init__(self, iter_dir: str, chunks: dict[str, list[Chunk]], trust: bool = False, crc: bool = False) -> None:
        self.crc = crc  # each blob's storage records checked against their CRC-32 on first read
        self.iter_dir = iter_dir
        self.chunks = chunks
        self.trust = trust
        self._files: dict[tuple[str, int], tuple[TorchFile, TensorRef]] = {}
        self._last: tuple[RegionRef, torch.Tensor] | None = None
        self._touched: set[tuple[str, int]] = set()  # chunks mapped since the last release (only they hold pages)
        self._maps: dict[str, mmap.mmap] = {}  # one mapping per .distcp file, shared by its chunks
        self._fds: dict[str, int] = {}  # one descriptor per .distcp file, for reads into a buffer (read_rows)
        self._leads: dict[str, tuple[dict[tuple[int, ...], list[Chunk]], int]] = {}  # see _candidates
        self.bytes_read = 0

    def _chunk(self, chunk: Chunk) -> torch.Tensor:
        f, ref = self._chunk_file(chunk)
        self._touched.add((chunk.file, chunk.start))
        return f.tensor(ref)

    def _chunk_file(self, chunk: Chunk) -> tuple[TorchFile, TensorRef]:
        """The chunk's blob, opened (its metadata read and checked against ``.metadata``), and its tensor's ref."""
        key = (chunk.file, chunk.start)
        if key not in self._files:
            path = os.path.join(self.iter_dir, chunk.file)
            if chunk.file not in self._maps:
                self._maps[chunk.file] = map_file(path)
            f = TorchFile(path, trust=self.trust, window=(chunk.start, chunk.length), mapping=self._maps[chunk.file],
                          check_crc=self.crc)
            ref = f.load_metadata()
            if isinstance(ref, TensorRef) and tuple(ref.shape) != chunk.sizes and \
                    _squeezed(ref.shape) == _squeezed(chunk.sizes) and tuple(ref.stride) == row_major(ref.shape):
                # a chunk stacked under a leading dim of 1 where its blob has none (fsdp_dtensor's experts, seen as
                # torch_dist's stacked tensor): the same bytes in the chunk's shape
                ref = dataclasses.replace(ref, shape=chunk.sizes, stride=row_major(chunk.sizes))
            if not isinstance(ref, TensorRef) or tuple(ref.shape) != chunk.sizes:
                f.close()
                raise CorruptFileError(f"the chunk at byte {chunk.start} holds {ref!r}, but .metadata says a tensor "
                                       f"of shape {chunk.sizes}", path=f.path, code="corrupt_file",
                                       fix="restore the iteration dir from a complete copy")
            self._files[key] = (f, ref)
        return self._files[key]

    def region(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The box of global tensor ``fqn`` at ``offsets`` / ``sizes``, assembled from the chunks that cover it."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        out = torch.empty(sizes, dtype=dtype)
        covered = 0
        for c in self._candidates(fqn, offsets, sizes):
            lo = [max(o, co) for o, co in zip(offsets, c.offsets, strict=True)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            src = self._chunk(c)[tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c.offsets, strict=True))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))].copy_(src)
            n = math.prod(b - a for a, b in zip(lo, hi, strict=True))
            covered += n
            self.bytes_read += n * out.element_size()
        if covered != math.prod(sizes):
            raise CorruptFileError(f"tensor {fqn}: its chunks cover {covered:,} of the {math.prod(sizes):,} elements "
                                   f"at {offsets} (size {sizes})", path=os.path.join(self.iter_dir, ".metadata"),
                                   fix="restore the iteration dir from a complete copy", code="corrupt_file")
        return out

    def _fragmented(self, s: Slab, dtype: torch.dtype) -> torch.Tensor:
        """The box of a slab whose tensor is stored flattened by fragments (see :class:`Slab`): each fragment it
        meets read as its flat range, reshaped, cut to the box."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        assert s.fragment is not None
        frag = s.fragment
        lead = len(s.offsets) - len(frag)
        out = torch.empty(s.sizes, dtype=dtype)
        spans = [range(o, o + n) for o, n in zip(s.offsets[:lead], s.sizes[:lead], strict=True)]
        spans += [range(o // f, (o + n - 1) // f + 1) for o, n, f in zip(s.offsets[lead:], s.sizes[lead:], frag,
                                                                          strict=True)]
        numel = math.prod(frag)
        for index in itertools.product(*spans):
            at, part = index[:lead], index[lead:]
            flat = self.region(s.fqn, (*at, *part, 0), (1,) * len(index) + (numel,), dtype).reshape(frag)
            src, dst = [], [a - o for a, o in zip(at, s.offsets[:lead], strict=True)]
            for d, (i, f) in enumerate(zip(part, frag, strict=True)):
                lo = max(s.offsets[lead + d], i * f)
                hi = min(s.offsets[lead + d] + s.sizes[lead + d], (i + 1) * f)
                src.append(slice(lo - i * f, hi - i * f))
                dst.append(slice(lo - s.offsets[lead + d], hi - s.offsets[lead + d]))
            out[(*dst[:lead], *dst[lead:])] = flat[tuple(src)]
        return out

    def _box(self, s: Slab, dtype: torch.dtype) -> torch.Tensor:
        return self._fragmented(s, dtype) if s.fragment is not None else self.region(s.fqn, s.offsets, s.sizes, dtype)

    def _candidates(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Chunk]:
        """The chunks of ``fqn`` that may meet the box at ``offsets`` / ``sizes`` (every one that does). A chunk one
        element long in its leading dims (a stacked layer's, an expert's) can meet a box only at those very indices,
        so the chunks are filed by their leading indices: a lookup costs the chunks of one layer (and expert), not all
        of the tensor's (a scan of every chunk per piece was quadratic: 80 layers x TP8 = 640 chunks a tensor)."""
        filed = self._leads.get(fqn)
        if filed is None:
            index: dict[tuple[int, ...], list[Chunk]] = {}
            for c in self.chunks.get(fqn, ()):
                k = 0
                while k < len(c.sizes) and c.sizes[k] == 1:
                    k += 1
                index.setdefault(tuple(c.offsets[:k]), []).append(c)
            filed = self._leads[fqn] = (index, max(map(len, index), default=0))
        index, depth = filed
        out = list(index.get((), ()))
        for k in range(1, min(depth, len(offsets)) + 1):
            if sizes[k - 1] != 1:  # the box spans several indices of a dim that chunks are filed by: any may meet it
                return self.chunks.get(fqn, [])
            out.extend(index.get(tuple(offsets[:k]), ()))
        return out

    def chunks_meeting(self, s: Slab) -> list[Chunk]:
        """The saved chunks the slab's box meets: the ones a read of it opens (every chunk of a tensor stored flattened
        by fragments, whose chunks are in other coordinates)."""
        if s.fragment is not None:
            return list(self.chunks.get(s.fqn, ()))
        return [c for c in self._candidates(s.fqn, s.offsets, s.sizes)
                if len(c.offsets) != len(s.offsets)
                or all(co < o + n and o < co + cs for o, n, co, cs in zip(s.offsets, s.sizes, c.offsets, c.sizes,
                                                                          strict=True))]

    def _holding_chunk(self, s: Slab) -> Chunk | None:
        """The saved chunk that holds the slab's box whole, if one does."""
        for c in self._candidates(s.fqn, s.offsets, s.sizes):
            if all(co <= o and o + n <= co + cs for o, n, co, cs in zip(s.offsets, s.sizes, c.offsets, c.sizes,
                                                                        strict=True)):
                return c
        return None

    def extent(self, shard: str, ref: RegionRef) -> tuple[str, int, int] | None:
        """(file, byte offset, row pitch in bytes) of the piece ``ref`` when it lies inside one saved chunk with each
        of its rows contiguous (a legacy-shaped piece that is a chunk, whole rows of one, or a column block of one);
        None when it is assembled from several chunks or otherwise strided (it is then read through :meth:`tensor`)."""
        run = self._run(ref)
        if run is None:
            return None
        f, view, _ = run
        at = f.byte_extent(view)
        return None if at is None else (f.path, *at)

    def _run(self, ref: RegionRef) -> tuple[TorchFile, TensorRef, Chunk] | None:
        """The piece as a view (offset, strides) of the one chunk that holds it, when each of its rows is contiguous
        there; with the chunk's blob and the chunk."""
        if len(ref.slabs) != 1 or not ref.shape:
            return None
        s = ref.slabs[0]
        if s.fragment is not None or math.prod(s.sizes) != math.prod(ref.shape):
            return None
        c = self._holding_chunk(s)
        if c is None:
            return None
        f, cref = self._chunk_file(c)
        at = f.byte_extent(cref)
        if at is None or at[1] != math.prod(c.sizes[1:]) * cref.dtype.itemsize or \
                dtypes.name_of(cref.dtype) != dtypes.name_of(ref.dtype):
            return None  # a chunk that is not stored contiguously (torch.save keeps a view's strides)
        strides = row_major(c.sizes)
        kept = [(n, st) for n, st in zip(s.sizes, strides, strict=True) if n != 1]
        if [n for n, _ in kept] != [n for n in ref.shape if n != 1]:
            return None  # the piece reshapes the box (merges or splits its dims)
        it = iter(kept)
        stride = tuple(next(it)[1] if n != 1 else 0 for n in ref.shape)
        if row_pitch(tuple(ref.shape), stride) is None:
            return None
        first = sum((o - co) * st for o, co, st in zip(s.offsets, c.offsets, strides, strict=True))
        return f, TensorRef(cref.file, cref.storage, cref.offset + first, tuple(ref.shape), stride), c

    def _inside_one_chunk(self, s: Slab, dtype: torch.dtype) -> torch.Tensor | None:
        """The box as a view of the one chunk that holds it whole (the usual case: a legacy piece is a saved chunk):
        mapped, not copied, so a big tensor streams through the writer as a legacy one does."""
        c = self._holding_chunk(s)
        if c is None:
            return None
        t = self._chunk(c)
        if t.dtype != dtype:
            return None
        self.bytes_read += math.prod(s.sizes) * t.element_size()
        return t[tuple(slice(o - co, o - co + n) for o, n, co in zip(s.offsets, s.sizes, c.offsets, strict=True))]

    def tensor(self, shard: str, ref: RegionRef, verify: bool = True) -> torch.Tensor:
        """The piece ``ref`` (its shard is in the slabs), assembled once: row-chunked writers ask again and again.
        Its chunks' CRC-32s are checked on their first read whatever ``verify`` says (a chunk is read whole)."""
        if self._last is not None and self._last[0] is ref:
            return self._last[1]
        t = self._assemble(ref)
        self._last = (ref, t)
        return t

    def read_rows(self, shard: str, ref: RegionRef, row0: int, out: Any) -> int | None:
        """Rows of ``ref`` from ``row0`` into ``out`` with plain file I/O when the piece lies in one chunk with its rows
        contiguous (:meth:`TorchFile.read_rows`, through one descriptor per ``.distcp`` file): their CRC-32; None
        (nothing read) otherwise."""
        run = self._run(ref)
        if run is None:
            return None
        f, view, c = run
        # (its CRC chain may read the rows between through the mapping: the chunk is released with the others)
        self._touched.add((c.file, c.start))
        if c.file not in self._fds:
            self._fds[c.file] = os.open(f.path, os.O_RDONLY)
        return f.read_rows(view, row0, out, fd=self._fds[c.file])

    def finish(self) -> None:
        """Check the CRC-32 of every chunk :meth:`read_rows` read only in part."""
        for f, _ in self._files.values():
            f.finish_crc()

    def rows(self, shard: str, ref: RegionRef, first: int, n: int) -> Any:
        """None: a slice is taken from :meth:`tensor` (a mapped view, or a piece assembled once)."""
        return None

    def item(self, shard: str, ref: RegionRef) -> Any:
        return self.tensor(shard, ref).item()

    def sample_bytes(self, shard: str, ref: RegionRef, k: int) -> bytes | None:
        return None  # (torch_dist saves each piece once: no replicas)

    def release(self, shard: str, ref: RegionRef) -> None:
        self._last = None
        self.release_pages()

    def _assemble(self, ref: RegionRef) -> torch.Tensor:
        import torch  # reading tensors (the layout itself is metadata: this module loads without torch)

        dtype = dtypes.to_torch(ref.dtype)  # (metadata indexed before torch was loaded names it by a placeholder)
        if len(ref.slabs) == 1 and ref.shape and math.prod(ref.slabs[0].sizes) == math.prod(ref.shape) and \
                ref.slabs[0].fragment is None:
            view = self._inside_one_chunk(ref.slabs[0], dtype)
            if view is not None:
                return view.reshape(ref.shape)
        if ref.slabs and all(len(s.sizes) == 1 for s in ref.slabs) and len(ref.shape) != 1:
            flat = torch.empty(math.prod(ref.shape), dtype=dtype)  # a window of a flat buffer, reshaped
            for s in ref.slabs:
                flat.narrow(0, s.local_start, s.sizes[0]).copy_(self.region(s.fqn, s.offsets, s.sizes, dtype))
            return flat.view(ref.shape)
        out = torch.empty(ref.shape, dtype=dtype)
        for s in ref.slabs:
            box = self._box(s, dtype)
            if not ref.shape:
                out.copy_(box.reshape(()))
                continue
            lead = len(s.sizes) - len(ref.shape)
            part = out.narrow(s.dim, s.local_start, s.sizes[lead + s.dim])
            part.copy_(box.reshape(part.shape))
        return out

    def release_pages(self) -> None:
        """Drop the mapped pages of the chunks read since the last release (not every chunk opened: releasing each
        of a checkpoint's thousands of chunks after every tensor was quadratic)."""
        self._last = None
        for key in self._touched:
            self._files[key][0].release_pages()
        self._touched.clear()

    def close(self) -> None:
        self._last = None
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
        self._touched.clear()
        self._maps.clear()  # a mapping with live tensor views is released with the last of them
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _squeezed(shape: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in shape if int(d) != 1)


def chunk_index(md: Any) -> dict[str, list[Chunk]]:
    """fqn -> its chunks with their blobs' byte ranges (from ``.metadata``)."""
    where = {(i.fqn, tuple(i.offset)): info for i, info in md.storage_data.items() if getattr(i, "offset", None)
             is not None}
    out: dict[str, list[Chunk]] = {}
    for fqn, tm in md.state_dict_metadata.items():
        for c in getattr(tm, "chunks", None) or ():
            info = where.get((fqn, tuple(c.offsets)))
            if info is not None:
                out.setdefault(fqn, []).append(Chunk(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes),
                                                     info.relative_path, int(info.offset), int(info.length)))
    return out


def source_metadata(iter_dir: str, *, trust: bool = False) -> Any:
    """The DCP metadata of ``iter_dir`` as the resharder's torch_dist readers read it: a Megatron-FSDP save's renamed
    as torch_dist's (:mod:`.fsdp_dtensor`), any other as it is."""
    md = read_dcp_metadata(iter_dir, trust=trust)
    if not is_fsdp_dir(iter_dir, md):
        return md
    from megatron_preflight.reshard.sources.fsdp_dtensor import translated  # deferred: a Megatron-FSDP save only

    return translated(md, iter_dir)


def dist_reader(iter_dir: str, *, trust: bool = False, crc: bool = False, raw: bool = False) -> DistReader:
    """A reader for the :class:`RegionRef` tensors of the torch_dist iteration dir ``iter_dir`` (``raw``: by the
    names its ``.metadata`` holds, an fsdp_dtensor dir's not seen through torch_dist's)."""
    md = read_dcp_metadata(iter_dir, trust=trust) if raw else source_metadata(iter_dir, trust=trust)
    return DistReader(iter_dir, chunk_index(md), trust=trust, crc=crc)
