"""Execute a rank plan: read only the planned source slices (lazily, via mmap) into freshly allocated tensors."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from megatron_preflight import dtypes
from megatron_preflight.layout import naming
from megatron_preflight.reshard.dist_source import DistReader, RegionRef, dist_reader
from megatron_preflight.reshard.planner import RankPlan, TensorPlan
from megatron_preflight.reshard.tree import map_leaves
from megatron_preflight.torch_file import TensorRef, TorchFile

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


class SourceFiles:
    """Open source shard files on demand (one :class:`TorchFile` per shard), and count bytes read."""

    def __init__(self, iter_dir: str, trust: bool = False) -> None:
        self.iter_dir = iter_dir
        self.trust = trust
        self._files: dict[str, TorchFile] = {}
        self._dist: DistReader | None = None  # a torch_dist source's chunks (see dist_source)
        self._last: tuple[RegionRef, torch.Tensor] | None = None
        self.bytes_read = 0

    def _region(self, ref: RegionRef) -> torch.Tensor:
        """A torch_dist piece, assembled once (row-chunked writers ask for it again and again)."""
        if self._last is not None and self._last[0] is ref:
            return self._last[1]
        if self._dist is None:
            self._dist = dist_reader(self.iter_dir, trust=self.trust)
        t = self._dist.tensor(ref)
        self._last = (ref, t)
        return t

    def file(self, shard: str, name: str = naming.MODEL_FILENAME) -> TorchFile:
        """The open file ``name`` (model_optim_rng.pt, distrib_optim.pt) of shard dir ``shard``."""
        key = shard if name == naming.MODEL_FILENAME else f"{shard}/{name}"
        if key not in self._files:
            self._files[key] = TorchFile(os.path.join(self.iter_dir, shard, name), trust=self.trust)
        return self._files[key]

    def file_of(self, shard: str, ref: TensorRef) -> TorchFile:
        """The file of shard dir ``shard`` that ``ref`` was found in."""
        return self.file(shard, os.path.basename(ref.file) or naming.MODEL_FILENAME)

    def tensor(self, shard: str, ref: TensorRef) -> torch.Tensor:
        """The tensor ``ref`` points at (a lazy mmap view; a torch_dist piece is assembled from its chunks)."""
        if isinstance(ref, RegionRef):
            return self._region(ref)
        return self.file_of(shard, ref).tensor(ref)

    def release(self, shard: str, ref: TensorRef) -> None:
        """Drop the mapped pages of the file ``ref`` was read from."""
        if isinstance(ref, RegionRef):
            self._last = None
            if self._dist is not None:
                self._dist.release_pages()
            return
        self.file_of(shard, ref).release_pages()

    def materialize(self, shard: str, value: Any) -> Any:
        """A copy of ``value`` with every TensorRef inside replaced by its tensor (for carried non-model state)."""

        def leaf(v: Any, _path: tuple) -> Any:
            if not isinstance(v, TensorRef):
                return v
            t = self.tensor(shard, v).clone()
            self.bytes_read += t.numel() * t.element_size()
            return t

        return map_leaves(value, leaf)

    def release_pages(self) -> None:
        for f in self._files.values():
            f.release_pages()
        self._last = None
        if self._dist is not None:
            self._dist.release_pages()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._last = None
        if self._dist is not None:
            self._dist.close()
            self._dist = None


def _narrow(t: torch.Tensor, spec: tuple[int, int, int] | None) -> torch.Tensor:
    if spec is None:
        return t
    dim, start, length = spec
    return t.narrow(dim, start, length)


def build_tensor(tp: TensorPlan, files: SourceFiles, release: bool = False) -> torch.Tensor:
    """One planned target tensor, filled from its source slices (``release``: drop each source's mapped pages right
    after its slice is copied, so the resident set stays near the target tensor)."""
    assert tp.shape is not None
    return build_rows(tp, files, 0, tp.shape[0] if tp.shape else 1, release)


def build_rows(tp: TensorPlan, files: SourceFiles, r0: int, r1: int, release: bool = False) -> torch.Tensor:
    """Rows ``r0:r1`` (along dim 0) of a planned target tensor: what a streaming writer needs to hold at a time."""
    import torch

    assert tp.shape is not None
    whole = not tp.shape or (r0 == 0 and r1 == tp.shape[0])
    shape = tp.shape if whole else (r1 - r0, *tp.shape[1:])
    dtype = dtypes.to_torch(tp.dtype)
    dst = torch.zeros(shape, dtype=dtype) if tp.zero_fill else torch.empty(shape, dtype=dtype)  # planned padding
    for op in tp.ops:
        src = files.tensor(op.shard, op.ref)
        if whole:
            s, d = _narrow(src, op.src), _narrow(dst, op.dst)
        elif op.dst is None or op.dst[0] != 0:  # whole tensor, or split along another dim: rows line up
            s, d = _narrow(src.narrow(0, r0, r1 - r0), op.src), _narrow(dst, op.dst)
        else:  # split along dim 0: the part of this op that falls in r0:r1
            assert op.src is not None
            _, d_start, n = op.dst
            lo, hi = max(d_start, r0), min(d_start + n, r1)
            if lo >= hi:
                continue
            s = src.narrow(0, op.src[1] + lo - d_start, hi - lo)
            d = dst.narrow(0, lo - r0, hi - lo)
        if s.shape != d.shape:
            raise RuntimeError(f"plan error for {tp.key}: source slice {tuple(s.shape)} vs target {tuple(d.shape)}")
        d.copy_(s)
        files.bytes_read += s.numel() * s.element_size()
        if release:
            del s, src
            files.release(op.shard, op.ref)
    return dst


def build_flat(fp: Any, files: SourceFiles) -> torch.Tensor:
    """A distributed optimizer's world tensor (:class:`dist_optimizer.FlatPlan`): each planned state flattened at its
    offset, zeros between."""
    import torch

    out = torch.zeros(fp.numel, dtype=fp.dtype)
    for start, tp in fp.parts:
        t = build_tensor(tp, files).reshape(-1)
        out[start:start + t.numel()] = t
    return out


def build_tree(tree: Any, files: SourceFiles) -> Any:
    """A copy of ``tree`` with every :class:`TensorPlan` (and world tensor plan) inside built into its tensor."""
    import torch

    from megatron_preflight.reshard.dist_optimizer import FlatPlan

    def leaf(v: Any, _p: tuple) -> Any:
        if isinstance(v, FlatPlan):
            return build_flat(v, files)
        if isinstance(v, TensorPlan):
            return v.value if v.shape is None else build_tensor(v, files)
        if isinstance(v, torch.Tensor):  # a value the plan carries: every state dict gets its own copy (torch's
            return v.clone()  # optimizers update their state in place)
        return v

    return map_leaves(tree, leaf)


def execute(plan: RankPlan, files: SourceFiles) -> dict[str, Any]:
    """The model state dicts (``model`` or ``model0..N``) of the planned rank, and its ``optimizer`` state when the
    plan carries one."""
    out: dict[str, Any] = {c: OrderedDict() for c in plan.chunks}
    for tp in plan.tensors:
        out[tp.chunk][tp.key] = tp.value if tp.shape is None else build_tensor(tp, files)
    if plan.optimizer is not None:
        out["optimizer"] = build_tree(plan.optimizer, files)
    return out
