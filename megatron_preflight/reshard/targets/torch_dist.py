"""Write a torch_dist checkpoint (Megatron's default format) from any checkpoint the resharder reads: the way off the
legacy format, and the format whose loader reshards by itself.

A torch_dist checkpoint does not depend on the layout that wrote it: each tensor is stored whole, by its global shape,
with decoder layers stacked along a leading dim (experts along the next one), or per layer (``decoder.layers.<g>.``)
for models whose layers differ (``--moe-layer-freq`` patterns). So the global tensors are planned as the one rank of a
TP1·PP1·EP1 layout — the same plans, validation and split rules as every reshard — and written streamed, one chunk per
layer (and expert): a ``torch.save`` blob per chunk appended to ``__0_0.distcp``, then ``.metadata`` (PyTorch DCP's
index of every chunk's byte range), ``common.pt`` (args, iteration, scheduler) and ``metadata.json``.

Megatron reshards such a checkpoint at load time, to any layout: the weights, and the optimizer state, written in model
space (see :func:`write_optimizer_state`). RNG states are not written (``--no-load-rng``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_preflight import pickling
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.optimizer_kinds import Split
from megatron_preflight.parallel import VOCAB_DIVISOR, hybrid_pattern
from megatron_preflight.reshard.carried import TO_TORCH_DIST
from megatron_preflight.reshard.checkpoint_index import CheckpointIndex, open_index
from megatron_preflight.reshard.execute.executor import build_tensor
from megatron_preflight.reshard.optimizer.family import FUSED, family_of
from megatron_preflight.reshard.optimizer.plain import MASTER, part_layout
from megatron_preflight.reshard.plan.planner import plan_tensor
from megatron_preflight.reshard.plan.rules import parse_key, torch_dist_name
from megatron_preflight.reshard.plan.spec import ATTENTION_EXTRA, EXPERTS_MODULE, dist_suffix, is_local_spec
from megatron_preflight.reshard.plan.types import TensorPlan
from megatron_preflight.reshard.resharder import Resharder, open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.sources.torch_dist import EXPERTS, SECTIONED, object_fqn
from megatron_preflight.reshard.sources.torch_dist_reader import dist_reader
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets.assets import HashedFile
from megatron_preflight.reshard.targets.output_file import open_output
from megatron_preflight.reshard.targets.stream_save import can_write_blob, owns_storage, write_tensor_blob
from megatron_preflight.reshard.targets.unit import MegatronDirs, ShardResult, Tap, Tapping

log = logging.getLogger(__name__)

DATA_FILE = "__0_0.distcp"

# how a planned tensor's values are made: from its source slices (a hollow benchmark checkpoint passes its own)
Build = Callable[[TensorPlan, SourceFiles], torch.Tensor]


def from_sources(tp: TensorPlan, files: SourceFiles) -> torch.Tensor:
    return build_tensor(tp, files, release=True)


@dataclass
class Item:
    """One chunk written: the global tensor (or object) it belongs to and where its bytes are."""

    fqn: str
    offsets: tuple[int, ...] | None  # None: a bytes item (an object)
    start: int
    length: int
    file: str = DATA_FILE  # the data file, relative to the iteration dir


def _homogeneous(args: Any) -> bool:
    """Whether Megatron stacks the layers (all layers alike), or keys them per layer (a HybridModel always)."""
    if hybrid_pattern(args) is not None:
        return False
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return len(set(freq)) <= 1
    if isinstance(freq, str):
        return False
    return getattr(args, "heterogeneous_layers_config_path", None) is None and \
        getattr(args, "heterogeneous_layers_config_encoded_json", None) is None


def _object_key(value: Any) -> tuple | None:
    """A key equal for objects whose saved blobs are equal: a sharded object's one-element list of None, bytes, a
    BytesIO (TE's extra state) or a small uint8 tensor (TE's newer form); None for anything else (saved each time)."""
    if not (isinstance(value, list) and len(value) == 1):
        return None
    v = value[0]
    if v is None or isinstance(v, bytes):
        return ("value", v)
    if isinstance(v, io.BytesIO):
        return ("BytesIO", v.getvalue())
    if isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 and v.numel() <= 1 << 16 and \
            owns_storage(v):
        return ("uint8", v.numpy().tobytes())
    return None


class ChunkWriter:
    """The data file of a torch_dist iteration dir, chunk by chunk, and the ``.metadata`` that indexes it."""

    def __init__(self, iter_dir: str, *, hashed: bool = False) -> None:
        """``hashed``: the data file's SHA-256 taken as it is written, left for integrity.json (assets.HashedFile)."""
        path = os.path.join(iter_dir, DATA_FILE)
        self.fh: Any = HashedFile(path) if hashed else open_output(path)  # (closed by close())
        self.items: list[Item] = []
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
        self.objects: set[str] = set()
        self.bytes_written = 0
        self._objects: dict[tuple, bytes] = {}  # an object's blob by its value (a model's thousands of TE extra
        # states are a few distinct ones)
        # for --verify: (fqn, offsets, sizes, plan, as float, the rows of the plan's tensor written there)
        self.planned: list[tuple[str, tuple[int, ...], tuple[int, ...], TensorPlan, bool, tuple[int, int] | None]] = []

    def _blob(self, value: Any) -> tuple[int, int]:
        """One ``torch.save`` blob appended to the data file, written straight into it (no copy in memory), as
        PyTorch's own DCP writer does."""
        start = self.fh.tell()
        if isinstance(value, torch.Tensor) and can_write_blob(value):
            # (a torch_dist save is a blob per chunk, ~10^4-10^5: torch.save's per-call cost was most of a
            # conversion's time)
            write_tensor_blob(self.fh, value)
        else:  # an object may hold Megatron's classes (placeholders here): pickled back as their globals
            key = _object_key(value)
            blob = self._objects.get(key) if key is not None else None
            if blob is None:
                buf = io.BytesIO()
                torch.save(value, buf, pickle_module=pickling)
                blob = buf.getvalue()
                if key is not None and len(self._objects) < 4096:
                    self._objects[key] = blob
            self.fh.write(blob)
        length = self.fh.tell() - start
        self.bytes_written += length
        return start, length

    def put(self, fqn: str, offsets: tuple[int, ...] | None, value: Any) -> Item:
        """Store one chunk (a tensor) or object (``offsets`` None); returns where its bytes are."""
        if offsets is not None and not owns_storage(value):
            value = value.contiguous().clone()  # never a bigger storage
        start, length = self._blob(value)
        return Item(fqn, offsets, start, length)

    def chunk(self, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], tensor: torch.Tensor,
              plan: TensorPlan | None = None, as_float: bool = False, rows: tuple[int, int] | None = None) -> None:
        self.items.append(self.put(fqn, offsets, tensor))
        known = self.tensors.setdefault(fqn, (global_shape, tensor.dtype, []))
        known[2].append((offsets, tuple(tensor.shape)))
        if plan is not None:
            self.planned.append((fqn, offsets, tuple(tensor.shape), plan, as_float, rows))

    def obj(self, fqn: str, value: Any) -> None:
        self.items.append(self.put(fqn, None, [value]))  # Megatron saves a sharded object in a one-element list
        self.objects.add(fqn)

    def close(self) -> None:
        self.fh.commit()
        self.fh.close()

    def metadata(self) -> Any:
        # deferred: torch's DCP only when writing torch_dist
        from torch.distributed.checkpoint import metadata as md
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        state: dict[str, Any] = {}
        for fqn, (shape, dtype, chunks) in self.tensors.items():
            state[fqn] = md.TensorStorageMetadata(
                properties=md.TensorProperties(dtype=dtype), size=torch.Size(shape),
                chunks=[md.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])
        for fqn in self.objects:
            state[fqn] = md.BytesStorageMetadata()
        storage = {md.MetadataIndex(it.fqn, torch.Size(it.offsets) if it.offsets is not None else None):
                   _StorageInfo(it.file, it.start, it.length) for it in self.items}
        return md.Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage)


# the extra states Megatron's torch_dist does not save: the output layer's (None), and Transformer Engine attention's
# (the reader makes it again from the layer's linear_proj extra state)
_UNSAVED_EXTRA_STATE = ("output_layer._extra_state", ATTENTION_EXTRA)


@dataclass(frozen=True)
class DistPlace:
    """Where a global tensor (or a module's extra state) lies in a torch_dist checkpoint: its global name, its index in
    the stacked dims (layer, then expert) and their sizes."""

    fqn: str
    lead: tuple[int, ...] = ()
    lead_shape: tuple[int, ...] = ()
    rows: tuple[int, int] | None = None  # a section of a sectioned tensor: its rows (a global tensor of its own)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t[self.rows[0]:self.rows[1]]


def _sections(name: str, parts: tuple[int, ...], lead: tuple[int, ...], lead_shape: tuple[int, ...]
              ) -> list[DistPlace] | None:
    """A HybridModel sectioned tensor's places: one global tensor per section (``<name>.<section>``), None when
    ``name`` is not one."""
    for dist, (sections, legacy) in SECTIONED.items():
        for saved in (dist, legacy):  # main's legacy name of the Mamba conv, or the older one torch_dist keeps
            if name.endswith("." + saved) and len(sections) == len(parts):
                return _section_places(name[: -len(saved)] + dist, sections, parts, lead, lead_shape)
    return None


def _section_places(base: str, sections: tuple[str, ...], parts: tuple[int, ...], lead: tuple[int, ...],
                    lead_shape: tuple[int, ...]) -> list[DistPlace]:
    out, start = [], 0
    for section, size in zip(sections, parts, strict=True):
        out.append(DistPlace(f"{base}.{section}", lead, lead_shape, (start, start + size)))
        start += size
    return out


def dist_places(tp: TensorPlan, *, local_spec: bool, stacked: bool, num_layers: int, num_experts: int,
                hybrid: bool = False, parts: tuple[int, ...] = ()) -> list[DistPlace]:
    """Where Megatron's torch_dist keeps the planned global tensor ``tp`` (the one rank of TP1·PP1·EP1): decoder layers
    stacked (``decoder.layers.<name>``) or per layer (``decoder.layers.<g>.<name>``), experts stacked under
    ``mlp.experts.experts.``, an MTP layer's transformer layer as ``transformer_layer``. None for an extra state
    Megatron does not save; one per expert for the extra state of Transformer Engine's grouped experts (one module per
    layer in the legacy file, one sharded object per expert in torch_dist). A HybridModel (``hybrid``) keeps its MTP
    stack's ``mtp_model_layer`` and saves each section of a sectioned tensor (``parts``) as a global tensor."""
    name = (lambda key: key) if hybrid else torch_dist_name
    gkey = tp.gkey
    if gkey is None:  # not a model tensor of a layer or expert: under its own name
        return [DistPlace(tp.key)]
    if tp.key.endswith(ATTENTION_EXTRA if hybrid else _UNSAVED_EXTRA_STATE):  # (a HybridModel saves its head's)
        return []
    if gkey.layer is not None:
        head = "decoder.layers." if stacked else f"decoder.layers.{gkey.layer}."
        lead, lead_shape = ((gkey.layer,), (num_layers,)) if stacked else ((), ())
        inner = gkey.suffix if gkey.expert is not None else dist_suffix(gkey.suffix, local_spec)
    else:
        info = parse_key(tp.key)
        if not info.head:  # embeddings, final norm, output layer, an MTP layer's norms and eh_proj
            return [DistPlace(tp.key)]
        head, lead, lead_shape, inner = info.head, (), (), info.suffix
    if gkey.expert is not None:
        return [DistPlace(name(head + EXPERTS + inner), lead + (gkey.expert,), lead_shape + (num_experts,))]
    if inner.startswith(EXPERTS_MODULE) and inner.endswith("_extra_state"):
        fqn = name(head + EXPERTS + inner[len(EXPERTS_MODULE):])
        return [DistPlace(fqn, lead + (e,), lead_shape + (num_experts,)) for e in range(num_experts)]
    if parts:
        sections = _sections(head + inner, parts, lead, lead_shape)
        if sections is not None:
            return sections
    return [DistPlace(name(head + inner), lead, lead_shape)]


# gkey -> (its places, the parameter's plan)
Placement = dict[Any, tuple[list[DistPlace], TensorPlan]]


def write_global_state(g: Resharder, files: SourceFiles, out: ChunkWriter, *, num_layers: int,
                       num_experts: int, tap: Tap | None = None, build: Build = from_sources) -> Placement:
    """Every global tensor of the checkpoint (planned as the one rank of TP1·PP1·EP1), chunk by chunk, each shown to
    ``tap``, and every module's extra state as the sharded objects Megatron saves. Returns where each parameter went
    (its optimizer state goes to the same places)."""
    args = g.layout.saved_args
    local_spec = is_local_spec(args)
    stacked = _homogeneous(args)
    hybrid = hybrid_pattern(args) is not None
    plan = g.plan_for_coords(next(iter(naming.shard_writers(g.tgt).values())), "global")
    placed: Placement = {}
    for tp in plan.tensors:
        gkey = tp.gkey
        if g.tied and tp.key == "output_layer.weight":
            continue  # tied: the embedding is saved once
        rule = g.index[gkey].rule if gkey is not None and gkey in g.index else None
        places = dist_places(tp, local_spec=local_spec, stacked=stacked, num_layers=num_layers,
                             num_experts=num_experts, hybrid=hybrid,
                             parts=rule.parts if rule is not None and rule.kind == "sections" else ())
        if tp.key.endswith("_extra_state"):  # a sharded object per layer (and expert), as Megatron saves it
            value = tp.value if tp.shape is None else build(tp, files)
            for at in places:
                out.obj(object_fqn(at.fqn, at.lead, at.lead_shape), value)
            continue
        if tp.shape is None or not places:
            continue
        t = build(tp, files)
        for at in places:
            piece = at.part(t)
            out.chunk(at.fqn, at.lead_shape + tuple(piece.shape), at.lead + (0,) * piece.dim(),
                      piece.reshape((1,) * len(at.lead) + tuple(piece.shape)), tp, rows=at.rows)
        if tap is not None:
            tap.tensor(tp, 0, t)
        placed[gkey] = (places, tp)
    return placed


def write_optimizer_state(g: Resharder, tgt: Any, distributed: bool, files: SourceFiles, out: ChunkWriter,
                          placed: Placement, tap: Tap | None = None, build: Build = from_sources) -> Any:
    """The optimizer state in model space — the distributed optimizer's ``fully_reshardable`` form (``param``, the
    fp32 master; ``exp_avg``; ``exp_avg_sq``) or the plain optimizer's (``exp_avg``, ``exp_avg_sq``, ``fp32_param``
    for a bf16/fp16 run) — each tensor chunked like its parameter; returns the common state's ``optimizer`` entry
    (param groups laid out for the target's optimizer parts: dense, and expert-parallel when ``tgt`` makes experts
    expert-parallel)."""
    idx = g.optimizer_index
    assert idx is not None
    coords = next(iter(naming.shard_writers(g.tgt).values()))
    step = g.plain_step()
    half = False
    for gkey, fields in idx.fields.items():
        if gkey not in placed:
            continue
        places, param = placed[gkey]
        fqn = places[0].fqn
        master = fields.get(MASTER)
        half = half or master is not None
        kind = idx.kind(idx.membership[gkey])
        moments = {name: fields.get(name) for name in kind.param_fields if name in kind.moments or name in fields}
        unsplit = [n for n, f in fields.items() if n != MASTER and kind.rule(n) != Split.STEP and n not in moments]
        if unsplit:  # (a per-shard matrix: no model-space form to write it in)
            raise PreflightError(f"the {kind.name} optimizer state {unsplit[0]} of {fqn} is a matrix of each shard's "
                                 "own, which torch_dist's model space cannot hold", path=g.layout.iter_dir,
                                 fix="write --ckpt-format torch, or pass --drop-optimizer", code="optimizer")
        if distributed:
            states = {"param": master if master is not None else g.index[gkey], **moments}
        else:
            states = dict(moments)
            if master is not None:
                states["fp32_param"] = master
        for name, entry in states.items():
            if entry is None:
                raise PreflightError(f"no {name} for {fqn} in the optimizer state", path=g.layout.iter_dir,
                                     fix="pass --drop-optimizer", code="optimizer")
            plan = plan_tensor(entry, "optimizer", f"{fqn}#{name}", coords, g.tgt, g.vocab)
            plan.param = param
            t = build(plan, files)
            if distributed and name == "param":
                t = t.float()  # the fp32 master (an fp32 run's weight is its own master)
            for at in places:
                piece = at.part(t)
                out.chunk(f"optimizer.state.{name}.{at.fqn}", at.lead_shape + tuple(piece.shape),
                          at.lead + (0,) * piece.dim(), piece.reshape((1,) * len(at.lead) + tuple(piece.shape)), plan,
                          distributed and name == "param", rows=at.rows)
            if tap is not None:
                tap.tensor(plan, 0, t)
    layout = part_layout(idx, tgt)
    # a fused Adam (TE's or apex's FusedAdam) keeps its step in each param group, torch's Adam per parameter (saved
    # once, as the plain optimizer's common_step); the distributed optimizer keeps it in the groups for either
    fused = family_of([idx.settings[s] for s in idx.order]) == FUSED
    parts = []
    for is_expert, sigs in layout:
        groups = []
        for sig in sigs:
            settings = {k: v for k, v in idx.settings[sig].items() if k not in ("params", "step")}
            settings["is_expert_parallel"] = is_expert
            if distributed:
                settings["step"] = step
            elif fused:
                settings["step"] = int(step)
            groups.append(settings)
        if distributed:
            parts.append({"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"})
        else:
            # torch's Adam (and SOAP) count steps per parameter: saved once per part, as common_step
            counted = not fused and bool(sigs) and "step" in idx.kind(sigs[0]).fields
            inner = {"state": {"common_step": torch.tensor(step)}, "param_groups": groups} if counted else \
                {"param_groups": groups}
            if half:
                part = {"optimizer": inner}
                for k, v in idx.template.outer.items():
                    if k not in ("optimizer", "fp32_from_fp16_params"):
                        part[k] = files.materialize(idx.template_shard, v)  # an fp16 run's grad scaler
                parts.append(part)
            else:
                parts.append(inner)
    return {i: p for i, p in enumerate(parts)} if len(parts) > 1 else parts[0]


def verify_written(iter_out: str, out: ChunkWriter, files: SourceFiles, *, raw: bool = False) -> int:
    """Re-read every written chunk through the torch_dist reader (``raw``: by the names written, not seen through
    torch_dist's) and compare it with its source slices, read again (crc32 of the bytes). Returns the number of chunks
    checked; raises on any difference."""
    reader = dist_reader(iter_out, raw=raw)
    try:
        for fqn, offsets, sizes, plan, as_float, rows in out.planned:
            want = from_sources(plan, files)
            if as_float:
                want = want.float()
            if rows is not None:
                want = want[rows[0]:rows[1]]
            got = reader.region(fqn, offsets, sizes, want.dtype)
            a = zlib.crc32(got.contiguous().view(torch.uint8).numpy().tobytes())
            b = zlib.crc32(want.reshape(sizes).contiguous().view(torch.uint8).numpy().tobytes())
            if a != b:
                raise PreflightError(f"verify: the written chunk of {fqn} at {offsets} differs from its source slices",
                                     path=os.path.join(iter_out, DATA_FILE), code="verify")
    finally:
        reader.close()
    return len(out.planned)


def global_resharders(src: str | CheckpointIndex, target: TargetLayout, *, iteration: Any = None,
                      trust: bool = False, keep_optimizer: bool = True) -> tuple[Resharder, Resharder, bool]:
    """(the resharder at ``target``, the one that plans the global tensors, whether the optimizer state is carried).
    The global tensors are the one rank of TP1·PP1·EP1 (the optimizer state in the plain form, the one that keeps
    fp32 masters and moments per parameter), the vocab padded for the target's TP (as a run at that TP builds it)."""
    index = open_index(src, iteration=iteration, trust_checkpoint=trust)  # one index for both resharders
    r = open_resharder(index, target, keep_optimizer=keep_optimizer)
    carry = keep_optimizer and r.writes_optimizer
    divisible = (target.make_vocab_size_divisible_by
                 or int(getattr(r.layout.saved_args, "make_vocab_size_divisible_by", VOCAB_DIVISOR) or VOCAB_DIVISOR)) * r.tgt.tp
    g = open_resharder(index, TargetLayout(tp=1, pp=1, ep=1, etp=1, padded_vocab_size=r.padded_vocab,
                                         vocab_size=target.vocab_size, make_vocab_size_divisible_by=divisible,
                                         distributed_optimizer=False),
                       keep_optimizer=carry)
    return r, g, carry


def write_torch_dist(src: str | CheckpointIndex, iter_out: str, target: TargetLayout, *, iteration: Any = None,
                     trust: bool = False, keep_optimizer: bool = True, verify: bool = False,
                     tapping: Tapping | None = None, writer: Callable[[str], ChunkWriter] = ChunkWriter,
                     build: Build = from_sources) -> tuple[int, int, int, Any]:
    """Write the torch_dist form of ``src`` into the iteration dir ``iter_out`` (made by the caller, inside its
    temp destination). ``target`` sets the args (and so the vocab padding and the optimizer's kind and parts) the
    checkpoint records; ``writer`` and ``build`` say where chunks go and how their values are made (a hollow
    benchmark checkpoint changes both). Returns (bytes read, bytes written, chunks verified, the tap's result)."""
    r, g, carry = global_resharders(src, target, iteration=iteration, trust=trust, keep_optimizer=keep_optimizer)
    tap = tapping.open(g, next(iter(naming.shard_writers(g.tgt).values()))) if tapping is not None else None
    if g.layout.saved_args is None:
        raise PreflightError("the checkpoint has no saved args; a torch_dist checkpoint must record them",
                             path=g.layout.iter_dir, fix="convert a checkpoint saved by Megatron-LM", code="format")
    if carry and g.optimizer_index is None:
        raise PreflightError("the optimizer state could not be indexed in the plain form"
                             + (f" ({g.optimizer_problem.message})" if g.optimizer_problem else ""),
                             path=g.layout.iter_dir, fix="pass --drop-optimizer", code="optimizer")
    files = SourceFiles(g.layout.iter_dir or "", trust=trust)
    out = writer(iter_out)
    optimizer = None
    try:
        placed = write_global_state(g, files, out, num_layers=g.src.num_layers or 0,
                                    num_experts=g.src.num_experts or 0, tap=tap, build=build)
        if carry:
            optimizer = write_optimizer_state(g, r.tgt, r.target_distributed, files, out, placed, tap, build)
    finally:
        out.close()
    with open(os.path.join(iter_out, ".metadata"), "wb") as fh:
        pickle.dump(out.metadata(), fh)
        fh.flush()
        os.fsync(fh.fileno())
    read = files.bytes_read
    checked = verify_written(iter_out, out, files) if verify else 0
    header = r.header()
    args = header.get("args")
    args.ckpt_format = "torch_dist"
    args.no_save_optim = not carry
    args.no_save_rng = True
    if carry:
        args.use_distributed_optimizer = r.target_distributed
    common: dict[str, Any] = {"args": args}
    for key in TO_TORCH_DIST:  # materialised by header()
        if key in header:
            common[key] = header[key]
    if optimizer is not None:
        common["optimizer"] = optimizer
    files.close()
    content: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if carry and r.target_distributed:
        content.update(distrib_optim_sharding_type="fully_reshardable",
                       distrib_optim_fully_reshardable_mem_efficient=False)
    common["content_metadata"] = content
    torch.save(common, os.path.join(iter_out, "common.pt"), pickle_module=pickling)
    with open(os.path.join(iter_out, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, fh)
    for name in ("common.pt", "metadata.json"):  # durable before the caller's rename, like every shard file
        with open(os.path.join(iter_out, name), "rb+") as fh:
            os.fsync(fh.fileno())
    return read, out.bytes_written + sum(os.path.getsize(os.path.join(iter_out, n))
                                         for n in (".metadata", "common.pt", "metadata.json")), checked, \
        tap.result() if tap is not None else None


def _hashed_writer(iter_dir: str) -> ChunkWriter:
    """The offline target's writer: its data file hashed as written (the target writes integrity.json)."""
    return ChunkWriter(iter_dir, hashed=True)


class TorchDistTarget(MegatronDirs):
    """``--ckpt-format torch_dist``: one unit, the checkpoint's global state (every tensor chunk by chunk)."""

    integrity = True

    unit = "torch_dist"

    def units(self, r: Resharder) -> list[str]:
        return [self.unit]

    def weights(self, r: Resharder) -> dict[str, int]:
        return {self.unit: 1}

    def write(self, r: Resharder, unit: str, iter_out: str, verify: bool, tapping: Tapping | None = None
              ) -> ShardResult:
        read, written, checked, tapped = write_torch_dist(r.checkpoint, iter_out, r.target,
                                                          keep_optimizer=r.keep_optimizer, verify=verify,
                                                          tapping=tapping, writer=_hashed_writer)
        return ShardResult(read, written, checked, 0, tapped)
