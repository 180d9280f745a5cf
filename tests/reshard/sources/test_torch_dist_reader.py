"""The torch_dist reader's plain-I/O path: a piece that lies in one saved chunk, its rows contiguous, is read into the
writer's buffer with pread, and the chunk's CRC-32 is still checked (real Megatron-LM torch_dist fixture)."""

import os
import shutil

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.dist import read_dcp_metadata
from megatron_preflight.reshard import TargetLayout, write_resharded
from megatron_preflight.reshard.sources.torch_dist_reader import chunk_index
from megatron_preflight.torch_file import TorchFile
from tests.conftest import fixture_path

SOURCE = "moe_shared_tp2pp2ep2_torch_dist"


def _spy_direct_reads(monkeypatch) -> list[str]:
    """Names of the chunk blobs read with plain I/O (TorchFile.read_rows through a .distcp file's descriptor)."""
    read: list[str] = []
    original = TorchFile.read_rows

    def spy(self, ref, row0, out, fd=None):
        done = original(self, ref, row0, out, fd)
        if done is not None and fd is not None:
            read.append(f"{os.path.basename(self.path)}@{self._base}")
        return done

    monkeypatch.setattr(TorchFile, "read_rows", spy)
    return read


def test_whole_chunks_are_read_with_plain_io_and_a_flipped_bit_in_one_stops_the_reshard(tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(fixture_path(SOURCE), src)
    read = _spy_direct_reads(monkeypatch)
    write_resharded(str(src), str(tmp_path / "ok"), TargetLayout(tp=1, pp=1, ep=1), drop_optimizer=True)
    assert read, "no piece was read with plain I/O"

    # damage a chunk that was read that way: the middle byte of its tensor record
    iter_dir = src / "iter_0000002"
    name, base = read[0].split("@")
    chunk = next(c for cs in chunk_index(read_dcp_metadata(str(iter_dir))).values() for c in cs
                 if c.file == name and c.start == int(base))
    path = str(iter_dir / chunk.file)
    with TorchFile(path, window=(chunk.start, chunk.length)) as f:
        start, nbytes = f._record_offset(f.load_metadata().storage.key)
    with open(path, "r+b") as fh:
        fh.seek(chunk.start + start + nbytes // 2)
        byte = fh.read(1)[0]
        fh.seek(chunk.start + start + nbytes // 2)
        fh.write(bytes([byte ^ 0x01]))
    with pytest.raises(PreflightError, match="CRC-32") as exc:
        write_resharded(str(src), str(tmp_path / "bad"), TargetLayout(tp=1, pp=1, ep=1), drop_optimizer=True)
    assert exc.value.path == path
    assert not (tmp_path / "bad").exists()
