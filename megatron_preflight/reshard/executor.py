"""Execute a rank plan: read only the planned source slices (lazily, via mmap) into freshly allocated tensors."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from megatron_preflight.layout import naming
from megatron_preflight.reshard.planner import RankPlan, TensorPlan
from megatron_preflight.torch_file import TensorRef, TorchFile


class SourceFiles:
    """Open source shard files on demand (one :class:`TorchFile` per shard), and count bytes read."""

    def __init__(self, iter_dir: str, trust: bool = False) -> None:
        self.iter_dir = iter_dir
        self.trust = trust
        self._files: dict[str, TorchFile] = {}
        self.bytes_read = 0

    def file(self, shard: str) -> TorchFile:
        if shard not in self._files:
            self._files[shard] = TorchFile(os.path.join(self.iter_dir, shard, naming.MODEL_FILENAME), trust=self.trust)
        return self._files[shard]

    def tensor(self, shard: str, ref: TensorRef) -> torch.Tensor:
        return self.file(shard).tensor(ref)

    def materialize(self, shard: str, value: Any) -> Any:
        """A copy of ``value`` with every TensorRef inside replaced by its tensor (for carried non-model state)."""
        if isinstance(value, TensorRef):
            t = self.tensor(shard, value).clone()
            self.bytes_read += t.numel() * t.element_size()
            return t
        if isinstance(value, dict):
            kind = OrderedDict if isinstance(value, OrderedDict) else dict
            return kind((k, self.materialize(shard, v)) for k, v in value.items())
        if isinstance(value, list):
            return [self.materialize(shard, v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.materialize(shard, v) for v in value)
        return value

    def release_pages(self) -> None:
        for f in self._files.values():
            f.release_pages()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _narrow(t: torch.Tensor, spec: tuple[int, int, int] | None) -> torch.Tensor:
    if spec is None:
        return t
    dim, start, length = spec
    return t.narrow(dim, start, length)


def build_tensor(tp: TensorPlan, files: SourceFiles, release: bool = False) -> torch.Tensor:
    """One planned target tensor, filled from its source slices (``release``: drop each source's mapped pages right
    after its slice is copied, so the resident set stays near the target tensor)."""
    assert tp.shape is not None
    dst = torch.zeros(tp.shape, dtype=tp.dtype) if tp.zero_fill else torch.empty(tp.shape, dtype=tp.dtype)
    for op in tp.ops:
        src = _narrow(files.tensor(op.shard, op.ref), op.src)
        target = _narrow(dst, op.dst)
        if src.shape != target.shape:
            raise RuntimeError(f"plan error for {tp.key}: source slice {tuple(src.shape)} vs target "
                               f"{tuple(target.shape)}")
        target.copy_(src)
        files.bytes_read += src.numel() * src.element_size()
        if release:
            del src
            files.file(op.shard).release_pages()
    return dst


def build_tree(tree: Any, files: SourceFiles) -> Any:
    """A copy of ``tree`` with every :class:`TensorPlan` inside built into its tensor."""
    if isinstance(tree, TensorPlan):
        return tree.value if tree.shape is None else build_tensor(tree, files)
    if isinstance(tree, dict):
        return type(tree)((k, build_tree(v, files)) for k, v in tree.items())
    if isinstance(tree, list):
        return [build_tree(v, files) for v in tree]
    if isinstance(tree, tuple):
        return tuple(build_tree(v, files) for v in tree)
    return tree


def execute(plan: RankPlan, files: SourceFiles) -> dict[str, Any]:
    """The model state dicts (``model`` or ``model0..N``) of the planned rank, and its ``optimizer`` state when the
    plan carries one."""
    out: dict[str, Any] = {c: OrderedDict() for c in plan.chunks}
    for tp in plan.tensors:
        out[tp.chunk][tp.key] = tp.value if tp.shape is None else build_tensor(tp, files)
    if plan.optimizer is not None:
        out["optimizer"] = build_tree(plan.optimizer, files)
    return out
