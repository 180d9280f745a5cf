"""The in-memory loader of a Megatron-FSDP run (``--use-megatron-fsdp``) given a torch_dist or legacy checkpoint:
stands in for Megatron's ``_load_base_checkpoint`` and serves the checkpoint's fsdp_dtensor form
(:func:`megatron_preflight.reshard.targets.fsdp_dtensor.fsdp_state`: the same names, tensors and bytes items the
offline conversion writes) to torch DCP's own load through a :class:`StorageReader` whose "storage" is the resharder.
Megatron-FSDP's state dict, its preprocessing (SwiGLU halves, experts, MTP names), DCP's load planner and every step
after the load are Megatron's and torch's own; only the bytes come from the source instead of an fsdp_dtensor file.

Each rank builds every global tensor it holds a shard of (Megatron-FSDP shards every parameter over the data-parallel
ranks), one at a time, and copies its slices: every rank reads the whole checkpoint once. The offline conversion
(``reshard --ckpt-format fsdp_dtensor``) reads it once in all.
"""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from megatron_preflight import pickling
from megatron_preflight.hook import legacy_load, remote_load
from megatron_preflight.hook.state import STATE
from megatron_preflight.reshard.sources.fsdp_dtensor import aliases
from megatron_preflight.reshard.targets.fsdp_dtensor import FsdpState, fsdp_state

log = logging.getLogger("megatron_preflight")


class ResharderReader(StorageReader):
    """A torch DCP storage reader that serves a checkpoint's fsdp_dtensor form from the resharder (see the module
    doc): every tensor one chunk at its global shape, built when first asked for and dropped after its reads."""

    def __init__(self, state: FsdpState) -> None:
        super().__init__()
        self.state = state
        # each entry under every name a Megatron release may ask it by (an MTP layer's: see sources.fsdp_dtensor)
        self.by_fqn = {name: e for e in state.tensors for name in (e.fqn, *aliases(e.fqn))}
        self.objects = {name: v for fqn, v in state.objects.items() for name in (fqn, *aliases(fqn))}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        sd: dict[str, Any] = {}
        for fqn, e in self.by_fqn.items():
            sd[fqn] = md.TensorStorageMetadata(
                properties=md.TensorProperties(dtype=e.dtype), size=torch.Size(e.shape),
                chunks=[md.ChunkStorageMetadata(offsets=torch.Size((0,) * len(e.shape)), sizes=torch.Size(e.shape))])
        for fqn in self.objects:
            sd[fqn] = md.BytesStorageMetadata()
        return md.Metadata(state_dict_metadata=sd)

    def set_up_storage_reader(self, metadata: md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        by_fqn: dict[str, list[Any]] = {}
        for item in plan.items:
            by_fqn.setdefault(item.storage_index.fqn, []).append(item)
        for fqn, items in by_fqn.items():
            if items[0].type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self.objects[fqn], buf, pickle_module=pickling)
                for item in items:
                    planner.load_bytes(item, io.BytesIO(buf.getvalue()))
                continue
            whole = self.by_fqn[fqn].make()
            for item in items:
                piece = whole[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))]
                target = planner.resolve_tensor(item).detach()
                target.copy_(piece)
                planner.commit_tensor(item, target)
            del whole
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def state_for(load_dir: str, args: Any) -> FsdpState:
    """This process's fsdp_dtensor form of the checkpoint (the shared index, read once by rank 0; an ``msc://`` one
    staged whole on each node first: hook/remote_load.py)."""
    load_dir = remote_load.local_dir(load_dir, whole=True)
    key = ("fsdp", os.path.abspath(load_dir))
    if key not in STATE.resharders:
        iteration = getattr(args, "ckpt_step", None)
        trust = bool(getattr(args, "preflight_trust_checkpoint", False))
        keep = legacy_load.keep_optimizer(args)
        index = legacy_load.shared_index(load_dir, iteration, trust, keep)
        half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))  # (the run's wrappers name the state)
        STATE.resharders[key] = fsdp_state(index, legacy_load.target_from_args(args), keep_optimizer=keep, half=half)
    return STATE.resharders[key]


def fsdp_base(load_dir: str, args: Any, *, rank0: bool = False, sharded_state_dict: Any = None,
              checkpointing: Any = None) -> tuple[dict[str, Any], str, bool]:
    """(state_dict, a checkpoint name for Megatron's messages, release) as Megatron's fsdp_dtensor branch of
    ``_load_base_checkpoint`` returns them, served from the checkpoint's fsdp_dtensor form. ``checkpointing``: the
    running Megatron's checkpointing module (its state-dict preprocessing is used as is)."""
    from torch.distributed.checkpoint import default_planner  # (torch's DCP: only in a Megatron-FSDP job)

    state = state_for(load_dir, args)
    name = remote_load.shown(os.path.join(remote_load.local_dir(load_dir), "<served as fsdp_dtensor by "
                                                                           "megatron-preflight>"))
    if rank0:  # the format pre-read: args, iteration and the version
        return {k: state.objects.get(k) for k in ("args", "iteration", "checkpoint_version")}, name, False
    started = time.perf_counter()
    sd = sharded_state_dict
    raw_optimizer = sd["optimizer"].copy() if "optimizer" in sd else None
    raw_model = sd["model"].copy() if "model" in sd else None
    model = sd.pop("_model")
    sd = checkpointing.preprocess_fsdp_dtensor_state_dict(args, sd, model[0])
    planner = default_planner.DefaultLoadPlanner(allow_partial_load=True)  # (what the checkpoint lacks: RNG)
    torch.distributed.checkpoint.load_state_dict(state_dict=sd, storage_reader=ResharderReader(state), planner=planner)
    if raw_optimizer is not None:
        sd["optimizer"] = raw_optimizer
    if raw_model is not None:
        sd["model"] = raw_model
    STATE.seconds["build"] = STATE.seconds.get("build", 0.0) + time.perf_counter() - started
    log.info("served the checkpoint as fsdp_dtensor: %d tensors", len(state.tensors))
    return sd, name, False

