"""Metadata-only reading: tensor bytes are never read to inspect; single tensors materialise exactly."""

import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch

from megatron_preflight.placeholders import placeholder_class
from megatron_preflight.torch_file import TensorRef, TorchFile, read_torch_file
from tests.conftest import fixture_path

FILE = fixture_path("moe_ep2_torch") + "/iter_0000002/mp_rank_00_001/model_optim_rng.pt"


def test_metadata_reads_only_the_pickle(monkeypatch):
    """Reading the tree touches the zip directory, the pickle and local headers, never a storage record's bytes."""
    reads = []
    real = TorchFile._read_at

    def spy(self, offset, n):
        reads.append((offset, offset + n))
        return real(self, offset, n)

    monkeypatch.setattr(TorchFile, "_read_at", spy)
    monkeypatch.setattr(zipfile.ZipFile, "__init__", None)  # the file is read without zipfile
    meta = read_torch_file(FILE)
    ref = meta["model"]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert isinstance(ref, TensorRef) and ref.shape == (64, 32) and ref.dtype == torch.float32
    with open(FILE, "rb") as fh:
        data = fh.read()
    monkeypatch.undo()
    with zipfile.ZipFile(FILE) as z:
        storages = []
        for info in z.infolist():
            if "/data/" in info.filename:
                name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
                start = info.header_offset + 30 + name_len + extra_len
                storages.append((start, start + info.file_size))
    assert reads and len(storages) > 10
    assert not [(r, s) for r in reads for s in storages if r[0] < s[1] and s[0] < r[1]]


class _InertMegatron:
    """A pickle_module for torch.load that maps megatron classes to placeholders (oracle: torch's own loader)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("megatron."):
                return placeholder_class(module, name)
            return super().find_class(module, name)

    load = pickle.load
    __name__ = "inert"


def test_tensors_match_torch_load():
    full = torch.load(FILE, weights_only=False, map_location="cpu", pickle_module=_InertMegatron)
    with TorchFile(FILE) as f:
        meta = f.load_metadata()
        for key, ref in meta["model"].items():
            if isinstance(ref, TensorRef):
                t = f.tensor(ref)
                assert t.shape == ref.shape
                assert torch.equal(t, full["model"][key]), key
    assert meta["iteration"] == 2


def test_roundtrip_of_views_and_dtypes(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"view": base[:, 2:5], "t": base.t(), "bf16": base.to(torch.bfloat16), "i64": torch.arange(5),
           "empty": torch.zeros(0, 3), "scalar": torch.tensor(3.5), "p": torch.nn.Parameter(torch.ones(2))}
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    with TorchFile(path) as f:
        meta = f.load_metadata()
        for k, v in obj.items():
            got = f.tensor(meta[k])
            assert got.dtype == v.dtype and torch.equal(got, v.detach()), k


def test_materialised_tensor_is_copy_on_write(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(4)}, path)
    before = path.read_bytes()
    with TorchFile(path) as f:
        t = f.tensor(f.load_metadata()["w"])
        t.mul_(7)
    assert path.read_bytes() == before


def test_a_tensor_beyond_its_storage_is_a_corrupt_file_not_a_crash():
    import pytest

    from megatron_preflight.errors import CorruptFileError
    from megatron_preflight.torch_file import StorageRef, TensorRef, _check_extent

    storage = StorageRef("0", torch.float32, 12)
    _check_extent(TensorRef("f.pt", storage, 0, (3, 4), (4, 1)))  # exactly fits
    _check_extent(TensorRef("f.pt", storage, 11, (1,), (1,)))
    _check_extent(TensorRef("f.pt", storage, 0, (0, 4), (4, 1)))  # empty: no element read
    for offset, shape, stride, says in [(1, (3, 4), (4, 1), "exceeds its storage"),
                                        (0, (4, 4), (4, 1), "exceeds its storage"),
                                        (0, (3, 4), (1, 4), "exceeds its storage"),
                                        (-1, (2,), (1,), "negative"), (0, (-2,), (1,), "negative"),
                                        (0, (2, 2), (1,), "malformed")]:
        with pytest.raises(CorruptFileError, match=says):
            _check_extent(TensorRef("f.pt", storage, offset, shape, stride))


def test_blobs_of_one_file_read_through_one_shared_mapping(tmp_path):
    """A torch_dist .distcp file holds one torch.save blob per chunk: each blob is a TorchFile window read through
    the file's one mapping (map_file), its tensors exact and copy-on-write; a window past the end is a clear error."""
    import io

    import pytest

    from megatron_preflight.errors import CorruptFileError
    from megatron_preflight.torch_file import map_file

    blobs, windows = [], []
    for i in range(3):
        buf = io.BytesIO()
        torch.save(torch.arange(10 * (i + 1), dtype=torch.float32).reshape(i + 1, 10) + i, buf)
        windows.append((sum(len(b) for b in blobs), len(buf.getvalue())))
        blobs.append(buf.getvalue())
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"".join(blobs))
    before = path.read_bytes()
    shared = map_file(path)
    for i, window in enumerate(windows):
        f = TorchFile(path, window=window, mapping=shared)
        assert f._mmap is shared
        t = f.tensor(f.load_metadata())
        assert torch.equal(t, torch.arange(10 * (i + 1), dtype=torch.float32).reshape(i + 1, 10) + i)
        t.mul_(3)  # copy-on-write: the file keeps its bytes
        f.release_pages()
        f.close()
    assert path.read_bytes() == before
    with pytest.raises(CorruptFileError, match="truncated"):
        TorchFile(path, window=(windows[2][0], windows[2][1] + 1), mapping=shared)
    with pytest.raises(CorruptFileError, match="not a torch file"):
        TorchFile(path, window=(0, windows[0][1] - 10), mapping=shared)  # a blob without its zip directory


def _rss_pages() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])


def test_release_mapped_drops_the_pages_of_its_range_only(tmp_path):
    """release_mapped (libc's madvise without the GIL; mmap.madvise for a read-only mapping) drops exactly the
    pages of its range from the resident set: a 64 MiB mapping read whole, then half of it released."""
    import mmap
    import os

    import pytest

    from megatron_preflight.torch_file import release_mapped

    if not os.path.exists("/proc/self/statm") or not hasattr(mmap, "MADV_DONTNEED"):
        pytest.skip("needs Linux's /proc/self/statm and MADV_DONTNEED")
    path = tmp_path / "blob.bin"
    size = 64 << 20
    path.write_bytes(os.urandom(1 << 20) * 64)
    page = mmap.PAGESIZE
    for access in (mmap.ACCESS_COPY, mmap.ACCESS_READ):
        with open(path, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=access)
        before = _rss_pages()
        checksum = sum(m[i] for i in range(0, size, page))  # touch every page
        touched = _rss_pages() - before
        release_mapped(m, 0, size // 2)
        dropped = before + touched - _rss_pages()
        assert touched >= 0.9 * size / page and abs(dropped - size / page / 2) < 0.1 * size / page, (access, touched,
                                                                                                       dropped)
        assert sum(m[i] for i in range(0, size, page)) == checksum  # released pages read back the file's bytes
        m.close()


def test_byte_extent_gives_where_each_row_of_a_tensor_lies(tmp_path):
    """(offset, pitch) of saved tensors and views (rows a pitch apart, each contiguous): the file's bytes there are
    the tensor's rows; a view whose rows are not contiguous (transposed, every other column) has none."""
    from megatron_preflight.torch_file import row_pitch

    base = torch.arange(48, dtype=torch.float32).view(6, 8)
    path = tmp_path / "t.pt"
    torch.save({"whole": base, "cols": base[:, 2:5], "rows": base[1:4], "t": base.t(), "every_other": base[:, ::2],
                "one_row": base[4:5, 3:6]}, path)
    meta = read_torch_file(path)
    with TorchFile(path) as f, open(path, "rb") as fh:
        for name in ("whole", "cols", "rows", "one_row"):
            ref = meta[name]
            offset, pitch = f.byte_extent(ref)
            got = []
            for i in range(ref.shape[0]):
                fh.seek(offset + i * pitch)
                got.append(torch.frombuffer(bytearray(fh.read(ref.shape[1] * 4)), dtype=torch.float32))
            assert torch.equal(torch.stack(got), f.tensor(ref)), name
        assert f.byte_extent(meta["t"]) is None and f.byte_extent(meta["every_other"]) is None
    assert row_pitch((6, 3), (8, 1)) == 8 and row_pitch((1, 3), (99, 1)) == 3 and row_pitch((3, 4), (2, 1)) is None


def test_a_known_pickle_is_not_unpickled_again_but_its_storage_is_still_checked(tmp_path, monkeypatch):
    """Files that pickle the same bytes (a torch_dist checkpoint's chunks of one shape) are unpickled once; each
    file's own storage record is still checked: a copy whose record is cut short is a corrupt file, not a hit."""
    import pytest

    from megatron_preflight import torch_file
    from megatron_preflight.errors import CorruptFileError

    a, b, short = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "short.pt"
    torch.save(torch.arange(8, dtype=torch.float32), a)
    torch.save(torch.arange(8, dtype=torch.float32) * 2, b)
    with zipfile.ZipFile(a) as src, zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:8] if info.filename.endswith("data/0") else data)
    calls = []
    real = torch_file.bounded_load
    monkeypatch.setattr(torch_file, "bounded_load", lambda *x, **k: calls.append(1) or real(*x, **k))
    monkeypatch.setattr(torch_file, "_ONE_TENSOR", {})
    ra, rb = read_torch_file(a), read_torch_file(b)
    assert len(calls) == 1 and rb.file == str(b) and rb.shape == (8,)
    with TorchFile(b) as f:
        assert torch.equal(f.tensor(f.load_metadata()), torch.arange(8, dtype=torch.float32) * 2)
    with pytest.raises(CorruptFileError, match="should hold 8"):
        read_torch_file(short)
    assert ra.file == str(a)


def _flip_a_bit_of(path, record_suffix):
    """Flip one bit inside the data of the zip record named ``...<record_suffix>`` (as bit rot would)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_in_a_tensor_fails_its_crc_and_names_the_record(real_fixture):
    """torch.save stores a CRC-32 per record: a tensor read through TorchFile is checked against it the first time its
    storage is read (a legacy file, or a blob of a torch_dist file)."""
    from megatron_preflight.errors import PreflightError

    root = real_fixture("tp2_torch")
    path = f"{root}/iter_0000002/mp_rank_00/model_optim_rng.pt"
    meta = read_torch_file(path)
    ref = meta["model"]["decoder.layers.0.mlp.linear_fc1.weight"]
    with TorchFile(path) as f:
        good = f.tensor(ref).clone()
    _flip_a_bit_of(path, f"data/{ref.storage.key}")
    with TorchFile(path) as f, pytest.raises(PreflightError, match=f"data/{ref.storage.key}.*CRC-32") as err:
        f.tensor(ref)
    assert err.value.path == path and "bit rot" in err.value.message
    assert good.numel() > 0


@pytest.mark.parametrize("flags", [[], ["--verify"], ["--ckpt-format", "torch_dist"]],
                         ids=["plain", "verify", "to torch_dist"])
def test_a_reshard_of_a_damaged_file_stops_before_writing(real_fixture, tmp_path, flags):
    """Every reshard checks each record's CRC as it reads it (in a thread beside the reads; confirmed before a shard
    is kept), `fingerprint` too: a flipped bit stops it, naming the file, and nothing is written."""
    root = real_fixture("tp2_torch")
    path = f"{root}/iter_0000002/mp_rank_01/model_optim_rng.pt"
    ref = read_torch_file(path)["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    _flip_a_bit_of(path, f"data/{ref.storage.key}")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", root, str(out), "--tp", "1",
                        "--no-progress", *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "CRC-32" in r.stderr and "mp_rank_01" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "fingerprint", root], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "CRC-32" in r.stderr


def test_an_in_memory_build_of_a_damaged_file_stops_before_handing_it_over(real_fixture):
    """The in-memory load (what the hook hands Megatron) confirms every record's CRC before it returns."""
    from megatron_preflight.errors import PreflightError
    from megatron_preflight.reshard import TargetLayout, open_resharder

    root = real_fixture("tp2_torch")
    path = f"{root}/iter_0000002/mp_rank_00/model_optim_rng.pt"
    ref = read_torch_file(path)["model"]["decoder.layers.2.mlp.linear_fc2.weight"]
    _flip_a_bit_of(path, f"data/{ref.storage.key}")
    r = open_resharder(root, TargetLayout(tp=1))
    with pytest.raises(PreflightError, match="CRC-32"):
        r.build(r.plan_for_rank(0, 1))


def _a_matrix(tmp_path, rows: int = 64, cols: int = 48):
    """A torch.save file holding one contiguous bf16 matrix (and a column slice of it), with its ref."""
    path = str(tmp_path / "m.pt")
    t = torch.randn(rows, cols).to(torch.bfloat16)
    torch.save({"w": t, "cols": t[:, :8]}, path)
    return path, t, read_torch_file(path)


def _rows_into(f: TorchFile, ref: TensorRef, row0: int, rows: int) -> torch.Tensor | None:
    out = torch.empty(rows, *ref.shape[1:], dtype=torch.bfloat16)
    raw = out.view(-1).view(torch.uint8).numpy()
    value = f.read_rows(ref, row0, raw)
    if value is None:
        return None
    assert value == zlib.crc32(raw.tobytes()), "the CRC-32 returned is not that of the bytes read"
    return out


def test_rows_read_with_plain_io_equal_the_mapped_tensor(tmp_path):
    path, t, meta = _a_matrix(tmp_path)
    with TorchFile(path) as f:
        for row0, rows in ((0, 64), (0, 20), (20, 30), (63, 1)):
            got = _rows_into(f, meta["w"], row0, rows)
            assert got is not None and torch.equal(got, t[row0:row0 + rows])
        assert _rows_into(f, meta["cols"], 0, 4) is None  # strided rows: several runs, left to the mapped path
        one = _rows_into(f, meta["cols"], 5, 1)  # one row of it is one run
        assert one is not None and torch.equal(one, t[5:6, :8])
        f.finish_crc()


def test_rows_read_in_order_check_the_crc_when_the_record_is_complete(tmp_path):
    """A flipped bit in the second half: the in-order reads of the first half pass, the read that completes the
    record raises, naming it."""
    from megatron_preflight.errors import PreflightError

    path, _, meta = _a_matrix(tmp_path)
    ref = meta["w"]
    _flip_a_bit_of(path, f"data/{ref.storage.key}")  # the middle byte of the record (row 32 of 64)
    with TorchFile(path) as f:
        assert _rows_into(f, ref, 0, 16) is not None
        assert _rows_into(f, ref, 16, 16) is not None
        with pytest.raises(PreflightError, match=f"data/{ref.storage.key}.*CRC-32"):
            _rows_into(f, ref, 32, 32)


def test_rows_read_in_part_are_checked_by_finish_which_reads_the_rest(tmp_path):
    from megatron_preflight.errors import PreflightError

    path, _, meta = _a_matrix(tmp_path)
    ref = meta["w"]
    with TorchFile(path) as f:  # an intact record read in part: finish reads the rest and passes
        assert _rows_into(f, ref, 0, 10) is not None
        f.finish_crc()
        assert ref.storage.key in f._crc_checked
    _flip_a_bit_of(path, f"data/{ref.storage.key}")
    with TorchFile(path) as f:  # the flipped bit lies in the part not read: finish finds it
        assert _rows_into(f, ref, 0, 10) is not None
        with pytest.raises(PreflightError, match="CRC-32"):
            f.finish_crc()
    with TorchFile(path) as f:  # read out of order: the record is checked whole at once
        with pytest.raises(PreflightError, match="CRC-32"):
            _rows_into(f, ref, 10, 4)


@pytest.mark.parametrize("name", ["moe_ep2_torch", "distopt_tp2dp2_torch"])
def test_sampled_bytes_are_the_tensors_samples(name):
    """A replica's sampled check reads each piece's first, middle and last 32 elements as bytes (no tensor made):
    for every tensor of real Megatron-LM files, exactly the bytes the tensor path samples, or None (not contiguous,
    empty: left to the tensor path) — a column slice of a matrix too."""
    from megatron_preflight.reshard.execute.replicas import SAMPLE, _bytes, _sample_values
    from megatron_preflight.tree import iter_leaves

    root = fixture_path(name) + "/iter_0000002"
    shard = sorted(os.listdir(root))[0]
    for fname in sorted(os.listdir(os.path.join(root, shard))):
        path = os.path.join(root, shard, fname)
        refs = [v for _p, v in iter_leaves(read_torch_file(path)) if isinstance(v, TensorRef)]
        assert refs
        with TorchFile(path) as f:
            got = 0
            for ref in refs:
                sampled = f.sample_bytes(ref, SAMPLE)
                if sampled is not None:
                    got += 1
                    assert sampled == _bytes(_sample_values(f.tensor(ref))).numpy().tobytes(), ref
            column = next((r for r in refs if len(r.shape) == 2 and r.shape[1] > 1 and r.shape[0] > 1), None)
            if column is not None:  # (a distributed optimizer's file holds flat buffers)
                half = TensorRef(column.file, column.storage, column.offset + 1,
                                 (column.shape[0], column.shape[1] - 1), column.stride)
                assert f.sample_bytes(half, SAMPLE) is None  # rows apart: not one run
        assert got > len(refs) // 2
