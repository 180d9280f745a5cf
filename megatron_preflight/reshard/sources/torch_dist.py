"""torch_dist checkpoints as a source of the resharder: their model tensors, seen as the legacy shards of the
layout that saved them.

A torch_dist ``.metadata`` describes every model tensor by its *global* shape, with decoder layers stacked along a
leading layer dim (and expert weights along an expert dim after it), and the chunks each rank wrote (offsets, sizes,
and the byte range of the chunk's ``torch.save`` blob inside a ``__*_*.distcp`` file). :func:`virtual_layout` turns
that into the shards a legacy save at the same layout would have written — same keys, same local shapes — whose
tensors are :class:`RegionRef` pieces of the global tensors. Every later stage (index, planner, executor, writer,
verification) then works unchanged; only :class:`DistReader` knows how to read a region (it copies the intersecting
parts of the chunks that cover it, mapping only those byte ranges).

Where a legacy tensor sits in the global one comes from the split-rule table (:func:`rules.segments`): SwiGLU's
``[gate; up]`` halves, vocab padding and ETP for experts included. Key names follow the model's spec: with
``--transformer-impl local`` Megatron saves ``input_layernorm`` / ``pre_mlp_layernorm`` under the fused names
(``self_attention.linear_qkv.layer_norm_*`` / ``mlp.linear_fc1.layer_norm_*``), and the legacy keys get their module
names back.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.errors import CorruptFileError, PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.dist import object_index, read_dcp_metadata, read_object
from megatron_preflight.layout.model import Format, Layout, Shard
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.reshard.carried import FROM_TORCH_DIST, REWRITTEN
from megatron_preflight.reshard.plan.rules import parse_key, rule_for, segments
from megatron_preflight.torch_file import StorageRef, TensorRef, TorchFile

if TYPE_CHECKING:
    import torch

LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.experts."
# --transformer-impl local: module names -> the names the torch_dist save uses (megatron-core's local layer spec)
LOCAL_SPEC_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                   "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


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
    """A box of global tensor ``fqn`` that lands at ``local_start`` along ``dim`` of the local piece."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int
    local_start: int


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
                         _contiguous(tuple(shape)), slabs=tuple(slabs))


class DistReader:
    """Reads :class:`RegionRef` tensors of one torch_dist iteration dir (chunk blobs opened once, mapped lazily)."""

    def __init__(self, iter_dir: str, chunks: dict[str, list[Chunk]], trust: bool = False) -> None:
        self.iter_dir = iter_dir
        self.chunks = chunks
        self.trust = trust
        self._files: dict[tuple[str, int], tuple[TorchFile, TensorRef]] = {}
        self._last: tuple[RegionRef, torch.Tensor] | None = None
        self.bytes_read = 0

    def _chunk(self, chunk: Chunk) -> torch.Tensor:
        key = (chunk.file, chunk.start)
        if key not in self._files:
            f = TorchFile(os.path.join(self.iter_dir, chunk.file), trust=self.trust, window=(chunk.start, chunk.length))
            ref = f.load_metadata()
            if not isinstance(ref, TensorRef) or tuple(ref.shape) != chunk.sizes:
                f.close()
                raise CorruptFileError(f"the chunk at byte {chunk.start} holds {ref!r}, but .metadata says a tensor "
                                       f"of shape {chunk.sizes}", path=f.path, code="corrupt_file",
                                       fix="restore the iteration dir from a complete copy")
            self._files[key] = (f, ref)
        f, ref = self._files[key]
        return f.tensor(ref)

    def region(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The box of global tensor ``fqn`` at ``offsets`` / ``sizes``, assembled from the chunks that cover it."""
        import torch  # deferred: torch only where tensors are made (metadata paths run without it)

        out = torch.empty(sizes, dtype=dtype)
        covered = 0
        for c in self.chunks.get(fqn, ()):
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

    def _inside_one_chunk(self, s: Slab, dtype: torch.dtype) -> torch.Tensor | None:
        """The box as a view of the one chunk that holds it whole (the usual case: a legacy piece is a saved chunk):
        mapped, not copied, so a big tensor streams through the writer as a legacy one does."""
        for c in self.chunks.get(s.fqn, ()):
            if all(co <= o and o + n <= co + cs for o, n, co, cs in zip(s.offsets, s.sizes, c.offsets, c.sizes,
                                                                        strict=True)):
                t = self._chunk(c)
                if t.dtype != dtype:
                    return None
                self.bytes_read += math.prod(s.sizes) * t.element_size()
                return t[tuple(slice(o - co, o - co + n) for o, n, co in zip(s.offsets, s.sizes, c.offsets,
                                                                             strict=True))]
        return None

    def tensor(self, shard: str, ref: RegionRef) -> torch.Tensor:
        """The piece ``ref`` (its shard is in the slabs), assembled once: row-chunked writers ask again and again."""
        if self._last is not None and self._last[0] is ref:
            return self._last[1]
        t = self._assemble(ref)
        self._last = (ref, t)
        return t

    def item(self, shard: str, ref: RegionRef) -> Any:
        return self.tensor(shard, ref).item()

    def release(self, shard: str, ref: RegionRef) -> None:
        self._last = None
        self.release_pages()

    def _assemble(self, ref: RegionRef) -> torch.Tensor:
        import torch  # reading tensors (the layout itself is metadata: this module loads without torch)

        if len(ref.slabs) == 1 and ref.shape and math.prod(ref.slabs[0].sizes) == math.prod(ref.shape):
            view = self._inside_one_chunk(ref.slabs[0], ref.dtype)
            if view is not None:
                return view.reshape(ref.shape)
        if ref.slabs and all(len(s.sizes) == 1 for s in ref.slabs) and len(ref.shape) != 1:
            flat = torch.empty(math.prod(ref.shape), dtype=ref.dtype)  # a window of a flat buffer, reshaped
            for s in ref.slabs:
                flat.narrow(0, s.local_start, s.sizes[0]).copy_(self.region(s.fqn, s.offsets, s.sizes, ref.dtype))
            return flat.view(ref.shape)
        out = torch.empty(ref.shape, dtype=ref.dtype)
        for s in ref.slabs:
            box = self.region(s.fqn, s.offsets, s.sizes, ref.dtype)
            if not ref.shape:
                out.copy_(box.reshape(()))
                continue
            lead = len(s.sizes) - len(ref.shape)
            part = out.narrow(s.dim, s.local_start, s.sizes[lead + s.dim])
            part.copy_(box.reshape(part.shape))
        return out

    def release_pages(self) -> None:
        self._last = None
        for f, _ in self._files.values():
            f.release_pages()

    def close(self) -> None:
        self._last = None
        for f, _ in self._files.values():
            f.close()
        self._files.clear()


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


def is_local_spec(args: Any) -> bool:
    """``--transformer-impl local``: its layer norms are modules of their own in a legacy state dict."""
    return getattr(args, "transformer_impl", "transformer_engine") == "local"


def _legacy_suffix(rest: str, local_spec: bool) -> str:
    """A layer key's name in a legacy state dict, from its torch_dist name."""
    if local_spec:
        for module, saved in LOCAL_SPEC_KEYS.items():
            if rest.startswith(saved):
                return module + rest[len(saved):]
    return rest


def dist_suffix(suffix: str, local_spec: bool) -> str:
    """A layer key's torch_dist name, from its legacy name (the inverse of :func:`_legacy_suffix`)."""
    if local_spec:
        for module, saved in LOCAL_SPEC_KEYS.items():
            if suffix.startswith(module):
                return saved + suffix[len(module):]
    return suffix


def object_fqn(base: str, index: tuple[int, ...], count: tuple[int, ...]) -> str:
    """A sharded object's key: ``<base>/shard_<index>_<count>`` (dims joined by dots; ``0_1`` when not stacked).
    :meth:`_Builder.extra_state` parses it."""
    return f"{base}/shard_{'.'.join(map(str, index)) or '0'}_{'.'.join(map(str, count)) or '1'}"


# Megatron-Core's module registration order inside a transformer layer (the order of a legacy state dict; the DDP
# buffer model reads parameter order from it). Keys of other modules follow, in .metadata order.
MODULE_ORDER = ("input_layernorm.", "self_attention.core_attention.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_cross_attn_layernorm.",
                "cross_attention.", "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.", "mlp.router.",
                "mlp.experts.", "mlp.shared_experts.linear_fc1.", "mlp.shared_experts.linear_fc2.",
                "mlp.shared_experts.")
PARAM_ORDER = {"layer_norm_weight": 0, "layer_norm_bias": 1, "weight": 2, "bias": 3, "_extra_state": 9}
NON_LAYER_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "embedding.",
                   "decoder.final_layernorm.", "decoder.final_norm.", "output_layer.")


def _rank(name: str, table: tuple[str, ...], fallback: int) -> int:
    hits = [i for i, prefix in enumerate(table) if name.startswith(prefix)]
    return hits[0] if hits else len(table) + fallback


def _param_rank(name: str) -> int:
    return PARAM_ORDER.get(name.rsplit(".", 1)[-1], 5)


@dataclass
class _Entry:
    sort: tuple
    key: str
    value: Any


class _Builder:
    """Collects, per virtual shard and model chunk, the legacy keys and their regions."""

    def __init__(self, layout: Layout, par: ParallelLayout, md: Any, trust: bool = False) -> None:
        self.layout = layout
        self.par = par
        self.md = md
        args = layout.saved_args
        self.swiglu = bool(getattr(args, "swiglu", False))
        self.local_spec = is_local_spec(args)
        self.te_grouped = bool(getattr(args, "moe_grouped_gemm", False)) and not self.local_spec
        self.dirs = naming.shard_writers(par)
        self.entries: dict[tuple[str, int], list[_Entry]] = {(n, c): [] for n in self.dirs for c in range(par.chunks)}
        self.position = {fqn: i for i, fqn in enumerate(md.state_dict_metadata)}
        self.iter_dir = layout.iter_dir or ""
        self.objects = object_index(md)  # indexed once: a model has thousands of extra-state items
        self.trust = trust

    def _shards(self, stage: int | None, ep: int | None = None) -> list[tuple[str, dict[str, int]]]:
        return [(n, c) for n, c in self.dirs.items() if (stage is None or c["pp"] == stage)
                and (ep is None or c["ep"] == ep)]

    def _ref(self, fqn: str, dtype: torch.dtype, lead: tuple[int, ...], shape: tuple[int, ...], key: str,
             rank: int, size: int) -> RegionRef:
        """The legacy piece of rank ``rank`` (of ``size``) of the tensor under ``key``: boxes of global ``fqn`` at
        stacked index ``lead`` (layer, expert)."""
        rule = rule_for(parse_key(key), swiglu=self.swiglu)
        local = list(shape)
        slabs: list[Slab] = []
        if rule.dim is None or size == 1:
            slabs.append(Slab(fqn, lead + (0,) * len(shape), tuple(1 for _ in lead) + shape, 0, 0))
        else:
            dim = rule.dim
            if shape[dim] % size:
                raise PreflightError(f"tensor {fqn}: {shape[dim]} rows along dim {dim} do not split over {size} ranks",
                                     path=os.path.join(self.iter_dir, ".metadata"), code="inconsistent_shards",
                                     fix="the checkpoint's args and its tensors disagree: restore it from a good copy")
            local[dim] = 0
            for gstart, length, lstart in segments(rule, shape[dim], size, rank):
                offsets = [0] * len(shape)
                sizes = list(shape)
                offsets[dim], sizes[dim] = gstart, length
                slabs.append(Slab(fqn, lead + tuple(offsets), tuple(1 for _ in lead) + tuple(sizes), dim, lstart))
                local[dim] += length
        return RegionRef(self.iter_dir, StorageRef(fqn, dtype, math.prod(local)), 0, tuple(local),
                         _contiguous(tuple(local)), slabs=tuple(slabs))

    def _add(self, shard: str, chunk: int, sort: tuple, key: str, value: Any) -> None:
        self.entries[(shard, chunk)].append(_Entry(sort, key, value))

    def _layer_sort(self, g: int, suffix: str, expert: int, pos: int) -> tuple:
        if suffix.startswith(EXPERTS):  # experts: one block, expert-major, then fc1 before fc2
            inner = _rank(suffix[len(EXPERTS):], ("linear_fc1.", "linear_fc2."), pos)
            return (1, g, _rank("mlp.experts.", MODULE_ORDER, pos), expert, inner, _param_rank(suffix), pos)
        return (1, g, _rank(suffix, MODULE_ORDER, pos), 0, 0, _param_rank(suffix), pos)

    @staticmethod
    def _layers_of(fqn: str, count: int | None) -> tuple[list[tuple[int, tuple[int, ...]]], str]:
        """The global layers a ``decoder.layers.`` tensor holds, each with its index into the stacked dims, and the
        name inside the layer: ``decoder.layers.<name>`` is stacked along dim 0 (one entry per layer, ``count``
        of them); ``decoder.layers.<g>.<name>`` (heterogeneous layers) is layer ``g`` alone."""
        rest = fqn[len(LAYERS):]
        head, _, tail = rest.partition(".")
        if head.isdigit():
            return [(int(head), ())], tail
        return [(g, (g,)) for g in range(count or 0)], rest

    def tensor(self, fqn: str, tm: Any) -> None:
        shape = tuple(int(s) for s in tm.size)
        dtype = tm.properties.dtype
        pos = self.position[fqn]
        if not fqn.startswith(LAYERS):
            first = fqn.startswith("embedding.")
            stage, chunk = (0, 0) if first else (self.par.pp - 1, self.par.chunks - 1)
            for name, c in self._shards(stage):
                ref = self._ref(fqn, dtype, (), shape, fqn, c["tp"], self.par.tp)
                self._add(name, chunk, (0 if first else 2, 0, _rank(fqn, NON_LAYER_ORDER, pos), _param_rank(fqn),
                                        pos), fqn, ref)
            return
        layers, rest = self._layers_of(fqn, shape[0])
        for g, lead in layers:
            stage, chunk, local = self.par.place_layer(g)
            inner = shape[len(lead):]
            if rest.startswith(EXPERTS):
                suffix = rest[len(EXPERTS):]
                for ge in range(inner[0]):
                    ep_rank, le = self.par.place_expert(ge)
                    key = f"{LAYERS}{local}.mlp.experts" + self._expert_key(suffix, le)
                    for name, c in self._shards(stage, ep_rank):
                        ref = self._ref(fqn, dtype, lead + (ge,), inner[1:], key, c["etp"], self.par.etp_eff)
                        self._add(name, chunk, self._layer_sort(g, EXPERTS + suffix, ge, pos), key, ref)
            else:
                suffix = _legacy_suffix(rest, self.local_spec)
                key = f"{LAYERS}{local}.{suffix}"
                for name, c in self._shards(stage):
                    ref = self._ref(fqn, dtype, lead, inner, key, c["tp"], self.par.tp)
                    self._add(name, chunk, self._layer_sort(g, suffix, 0, pos), key, ref)

    def _expert_key(self, suffix: str, local_expert: int) -> str:
        if self.te_grouped:
            return f".{suffix}{local_expert}"  # TE grouped GEMM: mlp.experts.linear_fc1.weight{j}
        return f".local_experts.{local_expert}.{suffix}"

    def extra_state(self, fqn: str) -> None:
        """A module's extra state (None without Transformer Engine FP8), read from its bytes item:
        ``…_extra_state/shard_<index>_<count>``, the index giving the layer when stacked, then the expert."""
        base, _, shard = fqn.partition("/shard_")
        if not base.startswith(LAYERS):  # outside the layers (a TE final norm): in the last stage's legacy files
            if base.startswith("decoder."):
                pos = self.position[fqn]
                for name, _c in self._shards(self.par.pp - 1):
                    self._add(name, self.par.chunks - 1, (2, 0, _rank(base, NON_LAYER_ORDER, pos), _param_rank(base),
                                                          pos), base, self._bytes_item(fqn))
            return
        index = [int(i) for i in shard.split("_")[0].split(".")]
        layers, rest = self._layers_of(base, None)
        if not layers:  # stacked: the layer is the first index
            g, index = index[0], index[1:]
        else:
            g = layers[0][0]
        stage, chunk, local = self.par.place_layer(g)
        value = self._bytes_item(fqn)
        pos = self.position[fqn]
        if rest.startswith(EXPERTS):
            if not index:
                return
            ep_rank, le = self.par.place_expert(index[0])
            suffix = rest[len(EXPERTS):]
            if self.te_grouped:  # one grouped module per rank: mlp.experts.linear_fc1._extra_state
                if le != 0:
                    return
                key = f"{LAYERS}{local}.mlp.experts.{suffix}"
            else:
                key = f"{LAYERS}{local}.mlp.experts" + self._expert_key(suffix, le)
            for name, _c in self._shards(stage, ep_rank):
                self._add(name, chunk, self._layer_sort(g, EXPERTS + suffix, index[0], pos), key, value)
            return
        suffix = _legacy_suffix(rest, self.local_spec)
        key = f"{LAYERS}{local}.{suffix}"
        for name, _c in self._shards(stage):
            self._add(name, chunk, self._layer_sort(g, suffix, 0, pos), key, value)

    def tied_output(self, tied: bool) -> None:
        """With tied embeddings and PP > 1 the last stage's legacy file holds its copy of the word embeddings as
        ``output_layer.weight`` (torch_dist saves the embedding once)."""
        if not tied or self.par.pp == 1:
            return
        tm = self.md.state_dict_metadata.get("embedding.word_embeddings.weight")
        if tm is None:
            return
        shape = tuple(int(s) for s in tm.size)
        chunk = self.par.chunks - 1
        for name, c in self._shards(self.par.pp - 1):
            ref = self._ref("embedding.word_embeddings.weight", tm.properties.dtype, (), shape, "output_layer.weight",
                            c["tp"], self.par.tp)
            self._add(name, chunk, (2, 0, _rank("output_layer.", NON_LAYER_ORDER, 0), _param_rank("weight"), 0),
                      "output_layer.weight", ref)

    def output_extra_state(self) -> None:
        """The output layer's ``_extra_state`` (None): in every legacy file of the last stage, not in torch_dist."""
        chunk = self.par.chunks - 1
        for name, _c in self._shards(self.par.pp - 1):
            if not any(e.key == "output_layer._extra_state" for e in self.entries[(name, chunk)]):
                self._add(name, chunk, (2, 0, _rank("output_layer.", NON_LAYER_ORDER, 0), 9, 0),
                          "output_layer._extra_state", None)

    def attention_extra_state(self) -> None:
        """Transformer Engine's attention module (``self_attention.core_attention``) has an ``_extra_state`` that a
        legacy save holds and torch_dist does not. Without FP8 it is TE's empty value, the same as the layer's
        ``linear_proj._extra_state`` (one serialization for TE's Linear and DotProductAttention per TE version): made
        from it, as Megatron's own conversion saves a freshly built module's. With FP8 (a non-empty value) it is left
        out: TE's load hook fills a missing one."""
        if self.local_spec:
            return
        for (name, chunk), entries in self.entries.items():
            keys = {e.key for e in entries}
            for e in list(entries):
                if not e.key.endswith(".self_attention.linear_proj._extra_state"):
                    continue
                key = e.key.replace(".linear_proj._extra_state", ".core_attention._extra_state")
                value = _no_fp8_copy(e.value)
                if key not in keys and value is not None:
                    g = e.sort[1]
                    self._add(name, chunk, self._layer_sort(g, "self_attention.core_attention._extra_state", 0,
                                                            e.sort[-1]), key, value)

    def _bytes_item(self, fqn: str) -> Any:
        info = self.objects.get(fqn)
        # a TE module's extra state is a small uint8 tensor: read into a tensor where one will be written (torch is
        # loaded); a verdict (no torch) only needs to know what it is. Either way a value, never a piece to plan.
        if info is None:
            return None
        if dtypes.torch_loaded():
            return read_object(self.iter_dir, fqn, info, trust=self.trust, tensors=True)
        return _described(read_object(self.iter_dir, fqn, info, trust=self.trust))


_PICKLED_NONE = b"\x80\x04N."  # pickle.dumps(None): TE 2.0-2.3's extra state of a module without FP8


def _no_fp8_copy(value: Any) -> Any:
    """A copy of a TE extra state that holds no FP8 metadata (empty, or a pickled None), else None."""
    if isinstance(value, TensorValue):
        return value if value.shape in ((0,), (len(_PICKLED_NONE),)) else None
    if getattr(value, "dtype", None) is not None and hasattr(value, "numel") and value.dim() == 1:
        if value.numel() == 0 or bytes(value.tolist()) == _PICKLED_NONE:
            return value.clone()
    return None


@dataclass(frozen=True)
class TensorValue:
    """A tensor inside a sharded object (a TE extra state), described without torch: its dtype and shape."""

    dtype: Any
    shape: tuple[int, ...]


def _described(value: Any) -> Any:
    if isinstance(value, TensorRef):
        return TensorValue(value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return type(value)((k, _described(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_described(v) for v in value)
    return value


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def dist_reader(iter_dir: str, *, trust: bool = False) -> DistReader:
    """A reader for the :class:`RegionRef` tensors of the torch_dist iteration dir ``iter_dir``."""
    return DistReader(iter_dir, chunk_index(read_dcp_metadata(iter_dir, trust=trust)), trust=trust)


def virtual_layout(layout: Layout, *, trust: bool = False) -> tuple[Layout, bool]:
    """The legacy shards a save of ``layout``'s torch_dist checkpoint at its own layout would have written, their
    tensors as :class:`RegionRef` (read them with :func:`dist_reader`); and whether it holds optimizer state."""
    if layout.format != Format.TORCH_DIST or layout.iter_dir is None:
        raise PreflightError("not a torch_dist checkpoint", path=layout.path, code="format")
    if layout.saved_args is None or layout.parallel is None:
        raise PreflightError("the torch_dist checkpoint has no saved args (common state), so the layout that saved "
                             "it is unknown", path=layout.iter_dir, code="format",
                             fix="restore common.pt (or the common_state item) from a complete copy")
    md = read_dcp_metadata(layout.iter_dir, trust=trust)
    par = layout.parallel
    b = _Builder(layout, par, md, trust)
    has_optimizer = False
    for fqn, tm in md.state_dict_metadata.items():
        if fqn.startswith("optimizer.") or (fqn.startswith("chained_") and ".optimizer." in fqn):
            has_optimizer = True
            continue
        if "/shard_" in fqn and fqn.split("/")[0].endswith("_extra_state"):
            b.extra_state(fqn)
            continue
        if not hasattr(tm, "size") or fqn.startswith(("rng_state", "rerun_state")):
            continue
        b.tensor(fqn, tm)
    b.tied_output(not bool(getattr(layout.saved_args, "untie_embeddings_and_output_weights", False)))
    b.output_extra_state()
    b.attention_extra_state()
    common = layout.common_state or {}
    head = {k: common[k] for k in REWRITTEN + FROM_TORCH_DIST if k in common}  # what a legacy file holds at top level
    shards: list[Shard] = []
    for name, coords in b.dirs.items():
        meta: dict[str, Any] = dict(head)
        for chunk in range(par.chunks):
            items = sorted(b.entries[(name, chunk)], key=lambda e: e.sort)
            meta["model" if par.chunks == 1 else f"model{chunk}"] = {e.key: e.value for e in items}
        shards.append(Shard(name=name, tp_rank=coords["tp"], pp_rank=coords["pp"], ep_rank=coords["ep"],
                            path=os.path.join(layout.iter_dir, name), meta=meta))
    virtual = dataclasses.replace(layout, format=Format.TORCH, shards=shards, problems=list(layout.problems),
                                  notes=list(layout.notes))
    return virtual, has_optimizer
