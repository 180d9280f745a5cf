"""The legacy source: each shard dir's ``model_optim_rng.pt`` / ``distrib_optim.pt``, opened once, tensors mapped
lazily (a :class:`~megatron_preflight.torch_file.TensorRef` names its file and bytes)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from megatron_preflight.layout import naming
from megatron_preflight.torch_file import TensorRef, TorchFile

if TYPE_CHECKING:  # tensors are made only when a plan runs: planning and costing need no torch
    import torch


class LegacyReader:
    """Reads :class:`TensorRef` pieces of one legacy iteration dir (a :class:`~.files.Reader`)."""

    def __init__(self, iter_dir: str, trust: bool = False, *, crc: bool = False) -> None:
        self.iter_dir = iter_dir
        self.trust = trust
        self.crc = crc
        self._files: dict[str, TorchFile] = {}

    def file(self, shard: str, name: str = naming.MODEL_FILENAME) -> TorchFile:
        """The open file ``name`` (model_optim_rng.pt, distrib_optim.pt) of shard dir ``shard``."""
        key = shard if name == naming.MODEL_FILENAME else f"{shard}/{name}"
        if key not in self._files:
            self._files[key] = TorchFile(os.path.join(self.iter_dir, shard, name), trust=self.trust,
                                         check_crc=self.crc)
        return self._files[key]

    def file_of(self, shard: str, ref: TensorRef) -> TorchFile:
        """The file of shard dir ``shard`` that ``ref`` was found in."""
        return self.file(shard, os.path.basename(ref.file) or naming.MODEL_FILENAME)

    def tensor(self, shard: str, ref: TensorRef, verify: bool = True) -> torch.Tensor:
        return self.file_of(shard, ref).tensor(ref, verify)

    def array(self, shard: str, ref: TensorRef, verify: bool = True) -> Any:
        """:meth:`tensor` as a numpy array of the elements' bytes (:meth:`TorchFile.array`: no torch)."""
        return self.file_of(shard, ref).array(ref, verify)

    def extent(self, shard: str, ref: TensorRef) -> tuple[str, int, int] | None:
        """(file, byte offset, row pitch in bytes) of ``ref`` when each of its rows is stored contiguously."""
        f = self.file_of(shard, ref)
        at = f.byte_extent(ref)
        return None if at is None else (f.path, *at)

    def sample_bytes(self, shard: str, ref: TensorRef, k: int) -> bytes | None:
        """The bytes of ``ref``'s first, middle and last ``k`` elements (:meth:`TorchFile.sample_bytes`)."""
        return self.file_of(shard, ref).sample_bytes(ref, k)

    def read_rows(self, shard: str, ref: TensorRef, row0: int, out: Any) -> int | None:
        """Rows of ``ref`` from ``row0`` into ``out`` with plain file I/O (:meth:`TorchFile.read_rows`): their CRC-32,
        None when not read."""
        return self.file_of(shard, ref).read_rows(ref, row0, out)

    def finish(self) -> None:
        """Check the CRC-32 of every record :meth:`read_rows` read only in part."""
        for f in self._files.values():
            f.finish_crc()

    def rows(self, shard: str, ref: TensorRef, first: int, n: int) -> Any:
        """None: a slice is taken from :meth:`tensor` (a mapped view, or a piece assembled once)."""
        return None

    def item(self, shard: str, ref: TensorRef) -> Any:
        """A one-element tensor as a number, from its bytes (no torch)."""
        return self.file_of(shard, ref).item(ref)

    def release(self, shard: str, ref: TensorRef) -> None:
        self.file_of(shard, ref).release_pages()

    def release_pages(self) -> None:
        for f in self._files.values():
            f.release_pages()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
