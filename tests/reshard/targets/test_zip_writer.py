"""The streaming zip writer: byte for byte what Python's zipfile writes for the same stored records (zip64 paths
included, by lowering the limits in both), data aligned, sizes as zip_size predicts, CRCs that zipfile verifies."""

from __future__ import annotations

import os
import struct
import zipfile

import pytest

from megatron_preflight.reshard.targets import zip_writer
from megatron_preflight.reshard.targets.zip_writer import ALIGN, TorchZipWriter, zip_size


def _payload(name: str, size: int) -> bytes:
    return bytes((i * 7 + len(name)) % 251 for i in range(size))


def _ours(path: str, records: list[tuple[str, int]], piece: int = 97) -> None:
    with TorchZipWriter(path, "arch") as zw:
        for name, size in records:
            data = _payload(name, size)
            zw.begin(name, size)
            for at in range(0, size, piece):
                zw.append(data[at:at + piece])
            zw.end()


def _zipfile(path: str, records: list[tuple[str, int]]) -> None:
    """The same records through zipfile, padded as torch pads them."""
    with open(path, "wb") as raw, zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, size in records:
            info = zipfile.ZipInfo(f"arch/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = size
            zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
            start = raw.tell() + 30 + len(info.filename) + (20 if zip64 else 0) + 4
            pad = (-start) % ALIGN
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            with zf.open(info, "w", force_zip64=zip64) as fh:
                fh.write(_payload(name, size))


def _data_offset(path: str, info: zipfile.ZipInfo) -> int:
    """Where a record's data starts (from its local header's name and extra lengths)."""
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    return info.header_offset + 30 + name_len + extra_len


def _same_as_zipfile(tmp_path, records: list[tuple[str, int]]) -> str:
    """Our archive of ``records``, asserted identical to zipfile's and of the size zip_size predicts."""
    ours, theirs = str(tmp_path / "ours.pt"), str(tmp_path / "theirs.pt")
    _ours(ours, records)
    _zipfile(theirs, records)
    with open(ours, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    assert os.path.getsize(ours) == zip_size(records, "arch")
    return ours


RECORDS = [("data.pkl", 300), (".format_version", 1), ("byteorder", 6), ("data/0", 5000), ("data/1", 0),
           ("data/2", 1234), ("version", 2)]


@pytest.mark.parametrize("limit", [None, 4000, 1100, 700], ids=["plain", "zip64-offsets", "zip64-sizes", "tight"])
def test_same_bytes_as_zipfile(tmp_path, monkeypatch, limit):
    if limit is not None:  # zip64 local headers, central fields and end records at small sizes, in both writers
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", limit)
        monkeypatch.setattr(zip_writer, "ZIP64_LIMIT", limit)
    ours = _same_as_zipfile(tmp_path, RECORDS)
    with zipfile.ZipFile(ours) as zf:
        assert zf.testzip() is None  # every CRC right
        for info in zf.infolist():
            assert _data_offset(ours, info) % ALIGN == 0, info.filename
            assert zf.read(info) == _payload(info.filename.split("/", 1)[1], info.file_size)


def test_many_records_take_the_zip64_end_record(tmp_path, monkeypatch):
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 3)
    monkeypatch.setattr(zip_writer, "FILECOUNT_LIMIT", 3)
    _same_as_zipfile(tmp_path, RECORDS)


def test_the_window_below_the_limit_stays_aligned(tmp_path, monkeypatch):
    """A record just below the limit (over limit/1.05) has zip64 sizes in its local header: the padding counts them
    (a 2.05-2.15 GB tensor, e.g. a Llama-3-70B TP1 embedding in bf16, at the real limit)."""
    monkeypatch.setattr(zip_writer, "ZIP64_LIMIT", 2000)
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 2000)
    records = [("data.pkl", 10), ("data/0", 1950)]  # 1950 * 1.05 > 2000 > 1950 + 1024 - 2000
    path = str(tmp_path / "w.pt")
    _ours(path, records)
    assert os.path.getsize(path) == zip_size(records, "arch")
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("arch/data/0")
        assert _data_offset(path, info) % ALIGN == 0
        assert zf.read(info) == _payload("data/0", 1950)


def test_a_record_must_be_its_declared_size(tmp_path):
    with TorchZipWriter(str(tmp_path / "a.pt")) as zw:
        zw.begin("x", 4)
        with pytest.raises(ValueError, match="longer than its declared 4"):
            zw.append(b"12345")
    with TorchZipWriter(str(tmp_path / "b.pt")) as zw:
        zw.begin("x", 4)
        zw.append(b"12")
        with pytest.raises(ValueError, match="2 bytes short"):
            zw.end()


@pytest.mark.parametrize("make", [
    lambda torch: torch.randn(5, 3), lambda torch: torch.randn(2, 3, 4).to(torch.bfloat16),
    lambda torch: torch.arange(7, dtype=torch.int64), lambda torch: torch.tensor(3.5, dtype=torch.float16),
    lambda torch: torch.zeros(0, 4), lambda torch: torch.tensor([True, False, True]),
    lambda torch: torch.arange(256, dtype=torch.uint8).view(16, 16),
], ids=["fp32", "bf16-3d", "int64", "fp16-0d", "empty", "bool", "uint8"])
def test_a_tensor_blob_inside_a_file_loads_as_torch_saves_does(tmp_path, make):
    """A torch_dist chunk's blob written by write_tensor_blob in the middle of a data file (after another blob and
    odd bytes) is a torch zip archive of its own: torch.load of its byte range, weights_only as DCP reads it, gives
    the tensor, bit for bit; twice the same shape (the cached pickle) too."""
    import io

    import torch

    from megatron_preflight.reshard.targets.stream_save import can_write_blob, write_tensor_blob

    t = make(torch)
    assert can_write_blob(t)
    path = tmp_path / "__0_0.distcp"
    spans = []
    with open(path, "wb") as fh:
        fh.write(b"xyz")
        for _ in range(2):
            start = fh.tell()
            write_tensor_blob(fh, t)
            spans.append((start, fh.tell() - start))
            fh.write(b"\0" * 5)
    data = path.read_bytes()
    for start, length in spans:
        got = torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        with zipfile.ZipFile(io.BytesIO(data[start:start + length])) as z:
            assert z.testzip() is None  # every record's CRC-32


def test_a_view_is_not_written_as_a_blob():
    """A view of a bigger storage (torch.save would write the whole storage) is left to torch.save."""
    import torch

    from megatron_preflight.reshard.targets.stream_save import can_write_blob

    base = torch.randn(4, 4)
    assert not can_write_blob(base[1:]) and not can_write_blob(base.t()) and can_write_blob(base[1:].clone())


def test_blob_size_is_what_the_blob_writer_writes():
    """The hollow checkpoints of the benchmarks place chunks by blob_size without making a tensor."""
    import io

    import torch

    from megatron_preflight.reshard.targets.stream_save import blob_size, write_tensor_blob

    for t in (torch.randn(3, 70000), torch.zeros(0, dtype=torch.bfloat16), torch.ones(2, 2, 2, 2, dtype=torch.int8)):
        buf = io.BytesIO()
        write_tensor_blob(buf, t)
        assert len(buf.getvalue()) == blob_size(t.dtype, tuple(t.shape))


def test_a_blob_is_byte_for_byte_the_archive_the_writer_lays_out_record_by_record():
    """write_tensor_blob writes a cached frame around the data with the data's CRC-32 patched in (local header and
    central directory): the same bytes as laying the six records out one by one, for tensors of one dtype and shape
    whose values differ (the frame reused) and for the edge shapes."""
    import io

    import torch

    from megatron_preflight.reshard.targets import stream_save as ss
    from megatron_preflight.reshard.targets.zip_writer import TorchZipWriter

    def by_records(t):
        out = io.BytesIO()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        zw = TorchZipWriter(None, "archive", fh=out)
        for name, data in (("data.pkl", ss._blob_pickle(t.dtype, tuple(t.shape))),
                           (".format_version", ss._FORMAT_VERSION), ("byteorder", ss._BYTEORDER), ("data/0", raw),
                           ("version", ss._VERSION),
                           (".data/serialization_id", ss._serialization_id("archive", raw.nbytes).encode())):
            zw.write(name, data)
        zw.close()
        return out.getvalue()

    torch.manual_seed(0)
    tensors = [torch.randn(5, 7), torch.randn(5, 7), torch.randn(3, 9).to(torch.bfloat16), torch.zeros(0, 3),
               torch.tensor(2.5), torch.arange(1000, dtype=torch.int64)]
    for t in tensors:
        buf = io.BytesIO()
        buf.write(b"odd")  # (the blob's offsets count from its own start)
        ss.write_tensor_blob(buf, t)
        assert buf.getvalue()[3:] == by_records(t)


def test_the_frame_of_a_chunk_past_the_zip64_limit_is_laid_out_without_its_data():
    """A 3 GiB chunk's frame (zip64 sizes in its data record's headers) is laid out without making or reading its
    data (an untouched read-only mapping stands for it), and frame plus data is blob_size's count."""
    import resource

    import torch

    from megatron_preflight.reshard.targets import stream_save as ss

    n = 3 * 2**30
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head, tail, at_head, at_tail = ss._blob_frame(torch.uint8, (n,), n)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: no data made
    records = [("data.pkl", len(ss._blob_pickle(torch.uint8, (n,)))), (".format_version", len(ss._FORMAT_VERSION)),
               ("byteorder", len(ss._BYTEORDER)), ("data/0", n), ("version", len(ss._VERSION)),
               (".data/serialization_id", len(ss._serialization_id("archive", n)))]
    assert len(head) + n + len(tail) == zip_size(records, "archive")  # the writer's own count, record by record
    assert head.rfind(b"PK\x03\x04") < at_head < len(head) and tail.find(b"PK\x01\x02") < at_tail
