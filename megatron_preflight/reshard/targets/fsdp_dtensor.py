"""Write an ``fsdp_dtensor`` checkpoint (Megatron-FSDP, ``--use-megatron-fsdp --ckpt-format fsdp_dtensor``) from any
checkpoint the resharder reads: the way from 3D parallelism to Megatron-FSDP.

Like torch_dist, an fsdp_dtensor save is a torch DCP directory whose tensors are stored whole, by their global shape,
so the global tensors are planned as the one rank of TP1·PP1·EP1 (:func:`.torch_dist.global_resharders`) and
written streamed, one chunk each, into ``__0_0.distcp`` with the ``.metadata`` that indexes them (Megatron-FSDP's load
reads any chunking). What differs is the naming and the optimizer state (the facts are
:mod:`megatron_preflight.reshard.sources.fsdp_dtensor`'s, the reader of this format):

* parameters as ``model.module.<name>``, one tensor per decoder layer and per expert (global index); SwiGLU's fc1 as
  two tensors ``<param>_w`` / ``<param>_v`` (its ``[gate; up]`` halves); no Transformer Engine extra state; under
  bf16 / fp16 the fp32 main parameters (the optimizer's masters), as Megatron-FSDP saves them;
* the Adam moments as ``optimizer.state.<prefix><name>.exp_avg`` / ``.exp_avg_sq`` (prefix ``module.module.``, one
  ``module.`` more under bf16 / fp16: the Float16Module wrapper), and each parameter's group settings and step as
  bytes items ``optimizer.param_to_group_meta.<prefix><name>.<setting>`` (SwiGLU's fc1 under its module name, whole);
* ``args`` (rewritten: ``--use-megatron-fsdp``, ``--ckpt-format fsdp_dtensor``), ``iteration``,
  ``checkpoint_version``, the scheduler's fields as ``opt_param_scheduler.<field>``, and the FLOPs counter, each a
  bytes item. RNG states are not written (resume with ``--no-load-rng``): a 3D layout's per-rank RNG does not map onto
  Megatron-FSDP's ranks.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming, optimizer_kinds
from megatron_preflight.layout.dist import FSDP_OPTIMIZER_STATE
from megatron_preflight.reshard.optimizer.plain import MASTER
from megatron_preflight.reshard.plan.planner import plan_tensor
from megatron_preflight.reshard.plan.rules import torch_dist_name
from megatron_preflight.reshard.plan.types import TensorPlan
from megatron_preflight.reshard.resharder import Resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.sources.fsdp_dtensor import (
    GROUP_META,
    MODEL_PREFIX,
    aliases,
    saved_names,
    state_prefix,
)
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets.torch_dist import (
    Build,
    ChunkWriter,
    TorchDistTarget,
    from_sources,
    global_resharders,
    verify_written,
)
from megatron_preflight.reshard.targets.unit import ShardResult, Tapping

# each parameter's group settings, as Megatron-FSDP saves them (a setting the source's groups lack: its default)
GROUP_SETTINGS: dict[str, Any] = {
    "is_expert_parallel": False, "default_config": True, "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
    "max_lr": None, "min_lr": None, "lr": None, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
    "weight_decay": 0.0, "step": 0,
}


def _names(key: str, glu: bool) -> list[tuple[str, int | None]]:
    """The fsdp_dtensor names of a TP1 model key, with the half of its rows each takes (SwiGLU's fc1)."""
    return saved_names(torch_dist_name(key), glu)  # (an MTP layer's transformer layer under its on-disk name)


def _halves(t: torch.Tensor, half: int | None) -> torch.Tensor:
    if half is None:
        return t
    n = t.shape[0] // 2
    return t[half * n:(half + 1) * n]


def _object(out: ChunkWriter, fqn: str, value: Any) -> None:
    """A bytes item: ``torch.save`` of the value itself (Megatron-FSDP's common state is not wrapped in a list)."""
    out.items.append(out.put(fqn, None, value))
    out.objects.add(fqn)


@dataclass
class TensorEntry:
    """One tensor of the fsdp_dtensor form, made on demand: its name, global shape, dtype, and how it is built."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]
    plan: TensorPlan | None = None  # the source plan it equals as is (for --verify)


@dataclass
class FsdpState:
    """The whole fsdp_dtensor form of a checkpoint: its tensors (built on demand) and its bytes items."""

    tensors: list[TensorEntry]
    objects: dict[str, Any]
    files: SourceFiles
    carry: bool


def fsdp_state(src: Any, target: TargetLayout, *, iteration: Any = None, trust: bool = False,
               keep_optimizer: bool = True, build: Build = from_sources, half: bool | None = None) -> FsdpState:
    """The fsdp_dtensor form of ``src`` (a path or a CheckpointIndex) for a Megatron-FSDP run at ``target``: what the
    writer writes and the hook's in-memory loader serves (nothing is read until a tensor is made). ``half``: whether
    the run is bf16 / fp16 (its optimizer state's names follow its wrappers); None: as the source was saved."""
    r, g, carry = global_resharders(src, target, iteration=iteration, trust=trust, keep_optimizer=keep_optimizer)
    args = g.layout.saved_args
    if args is None:
        raise PreflightError("the checkpoint has no saved args; an fsdp_dtensor checkpoint must record them",
                             path=g.layout.iter_dir, fix="convert a checkpoint saved by Megatron-LM", code="format")
    if carry and g.optimizer_index is None:
        raise PreflightError("the optimizer state could not be indexed in the plain form"
                             + (f" ({g.optimizer_problem.message})" if g.optimizer_problem else ""),
                             path=g.layout.iter_dir, fix="pass --drop-optimizer", code="optimizer")
    if half is None:
        half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    glu = parallel.gated_mlp(args)
    files = SourceFiles(g.layout.iter_dir or "", trust=trust)
    header = r.header(files)
    new_args = header["args"]
    new_args.ckpt_format = "fsdp_dtensor"
    new_args.use_megatron_fsdp = True
    new_args.use_distributed_optimizer = True  # (Megatron-FSDP shards the optimizer state itself)
    new_args.no_save_optim = not carry
    new_args.no_save_rng = True
    if not getattr(new_args, "data_parallel_sharding_strategy", None):
        new_args.data_parallel_sharding_strategy = "optim_grads_params"
    objects: dict[str, Any] = {"args": new_args}
    for key in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
        if key in header:
            objects[key] = header[key]
    scheduler = header.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        objects.update({f"opt_param_scheduler.{k}": v for k, v in scheduler.items()})
    tensors = _entries(g, files, objects, half=half, glu=glu, carry=carry, build=build)
    return FsdpState(tensors, objects, files, carry)


def write_fsdp_dtensor(src: Any, iter_out: str, target: TargetLayout, *, iteration: Any = None, trust: bool = False,
                       keep_optimizer: bool = True, verify: bool = False,
                       writer: Callable[[str], ChunkWriter] = ChunkWriter, build: Build = from_sources
                       ) -> tuple[int, int, int]:
    """Write the fsdp_dtensor form of ``src`` into the iteration dir ``iter_out`` (made by the caller, inside its temp
    destination). Returns (bytes read, bytes written, chunks verified)."""
    state = fsdp_state(src, target, iteration=iteration, trust=trust, keep_optimizer=keep_optimizer, build=build)
    files = state.files
    out = writer(iter_out)
    try:
        for e in state.tensors:
            t = e.make()
            out.chunk(e.fqn, e.shape, (0,) * t.dim(), t, e.plan)
        for fqn, value in state.objects.items():
            _object(out, fqn, value)
    finally:
        out.close()
    with open(os.path.join(iter_out, ".metadata"), "wb") as meta:
        pickle.dump(_with_aliases(out.metadata()), meta)
        meta.flush()
        os.fsync(meta.fileno())
    read = files.bytes_read
    checked = verify_written(iter_out, out, files, raw=True) if verify else 0
    files.close()
    return read, out.bytes_written + os.path.getsize(os.path.join(iter_out, ".metadata")), checked


def _with_aliases(meta: Any) -> Any:
    """``meta`` with every entry that has other names (:func:`aliases`) indexed under them too, at the same bytes."""
    from torch.distributed.checkpoint.metadata import MetadataIndex  # (torch's DCP: only when writing)

    state = meta.state_dict_metadata
    for fqn in list(state):
        for alias in aliases(fqn):
            state.setdefault(alias, state[fqn])
    for index, info in list(meta.storage_data.items()):
        for alias in aliases(index.fqn):
            meta.storage_data.setdefault(MetadataIndex(alias, index.offset, index.index), info)
    return meta


class _Last:
    """The last tensor built, by key: SwiGLU's two halves (and a parameter's fields) build their whole once."""

    def __init__(self) -> None:
        self.key: Any = None
        self.value: torch.Tensor | None = None

    def get(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.key != key or self.value is None:
            self.key, self.value = key, make()
        return self.value


def _entries(g: Resharder, files: SourceFiles, objects: dict[str, Any], *, half: bool, glu: bool, carry: bool,
             build: Build) -> list[TensorEntry]:
    """Every parameter (fp32: under bf16 / fp16 the optimizer's master) and its Adam moments as tensor entries; each
    parameter's group settings into ``objects``."""
    idx = g.optimizer_index if carry else None
    coords = next(iter(naming.shard_writers(g.tgt).values()))
    plan = g.plan_for_coords(coords, "global")
    step = g.plain_step() if idx is not None else None
    prefix = state_prefix(half)
    last = _Last()
    out: list[TensorEntry] = []
    for tp in plan.tensors:
        if tp.shape is None or tp.key.endswith("_extra_state") or (g.tied and tp.key == "output_layer.weight"):
            continue
        fields = idx.fields.get(tp.gkey, {}) if idx is not None and tp.gkey is not None else {}
        master = fields.get(MASTER)
        names = _names(tp.key, glu)

        def param(tp: TensorPlan = tp, master: Any = master) -> torch.Tensor:
            value = _built(g, master, tp, files, coords, "master", build) if master is not None else build(tp, files)
            return value.float()  # Megatron-FSDP's main parameters are fp32

        for name, part in names:
            out.append(TensorEntry(MODEL_PREFIX + name, _half_shape(tp.shape, part), torch.float32,
                                   _part(last, (tp.key, "param"), param, part),
                                   tp if part is None and master is None and not half else None))
        if idx is None or tp.gkey not in idx.membership:
            continue
        for field in optimizer_kinds.DISTRIBUTED.distributed_fields:  # (Megatron-FSDP's optimizer: Adam)
            entry = fields.get(field)
            if entry is None:
                raise PreflightError(f"no {field} for {tp.key} in the optimizer state", path=g.layout.iter_dir,
                                     fix="pass --drop-optimizer", code="optimizer")

            def moment(tp: TensorPlan = tp, entry: Any = entry, field: str = field) -> torch.Tensor:
                return _built(g, entry, tp, files, coords, field, build)

            for name, part in names:
                out.append(TensorEntry(f"{FSDP_OPTIMIZER_STATE}{prefix}{name}.{field}", _half_shape(tp.shape, part),
                                       torch.float32, _part(last, (tp.key, field), moment, part)))
        settings = dict(GROUP_SETTINGS)
        settings.update({k: v for k, v in idx.settings[idx.membership[tp.gkey]].items() if k in GROUP_SETTINGS})
        settings["step"] = int(step) if step is not None else int(settings.get("step") or 0)
        settings["is_expert_parallel"] = False  # (Megatron-FSDP: experts sit with the dense parameters at EP1)
        name = torch_dist_name(tp.key)  # (the settings are the module's parameter's: SwiGLU's fc1 not split)
        for setting, v in settings.items():
            objects[f"{GROUP_META}{prefix}{name}.{setting}"] = v
    return out


def _half_shape(shape: tuple[int, ...] | None, half: int | None) -> tuple[int, ...]:
    assert shape is not None
    return shape if half is None else (shape[0] // 2, *shape[1:])


def _part(last: _Last, key: Any, make: Callable[[], torch.Tensor], half: int | None) -> Callable[[], torch.Tensor]:
    return lambda: _halves(last.get(key, make), half)


def _built(g: Resharder, entry: Any, param: TensorPlan, files: SourceFiles, coords: dict[str, int], what: str,
           build: Build) -> torch.Tensor:
    """An optimizer field of ``param`` (a global entry, or a piece carried whole), built."""
    plan = plan_tensor(entry, "optimizer", f"{param.key}#{what}", coords, g.tgt, g.vocab)
    plan.param = param
    return build(plan, files)


class FsdpDtensorTarget(TorchDistTarget):
    """``--ckpt-format fsdp_dtensor``: one unit, the checkpoint's global state (every tensor chunk by chunk)."""

    unit = "fsdp_dtensor"

    def write(self, r: Resharder, unit: str, iter_out: str, verify: bool, tapping: Tapping | None = None
              ) -> ShardResult:
        read, written, checked = write_fsdp_dtensor(r.checkpoint, iter_out, r.target, keep_optimizer=r.keep_optimizer,
                                                    verify=verify)
        return ShardResult(read, written, checked, 0, None)
