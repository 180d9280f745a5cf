"""Data describing a discovered checkpoint: its format, layout, shards, saved args and problems."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.parallel import ParallelLayout
from megatron_preflight.placeholders import Placeholder
from megatron_preflight.torch_file import TensorRef


class Format(str, enum.Enum):
    TORCH = "torch"
    TORCH_DIST = "torch_dist"
    ZARR = "zarr"
    FSDP_DTENSOR = "fsdp_dtensor"
    TORCH_DCP = "torch_dcp"
    HF = "hf"  # a Hugging Face model dir (safetensors): read as a TP1 legacy checkpoint, weights only


@dataclass
class Problem:
    """Something wrong with the checkpoint, with the file it concerns and what to do."""

    code: str
    path: str
    message: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        text = self.message.rstrip(".") + "."
        if self.fix:
            text += f" Fix: {self.fix.rstrip('.')}."
        return {"code": self.code, "path": self.path, "message": text}


@dataclass
class Shard:
    """One legacy per-rank dir (``mp_rank_*``)."""

    name: str
    tp_rank: int | None
    pp_rank: int | None
    ep_rank: int | None
    files: dict[str, int] = field(default_factory=dict)  # file name -> bytes
    path: str = ""
    meta: dict[str, Any] | None = None  # the unpickled model_optim_rng.pt, tensors as TensorRef
    dist_meta: Any = None  # the unpickled distrib_optim.pt (tensors as TensorRef), once someone needed it

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "ep_rank": self.ep_rank,
            "files": sorted(self.files),
            "bytes": sum(self.files.values()),
        }


class LazyShard(Shard):
    """A shard whose ``meta`` is made on first read by ``load(name)`` (a torch_dist checkpoint's legacy view: a
    DeepSeek-V3 has 1,024 virtual shards, a verdict reads one per pipeline stage). Assigning ``meta`` sets it."""

    def __init__(self, *, load: Callable[[str], dict[str, Any]], **fields: Any) -> None:
        super().__init__(**fields)
        self._load: Callable[[str], dict[str, Any]] | None = load
        self._meta: dict[str, Any] | None = None

    @property  # type: ignore[override]
    def meta(self) -> dict[str, Any] | None:
        if self._load is not None:
            self._meta, self._load = self._load(self.name), None
        return self._meta

    @meta.setter
    def meta(self, value: dict[str, Any] | None) -> None:
        self._meta, self._load = value, None


@dataclass
class Layout:
    """What a checkpoint root (or iteration dir) holds. ``format`` is None when it is not a Megatron checkpoint."""

    path: str
    root: str | None = None
    iter_dir: str | None = None
    format: Format | None = None
    iteration: int | str | None = None
    tracker_iteration: int | str | None = None
    available_iterations: list[int | str] = field(default_factory=list)
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    dims: str | None = None
    name_pattern: str | None = None
    shards: list[Shard] = field(default_factory=list)
    missing_shards: list[str] = field(default_factory=list)
    stray_shards: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    saved_args: argparse.Namespace | None = None
    sizes_from: str = "args"  # "args" or "names+keys" (args missing)
    distributed_optimizer: bool | None = None
    total_bytes: int = 0
    looks_like: str | None = None  # for non-Megatron dirs
    checkpoint_version: float | None = None
    common_state: dict[str, Any] | None = None  # torch_dist: the non-tensor state
    dist_tensors: dict[str, Any] = field(default_factory=dict)  # torch_dist: key -> (global shape, dtype)
    dist_optimizer_sharding: str | None = None  # torch_dist content_metadata distrib_optim_sharding_type
    parallel: ParallelLayout | None = None  # the layout the sizes above come from (saved args, or names + keys)
    sampled: bool = False  # legacy: only some shard files were parsed (discover(shards="sample"/"auto"))
    consistency_checked: bool = False  # the shards' agreement (reshard.plan.consistency) is in ``problems``

    @property
    def ok(self) -> bool:
        return self.format is not None and not self.problems

    def shard(self, name: str) -> Shard | None:
        for s in self.shards:
            if s.name == name:
                return s
        return None

    def add(self, code: str, path: str, message: str, fix: str = "") -> None:
        self.problems.append(Problem(code, path, message, fix))

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "root": self.root,
            "iter_dir": self.iter_dir,
            "format": self.format.value if self.format else None,
            "iteration": self.iteration,
            "tracker_iteration": self.tracker_iteration,
            "available_iterations": self.available_iterations,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "etp": self.etp,
            "vpp": self.vpp,
            "cp": self.cp,
            "dims": self.dims,
            "name_pattern": self.name_pattern,
            "sizes_from": self.sizes_from,
            "distributed_optimizer": self.distributed_optimizer,
            "dist_optimizer_sharding": self.dist_optimizer_sharding,
            "checkpoint_version": self.checkpoint_version,
            "total_bytes": self.total_bytes,
            "sampled": self.sampled,
            "looks_like": self.looks_like,
            "shards": [s.to_json() for s in self.shards],
            "missing_shards": self.missing_shards,
            "stray_shards": self.stray_shards,
            "problems": [p.to_json() for p in self.problems],
            "notes": self.notes,
            "saved_args": args_to_json(self.saved_args),
            "ok": self.ok,
        }


def to_plain(value: Any) -> Any:
    """A JSON-able rendering of a value found in a checkpoint's args."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if dtypes.is_dtype(value):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Placeholder):
        return value.describe()
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, argparse.Namespace):
        return args_to_json(value)
    if isinstance(value, TensorRef):
        return f"tensor{list(value.shape)} {value.dtype}"
    return str(value)


def args_to_json(args: Any) -> dict[str, Any]:
    if args is None:
        return {}
    items = vars(args) if hasattr(args, "__dict__") else dict(args)
    return {k: to_plain(v) for k, v in sorted(items.items())}
