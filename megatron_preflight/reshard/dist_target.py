"""Write a torch_dist checkpoint (Megatron's default format) from any checkpoint the resharder reads: the way off the
legacy format, and the format whose loader reshards by itself.

A torch_dist checkpoint does not depend on the layout that wrote it: each tensor is stored whole, by its global shape,
with decoder layers stacked along a leading dim (experts along the next one), or per layer (``decoder.layers.<g>.``)
for models whose layers differ (``--moe-layer-freq`` patterns). So the global tensors are planned as the one rank of a
TP1·PP1·EP1 layout — the same plans, validation and split rules as every reshard — and written streamed, one chunk per
layer (and expert): a ``torch.save`` blob per chunk appended to ``__0_0.distcp``, then ``.metadata`` (PyTorch DCP's
index of every chunk's byte range), ``common.pt`` (args, iteration, scheduler) and ``metadata.json``.

Megatron reshards the weights of such a checkpoint at load time, to any layout. Weights only for now: the args say
``no_save_optim`` (start with ``--no-load-optim``), and RNG states are not written (``--no-load-rng``).
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_preflight import pickling
from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.api import Resharder, TargetLayout, open_resharder
from megatron_preflight.reshard.dist_source import LOCAL_SPEC_KEYS
from megatron_preflight.reshard.executor import SourceFiles, build_tensor
from megatron_preflight.reshard.planner import TensorPlan

log = logging.getLogger(__name__)

DATA_FILE = "__0_0.distcp"
COMMON_CARRIED = ("checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far",
                  "tokens_so_far")


@dataclass
class Item:
    """One chunk written: the global tensor (or object) it belongs to and where its bytes are."""

    fqn: str
    offsets: tuple[int, ...] | None  # None: a bytes item (an object)
    start: int
    length: int


def _dist_suffix(suffix: str, local_spec: bool) -> str:
    if local_spec:
        for module, saved in LOCAL_SPEC_KEYS.items():
            if suffix.startswith(module):
                return saved + suffix[len(module):]
    return suffix


def _homogeneous(args: Any) -> bool:
    """Whether Megatron stacks the layers (all layers alike), or keys them per layer."""
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return len(set(freq)) <= 1
    if isinstance(freq, str):
        return False
    return getattr(args, "heterogeneous_layers_config_path", None) is None and \
        getattr(args, "heterogeneous_layers_config_encoded_json", None) is None


class _Writer:
    def __init__(self, path: str) -> None:
        self.fh = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.items: list[Item] = []
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
        self.objects: set[str] = set()
        self.bytes_written = 0

    def _blob(self, value: Any) -> tuple[int, int]:
        buf = io.BytesIO()
        torch.save(value, buf, pickle_module=pickling)
        data = buf.getbuffer()
        start = self.fh.tell()
        self.fh.write(data)
        self.bytes_written += len(data)
        return start, len(data)

    def chunk(self, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], tensor: torch.Tensor) -> None:
        start, length = self._blob(tensor.contiguous().clone())
        self.items.append(Item(fqn, offsets, start, length))
        known = self.tensors.setdefault(fqn, (global_shape, tensor.dtype, []))
        known[2].append((offsets, tuple(tensor.shape)))

    def obj(self, fqn: str, value: Any) -> None:
        start, length = self._blob([value])  # Megatron saves a sharded object wrapped in a one-element list
        self.items.append(Item(fqn, None, start, length))
        self.objects.add(fqn)

    def close(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()

    def metadata(self) -> Any:
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
                   _StorageInfo(DATA_FILE, it.start, it.length) for it in self.items}
        return md.Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage)


def _layer_fqn(plan: TensorPlan, local_spec: bool, stacked: bool) -> tuple[str, bool]:
    """The torch_dist name of a layer tensor (and whether it is an expert's): ``decoder.layers.<name>`` stacked, or
    ``decoder.layers.<g>.<name>``."""
    gkey = plan.gkey
    assert gkey is not None and gkey.layer is not None
    head = "decoder.layers." if stacked else f"decoder.layers.{gkey.layer}."
    if gkey.expert is not None:
        return head + "mlp.experts.experts." + gkey.suffix, True
    return head + _dist_suffix(gkey.suffix, local_spec), False


def write_global_state(g: Resharder, files: SourceFiles, out: _Writer, *, num_layers: int, num_experts: int) -> None:
    """Every global tensor of the checkpoint (planned as the one rank of TP1·PP1·EP1), chunk by chunk."""
    args = g.layout.saved_args
    local_spec = getattr(args, "transformer_impl", "transformer_engine") == "local"
    stacked = _homogeneous(args)
    plan = g.plan_for_coords(next(iter(g.tgt.shard_dirs().values())), "global")
    for tp in plan.tensors:
        gkey = tp.gkey
        if gkey is None or gkey.layer is None:  # embeddings, final norm, output layer
            if tp.key.endswith("_extra_state") or tp.shape is None:
                continue  # not saved by Megatron's torch_dist (the output layer's extra state)
            if g.tied and tp.key == "output_layer.weight":
                continue  # tied: the embedding is saved once
            t = build_tensor(tp, files, release=True)
            out.chunk(tp.key, tuple(t.shape), (0,) * t.dim(), t)
            continue
        fqn, expert = _layer_fqn(tp, local_spec, stacked)
        lead: tuple[int, ...] = (gkey.layer,) if stacked else ()
        lead_shape: tuple[int, ...] = (num_layers,) if stacked else ()
        if expert:
            lead, lead_shape = lead + (gkey.expert,), lead_shape + (num_experts,)
        if tp.shape is None:  # a module's extra state: a sharded object per layer (and expert)
            index = ".".join(str(i) for i in lead) or "0"
            count = ".".join(str(n) for n in lead_shape) or "1"
            out.obj(f"{fqn}/shard_{index}_{count}", tp.value)
            continue
        t = build_tensor(tp, files, release=True)
        out.chunk(fqn, lead_shape + tuple(t.shape), lead + (0,) * t.dim(), t.reshape((1,) * len(lead) + tuple(t.shape)))


def write_torch_dist(src: str, iter_out: str, target: TargetLayout, *, iteration: Any = None,
                     trust: bool = False) -> tuple[int, int]:
    """Write the torch_dist form of ``src`` into the iteration dir ``iter_out`` (made by the caller, inside its
    temp destination). ``target`` sets the args (and so the vocab padding) the checkpoint records. Returns (bytes
    read, bytes written)."""
    r = open_resharder(src, target, iteration=iteration, trust_checkpoint=trust, keep_optimizer=False)
    g = open_resharder(r.layout, TargetLayout(tp=1, pp=1, ep=1, etp=1, padded_vocab_size=r.padded_vocab),
                       trust_checkpoint=trust, keep_optimizer=False)
    if g.layout.saved_args is None:
        raise PreflightError("the checkpoint has no saved args; a torch_dist checkpoint must record them",
                             path=g.layout.iter_dir, fix="convert a checkpoint saved by Megatron-LM", code="format")
    files = SourceFiles(g.layout.iter_dir or "", trust=trust)
    out = _Writer(os.path.join(iter_out, DATA_FILE))
    try:
        write_global_state(g, files, out, num_layers=g.src.num_layers or 0, num_experts=g.src.num_experts or 0)
    finally:
        out.close()
        files.close()
    with open(os.path.join(iter_out, ".metadata"), "wb") as fh:
        import pickle

        pickle.dump(out.metadata(), fh)
    header = r.header()
    common: dict[str, Any] = {"args": header.get("args")}
    common["args"].ckpt_format = "torch_dist"
    common["args"].no_save_optim = True
    common["args"].no_save_rng = True
    for key in COMMON_CARRIED:
        if key in header:
            common[key] = header[key]
    meta = r.layout.shards[0].meta or {}
    if "rerun_state_machine" in meta:
        common["rerun_state_machine"] = meta["rerun_state_machine"]
    common["content_metadata"] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    torch.save(common, os.path.join(iter_out, "common.pt"), pickle_module=pickling)
    with open(os.path.join(iter_out, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, fh)
    return files.bytes_read, out.bytes_written + sum(os.path.getsize(os.path.join(iter_out, n))
                                                     for n in (".metadata", "common.pt", "metadata.json"))
