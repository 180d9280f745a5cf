"""The source files of one checkpoint, opened on demand: the one place a piece reference is turned into a tensor."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from megatron_preflight.layout import naming
from megatron_preflight.reshard.sources.torch_dist import DistReader, RegionRef, dist_reader
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
