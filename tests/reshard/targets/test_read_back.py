"""--verify's read-back of a written shard: direct from the device where the file system allows it, each record's
CRC-32 checked, the next record read ahead while the caller compares."""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest

from megatron_preflight import libc
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.reshard.targets.read_back import ReadBack
from megatron_preflight.torch_file import TensorRef, TorchFile
from megatron_preflight.tree import iter_leaves
from tests.conftest import fixture_path


def _shard(tmp_path) -> str:
    """A copy of a real Megatron-LM shard (the source is never written to), on tmp_path's file system."""
    src = sorted(glob.glob(os.path.join(fixture_path("tp2_torch"), "*", "mp_rank_00", "model_optim_rng.pt")))[0]
    path = str(tmp_path / "model_optim_rng.pt")
    shutil.copyfile(src, path)
    return path


def _refs(out: TorchFile) -> list[TensorRef]:
    return [v for _p, v in iter_leaves(out.load_metadata()) if isinstance(v, TensorRef) and v.numel]


def _direct(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return libc.dio_alignment(fd) is not None
    finally:
        os.close(fd)


def test_read_back_arrays_equal_the_mapped_ones_in_order_and_out_of_it(tmp_path):
    """Every tensor of a real shard read back equals its mapped read: in the announced order (each next one read
    ahead), then out of it (read on demand); a read that misses the one read ahead waits for it first."""
    path = _shard(tmp_path)
    with TorchFile(path) as out:
        refs = _refs(out)
        assert len(refs) > 20
        with ReadBack(out, path, refs) as back:
            assert back.direct == _direct(path)
            for ref in refs:
                assert (back.array(ref) == out.array(ref)).all()
            for ref in reversed(refs[::3]):
                assert (back.array(ref) == out.array(ref)).all()
    assert not [t for t in threading.enumerate() if t.name.startswith("preflight-read-back")]


def test_a_byte_changed_on_disk_is_found_by_the_record_crc(tmp_path):
    """A flipped byte inside a record: the read-back's CRC-32 check names the file (direct read or mapped alike)."""
    path = _shard(tmp_path)
    with TorchFile(path) as out:
        refs = _refs(out)
        hit = max(refs, key=lambda r: r.numel)
        offset, nbytes = out.record_extent(hit.storage.key)
    with open(path, "r+b") as fh:
        fh.seek(offset + nbytes // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    with TorchFile(path) as out:
        refs = _refs(out)
        with ReadBack(out, path, refs) as back, pytest.raises(CorruptFileError) as err:
            for ref in refs:
                back.array(ref)
        assert err.value.path == path and f"data/{hit.storage.key}" in str(err.value)
