"""A shard's output file: direct I/O where the file system reports its alignment, buffered elsewhere; either way the
bytes on disk are the bytes written, patches behind the end included."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import threading
import zipfile

import pytest

from megatron_preflight import libc
from megatron_preflight.reshard.targets import output_file
from megatron_preflight.reshard.targets.output_file import BufferedOutput, DirectFile, open_output


def _direct_dir(tmp_path) -> str:
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        align = libc.dio_alignment(fd)
    finally:
        os.close(fd)
    if align is None or not hasattr(os, "O_DIRECT"):
        pytest.skip(f"{tmp_path}'s file system reports no direct-I/O alignment (statx): the buffered path only")
    return str(tmp_path)


def _writes(seed: int, total: int) -> tuple[list[tuple[str, int, bytes]], bytes]:
    """Appends of odd sizes, and patches at earlier offsets (as a zip writer rewrites a record's header), with the
    bytes they must leave."""
    rng = random.Random(seed)
    ops, want = [], bytearray()
    while len(want) < total:
        if want and rng.random() < 0.3:
            at = rng.randrange(len(want))
            data = rng.randbytes(rng.randint(1, 700))
            ops.append(("patch", at, data))
            end = min(len(want), at + len(data))
            want[at:end] = data[:end - at]
            want.extend(data[end - at:])
        else:
            data = rng.randbytes(rng.choice((1, 7, 511, 512, 513, 3000, 9000)))
            ops.append(("append", len(want), data))
            want.extend(data)
    return ops, bytes(want)


def _apply(fh, ops) -> None:
    for kind, at, data in ops:
        if kind == "patch":
            here = fh.tell()
            fh.seek(at)
            fh.write(data)
            fh.seek(max(here, at + len(data)))
        else:
            fh.write(data)


@pytest.mark.parametrize("seed", range(4))
def test_direct_file_leaves_the_bytes_written_patches_behind_the_end_included(tmp_path, seed):
    """Small staging buffers (several written while the next fills, patches that land in a buffer, on blocks on disk,
    and across the two), sizes that are not multiples of the alignment: the file equals the bytes written."""
    path = os.path.join(_direct_dir(tmp_path), "f")
    ops, want = _writes(seed, 60_000)
    f = open_output(path)
    assert isinstance(f, DirectFile)
    f.close()
    fd = os.open(path, os.O_RDWR | os.O_TRUNC)
    f = DirectFile(fd, path, 512, stage_bytes=4096, stages=2)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    _apply(f, ops)
    assert f.tell() == len(want)
    f.commit()
    f.close()
    with open(path, "rb") as fh:
        assert fh.read() == want


def test_open_output_is_direct_where_the_kernel_says_so_and_buffered_where_not(tmp_path, monkeypatch):
    """The choice is the file system's (statx), or MEGATRON_PREFLIGHT_DIRECT_IO=0's; both leave the same bytes."""
    ops, want = _writes(9, 200_000)
    kinds = {}
    for name, env in (("auto", "1"), ("forced", "0")):
        monkeypatch.setenv("MEGATRON_PREFLIGHT_DIRECT_IO", env)
        path = str(tmp_path / name)
        with open_output(path) as f:
            kinds[name] = type(f)
            _apply(f, ops)
            f.commit()
        with open(path, "rb") as fh:
            assert fh.read() == want
    assert kinds["forced"] is BufferedOutput
    fd = os.open(tmp_path / "auto", os.O_RDONLY)
    try:
        expected = DirectFile if libc.dio_alignment(fd) is not None else BufferedOutput
    finally:
        os.close(fd)
    assert kinds["auto"] is expected
    if os.path.isdir("/dev/shm"):  # tmpfs: the page cache is the file, no alignment reported
        path = f"/dev/shm/preflight-output-{os.getpid()}"
        try:
            with open_output(path) as f:
                assert isinstance(f, BufferedOutput)
        finally:
            os.unlink(path)


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    """Alignment reported, the first direct write refused (EINVAL): the file is written buffered from the start."""
    real = os.pwrite

    def refuse(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(output_file.libc, "dio_alignment", lambda fd: (512, 512))
    monkeypatch.setattr(output_file.os, "pwrite", refuse)
    path = str(tmp_path / "f")
    with open_output(path) as f:
        assert isinstance(f, BufferedOutput)
        f.write(b"abc" * 1000)
        f.commit()
    assert os.path.getsize(path) == 3000


def test_a_failed_direct_write_is_raised_in_the_writer_and_its_thread_ends(tmp_path, monkeypatch):
    """The disk fills up mid-file: the error (ENOSPC) reaches the caller at a later write or at commit, and closing
    the file stops its writing thread (nothing left running)."""
    path = os.path.join(_direct_dir(tmp_path), "f")
    real, calls = os.pwrite, [0]

    def full(fd, data, offset):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    f = open_output(path)
    assert isinstance(f, DirectFile)
    monkeypatch.setattr(output_file.os, "pwrite", full)
    with pytest.raises(OSError) as got:
        for _ in range(64):
            f.write(os.urandom(1 << 20))
        f.commit()
    assert got.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        f.close()  # (its flush meets the same full disk; the file is closed all the same)
    assert f.closed
    assert not [t for t in threading.enumerate() if t.name == "preflight-direct-write"]


def _contents(root) -> dict[str, bytes]:
    """Each file's bytes; a torch file (``.pt``, a zip) as its records, each CRC-32 checked (``testzip``: a header patched
    wrong fails here). The pickled object tree (``data.pkl``) and what depends on it (the file's serialization id,
    integrity.json's hashes) are left out: its memo of repeated strings differs from one save to the next in the same
    process, whatever writes it."""
    out: dict[str, bytes] = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            if f.endswith(".pt"):  # (a .distcp file is torch.save blobs end to end: compared as bytes)
                with zipfile.ZipFile(path) as z:
                    assert z.testzip() is None, rel
                    out.update({f"{rel}:{n}": z.read(n) for n in z.namelist() if not n.endswith(("data.pkl", "serialization_id"))})
            elif f != "integrity.json":
                with open(path, "rb") as fh:
                    out[rel] = fh.read()
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_reshard_written_direct_equals_one_written_buffered(tmp_path, monkeypatch, fmt):
    """The same reshard (the real TP2 checkpoint to TP1, legacy and torch_dist output) written through each strategy:
    the same files, every zip record's CRC-32 right, the same tensor bytes (where this file system takes direct
    writes: the direct path; else both are buffered and the test says nothing new). Staging buffers of 64 KiB: the
    ~0.6 MB shards span several, and the records' headers are patched on blocks already written."""
    from megatron_preflight.reshard import write_resharded  # (a test that writes checkpoints)
    from megatron_preflight.reshard.target import TargetLayout
    from tests.conftest import fixture_path

    monkeypatch.setattr(output_file, "STAGE_BYTES", 64 << 10)
    outs = {}
    for env in ("1", "0"):
        monkeypatch.setenv("MEGATRON_PREFLIGHT_DIRECT_IO", env)
        out = tmp_path / f"out{env}"
        write_resharded(fixture_path("tp2_torch"), str(out), TargetLayout(tp=1, ckpt_format=fmt))
        outs[env] = _contents(out)
    assert outs["1"].keys() == outs["0"].keys()
    assert sum(len(v) for v in outs["1"].values()) > 256 << 10
    assert [k for k in outs["1"] if outs["1"][k] != outs["0"][k]] == []
