"""The zip directory read with struct gives what zipfile gives, or None (and the file is read with zipfile)."""

import glob
import io
import os
import struct
import zipfile
import zlib

import pytest
import torch

from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.dist import read_dcp_metadata
from megatron_preflight.torch_file import TorchFile, read_torch_file
from megatron_preflight.zip_directory import read_directory
from tests.conftest import fixture_path


def _from_bytes(data: bytes):
    return read_directory(lambda offset, n: data[offset:offset + n], len(data))


def _zipfile_view(data: bytes):
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: (i.header_offset, i.compress_type, i.compress_size, i.file_size, i.CRC)
                for i in z.infolist()}


def _view(records):
    return {n: (r.header_offset, r.compress_type, r.compress_size, r.file_size, r.crc) for n, r in records.items()}


def _torch_files():
    legacy = sorted(glob.glob(fixture_path("moe_shared_tp2pp2ep2_torch") + "/iter_*/*/model_optim_rng.pt"))
    assert legacy
    for path in legacy:
        with open(path, "rb") as fh:
            yield path, fh.read()
    it = glob.glob(fixture_path("moe_shared_tp2pp2ep2_torch_dist") + "/iter_*")[0]
    md = read_dcp_metadata(it)
    blobs = 0
    for info in md.storage_data.values():
        with open(os.path.join(it, info.relative_path), "rb") as fh:
            fh.seek(info.offset)
            yield info.relative_path, fh.read(info.length)
        blobs += 1
    assert blobs > 100


def test_every_torch_file_of_a_checkpoint_reads_as_zipfile_reads_it():
    """Legacy shards and every chunk blob of a torch_dist checkpoint (torch.save's layout, with its zip64 end
    records): the same records, offsets, sizes and checksums as zipfile's."""
    for name, data in _torch_files():
        records = _from_bytes(data)
        assert records is not None, name
        assert _view(records) == _zipfile_view(data), name


def _archive(entries, *, zip64: bool, wide: bool) -> bytes:
    """A stored zip archive built by hand: local headers, the central directory (``wide``: sizes and offsets given
    as 0xFFFFFFFF with their values in a zip64 extra field) and the end records (``zip64``: with zip64's)."""
    out, cd = bytearray(), bytearray()
    for name, body in entries:
        raw = name.encode()
        offset, crc = len(out), zlib.crc32(body)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(body), len(body), len(raw), 0)
        out += raw + body
        extra = struct.pack("<HHQQQ", 1, 24, len(body), len(body), offset) if wide else b""
        size32, off32 = (0xFFFFFFFF, 0xFFFFFFFF) if wide else (len(body), offset)
        cd += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc, size32, size32, len(raw),
                          len(extra), 0, 0, 0, 0, off32)
        cd += raw + extra
    cd_offset = len(out)
    out += cd
    if zip64:
        end64 = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(entries), len(entries), len(cd),
                           cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(cd), cd_offset, 0)
    return bytes(out)


ENTRIES = [("archive/data.pkl", b"\x80\x02}q\x00."), ("archive/data/0", bytes(range(200))), ("archive/version", b"3\n")]


@pytest.mark.parametrize("zip64, wide", [(False, False), (True, False), (True, True)])
def test_zip64_end_records_and_extra_fields_read_as_zipfile_reads_them(zip64, wide):
    data = _archive(ENTRIES, zip64=zip64, wide=wide)
    records = _from_bytes(data)
    assert records is not None
    assert _view(records) == _zipfile_view(data)
    assert set(records) == {n for n, _ in ENTRIES}


def test_other_layouts_are_left_to_zipfile():
    """A comment, bytes before the archive or after its directory, a cut tail, a wrong count, an encrypted record, zip64 values without
    their record, and a wide entry without its extra field: None, never a wrong record."""
    data = _archive(ENTRIES, zip64=False, wide=False)
    commented = data[:-2] + struct.pack("<H", 3) + b"abc"
    assert _from_bytes(commented) is None
    assert _from_bytes(b"junk" + data) is None
    assert _from_bytes(data[:-22] + b"xx" + data[-22:]) is None  # bytes between the directory and its end record
    assert _from_bytes(data[:-5]) is None
    assert _from_bytes(data[:10]) is None
    count = data[:-12] + struct.pack("<HH", 2, 2) + data[-8:]
    assert _from_bytes(count) is None
    cd_at = struct.unpack_from("<I", data, len(data) - 6)[0]
    encrypted = bytearray(data)
    struct.pack_into("<H", encrypted, cd_at + 8, 1)
    assert _from_bytes(bytes(encrypted)) is None
    no_record = data[:-22] + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 3, 3, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    assert _from_bytes(no_record) is None
    wide = bytearray(_archive(ENTRIES, zip64=True, wide=True))
    first_extra = bytes(wide).index(struct.pack("<HH", 1, 24))
    struct.pack_into("<H", wide, first_extra, 0x4246)  # the zip64 field renamed: its values are gone
    assert _from_bytes(bytes(wide)) is None


def test_a_torch_file_another_writer_laid_out_is_read_through_zipfile(tmp_path):
    """Bytes before a torch.save archive (zipfile reads it; struct gives None): the same tensors."""
    t = {"w": torch.arange(12.0).reshape(3, 4)}
    buf = io.BytesIO()
    torch.save(t, buf)
    path = tmp_path / "prefixed.pt"
    path.write_bytes(b"\0" * 64 + buf.getvalue())
    with TorchFile(path) as f:
        ref = f.load_metadata()["w"]
        assert torch.equal(f.tensor(ref), t["w"])


def test_a_damaged_pickle_record_is_a_corrupt_file(tmp_path):
    """A bit flipped in data.pkl: its CRC-32 does not match the directory's (a clear error, not a wrong tree)."""
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo([n for n in z.namelist() if n.endswith("data.pkl")][0])
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="checksum"):
        read_torch_file(path)


def test_a_directory_entry_that_points_at_another_records_header_is_a_corrupt_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
    pkl = [n for n in infos if n.endswith("data.pkl")][0]
    other = [i for n, i in infos.items() if n.endswith("/byteorder") or n.endswith("/version")][0]
    pos = bytes(data).index(b"PK\x01\x02")
    while True:  # the central directory entry of data.pkl
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        if bytes(data[pos + 46:pos + 46 + name_len]).decode() == pkl:
            break
        pos += 46 + name_len + extra_len + comment_len
    struct.pack_into("<I", data, pos + 42, other.header_offset)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="another record"):
        read_torch_file(path)
