"""Offline writer: atomic, never touches the source, refuses to drop optimizer state silently, verifies."""

import os

import pytest
import torch

from megatron_preflight.cli.main import main
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path
from tests.layout.test_problems import _snapshot
from tests.reshard.test_roundtrip_real import model_tensors, optimizer_entries


def test_refuses_to_drop_optimizer_silently(tmp_path, monkeypatch):
    # A distributed optimizer whose buffers do not follow the modelled layout (here: another alignment) cannot be
    # resharded: refused unless the user accepts dropping it.
    from megatron_preflight.reshard.optimizer import distributed as dist_optimizer

    monkeypatch.setattr(dist_optimizer, "ALIGN", 32)
    with pytest.raises(PreflightError) as exc:
        write_resharded(fixture_path("tp2_distopt_torch"), str(tmp_path / "out"), TargetLayout(tp=1))
    assert "--drop-optimizer" in str(exc.value) and "gradient buffer 0 records 23680 elements" in str(exc.value)
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_cli_writes_atomically_and_leaves_source_alone(real_fixture, tmp_path, capsys):
    src = real_fixture("pp2_torch")
    before = _snapshot(src)
    dst = tmp_path / "new"
    rc = main(["reshard", src, str(dst), "--pp", "1", "--tp", "2", "--verify", "--drop-optimizer", "--workers", "2",
               "--no-progress"])
    assert rc == 0 and _snapshot(src) == before
    out = capsys.readouterr().out
    assert "verified" in out and "not carried: rng_state" in out and "peak RSS" in out
    layout = discover(str(dst))
    assert layout.ok and (layout.tp, layout.pp) == (2, 1)
    assert sorted(os.listdir(dst)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".new")] == []


@pytest.mark.parametrize("fmt", ["torch", "hf"])
def test_a_destination_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, fmt):
    """A file system with less free space than the new checkpoint's tensors (legacy shards, an HF export): one clear
    error naming the destination, both sizes and the fix, a non-zero exit, no temp dir left; the source untouched.
    The free space is what statvfs says (a stand-in here: this box's disk has room)."""
    import collections

    from megatron_preflight.reshard.targets import offline

    src = fixture_path("bf16_gqa_tp2_torch")
    before = _snapshot(src)
    real = os.statvfs
    Stat = collections.namedtuple("Stat", "f_bavail f_frsize f_flag")

    def nearly_full(path):
        return Stat(10, 4096, real(path).f_flag)  # 40 KiB free

    monkeypatch.setattr(offline.os, "statvfs", nearly_full)
    dst = tmp_path / "new"
    argv = ["reshard", src, str(dst), "--no-progress", "--tp", "1"] + (["--ckpt-format", "hf"] if fmt == "hf" else [])
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "needs at least" in err and "40.0 KB free" in err and str(dst) in err and "Fix: free space" in err, err
    assert not dst.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".new")] == []
    assert _snapshot(src) == before
    monkeypatch.setattr(offline.os, "statvfs", real)
    assert main(argv) == 0  # (with room, the same command writes it)


def test_existing_destination_and_dst_inside_src_refused(real_fixture, tmp_path, capsys):
    src = real_fixture("tp2_torch")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["reshard", src, str(tmp_path / "full"), "--tp", "1", "--drop-optimizer"]) == 2
    assert main(["reshard", src, os.path.join(src, "inner"), "--tp", "1", "--drop-optimizer"]) == 2
    assert "never written" in capsys.readouterr().err


def test_target_from_megatron_flags(tmp_path):
    dst = tmp_path / "ep1"
    rc = main(["reshard", fixture_path("moe_ep2_torch"), str(dst), "--drop-optimizer", "--no-progress", "--",
               "--expert-model-parallel-size", "1", "--num-experts", "4", "--hidden-size", "32"])
    assert rc == 0 and discover(str(dst)).ep == 1


def test_drop_optimizer_leaves_it_out_and_says_so(tmp_path, capsys):
    dst = tmp_path / "tp1"
    assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--tp", "1", "--drop-optimizer", "--no-progress"]) == 0
    assert "not carried: optimizer" in capsys.readouterr().out
    layout = discover(str(dst))
    assert layout.ok and "optimizer" not in layout.shards[0].meta


def test_plain_optimizer_carried_by_default(tmp_path, capsys):
    dst = tmp_path / "tp1"
    assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--tp", "1", "--verify", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "not carried: optimizer" not in out and "not carried: rng_state" in out
    opt = discover(str(dst)).shards[0].meta["optimizer"]
    assert [len(g["params"]) for g in opt["param_groups"]] == [18, 34] and len(opt["state"]) == 52


@pytest.mark.parametrize("name, target", [
    ("tp2_torch", TargetLayout(tp=1)), ("tp1_torch", TargetLayout(tp=2)), ("moe_ep2_torch", TargetLayout(tp=2, ep=1)),
])
def test_row_chunked_streaming_equals_whole_tensors(tmp_path, monkeypatch, name, target):
    """Target tensors are built and written a few rows at a time; the bytes are the same as building them whole."""
    from megatron_preflight.reshard.targets import stream_save

    whole, chunked = str(tmp_path / "whole"), str(tmp_path / "chunked")
    write_resharded(fixture_path(name), whole, target)
    monkeypatch.setattr(stream_save, "CHUNK_BYTES", 100)  # a few rows per piece: splits inside every tensor
    write_resharded(fixture_path(name), chunked, target, verify=True)
    a, b = model_tensors(whole), model_tensors(chunked)
    assert list(a) == list(b)
    assert all(torch.equal(a[k][0], b[k][0]) if isinstance(a[k][0], torch.Tensor) else a[k] == b[k] for k in a)
    oa, ob = optimizer_entries(whole), optimizer_entries(chunked)
    assert oa.keys() == ob.keys()
    assert all(torch.equal(oa[k][0], ob[k][0]) if isinstance(oa[k][0], torch.Tensor) else oa[k] == ob[k] for k in oa)


def test_written_files_load_with_torch_load(tmp_path, monkeypatch):
    """torch.load (plain and mmap) reads what the streaming writer wrote; records are 64-byte aligned as torch's."""
    import enum
    import struct
    import zipfile

    dst = str(tmp_path / "tp1")
    write_resharded(fixture_path("tp2_torch"), dst, TargetLayout(tp=1))
    path = os.path.join(dst, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    with zipfile.ZipFile(path) as z, open(path, "rb") as fh:
        for info in z.infolist():
            fh.seek(info.header_offset)
            n, e = struct.unpack("<HH", fh.read(30)[26:30])
            assert (info.header_offset + 30 + n + e) % 64 == 0, info.filename
    # The args name a Megatron enum that megatron-core 0.16.1 lacks (the fixtures were written by Megatron-LM main):
    # a stand-in class, for this load only.
    import megatron.core.transformer.enums as enums

    monkeypatch.setattr(enums, "InferenceCudaGraphScope",
                        enum.Enum("InferenceCudaGraphScope", {f"v{i}": i for i in range(8)}), raising=False)
    ours = model_tensors(dst)
    for mmap in (False, True):
        sd = torch.load(path, weights_only=False, mmap=mmap)
        assert list(sd["model"]) == [k[2] for k in ours]
        for (_, _, key), (t, _) in ours.items():
            assert torch.equal(sd["model"][key], t) if isinstance(t, torch.Tensor) else sd["model"][key] == t
        assert len(sd["optimizer"]["state"]) == 52


def test_optimizer_group_order_flag(tmp_path):
    """A TP-only source cannot show how its Megatron orders param groups; the loading version can be named."""
    for order, want in (("per-rank", [0.0, 1.0]), ("sorted", [1.0, 0.0])):
        dst = tmp_path / order
        assert main(["reshard", fixture_path("tp2_torch"), str(dst), "--pp", "2", "--no-progress",
                     "--optimizer-group-order", order]) == 0
        last = discover(str(dst)).shards[-1]  # mp_rank_01_001: a last stage, which meets a layernorm first
        assert last.name.endswith("_001")
        assert [g["wd_mult"] for g in last.meta["optimizer"]["param_groups"]] == want


@pytest.mark.parametrize("chunk", [None, 100])
@pytest.mark.parametrize("name, target", [
    ("moe_ep2_torch", TargetLayout(tp=2, ep=1)), ("tp2_torch", TargetLayout(tp=1)), ("tp1_torch", TargetLayout(tp=2)),
    ("moe_shared_tp2pp2ep2_torch_dist", TargetLayout(tp=1, pp=1, ep=1)),  # whole torch_dist chunks read with pread
])
def test_every_record_written_holds_its_bytes_crc(tmp_path, monkeypatch, name, target, chunk):
    """The streamed writer takes a record's CRC-32 from the CRC-32s its plain reads took (combined) where they built
    the piece, over the bytes otherwise (column slices, carried tensors): zipfile's own check of every record passes,
    whole pieces or pieces of a few rows."""
    import glob
    import zipfile

    from megatron_preflight import crc
    from megatron_preflight.reshard.targets import stream_save

    if chunk:
        monkeypatch.setattr(stream_save, "CHUNK_BYTES", chunk)
    combined = []
    monkeypatch.setattr(crc, "combine", lambda *a, _real=crc.combine: combined.append(a) or _real(*a))
    dst = str(tmp_path / "out")
    write_resharded(fixture_path(name), dst, target)
    files = glob.glob(os.path.join(dst, "iter_*", "*", "*.pt"))
    assert files
    for path in files:
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, path
    if name.startswith("moe_"):  # experts merged: whole source tensors (or chunks) read with plain I/O
        assert combined, "no record's CRC-32 was taken from its reads"


def test_tiled_crc_only_from_spans_that_cover_the_rows_each_with_a_crc():
    import os
    import zlib

    from megatron_preflight.reshard.execute.executor import tiled_crc

    data = os.urandom(300)
    spans = [(100, 200, zlib.crc32(data[100:])), (0, 100, zlib.crc32(data[:100]))]
    assert tiled_crc(spans, 300) == zlib.crc32(data)
    assert tiled_crc(spans, 301) is None  # padding after them
    assert tiled_crc(spans[:1], 300) is None  # a gap
    assert tiled_crc([*spans, (0, 0, None)], 300) is None  # an op copied through a mapping
    assert tiled_crc([], 0) == 0


@pytest.mark.parametrize("crc_checked", [True, False])
@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_verify_finds_a_byte_changed_between_write_and_read_back(tmp_path, monkeypatch, where, crc_checked):
    """--verify reads every written slice back: a byte flipped in the written file before the read-back (a bad disk,
    a bad copy) stops the reshard, nothing renamed into place — by the record's CRC-32, and, where the CRC matches
    the wrong bytes (a writer that built them wrong; here the read-back's CRC check is switched off to stand for it),
    by the bit-for-bit comparison with the source slice."""
    import zipfile

    from megatron_preflight.reshard.targets import legacy

    real = legacy.verify_shard
    if not crc_checked:
        class NoCrc(legacy.TorchFile):
            def tensor(self, ref, verify=True):
                return super().tensor(ref, verify=False)

            def array(self, ref, verify=True):  # (a legacy output is read back as bytes)
                return super().array(ref, verify=False)

            def check_record(self, key, got):  # (the direct read-back's check: read_back.ReadBack)
                return None

        monkeypatch.setattr(legacy, "TorchFile", NoCrc)

    def flip_then_verify(plan, path, files):
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if i.filename.endswith(f"/data/{_record_of(path, where)}"))
        with open(path, "r+b") as fh:  # (a byte inside the record's data: its local header, then 5 bytes in)
            fh.seek(info.header_offset + 30 + len(info.filename) + len(info.extra) + 5)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x40]))
        return real(plan, path, files)

    monkeypatch.setattr(legacy, "verify_shard", flip_then_verify)
    why = "does not match the CRC-32" if crc_checked else "verify: .* does not match its source slice"
    with pytest.raises(PreflightError, match=why):
        write_resharded(fixture_path("tp2_torch"), str(tmp_path / "out"), TargetLayout(tp=1), verify=True)
    assert not (tmp_path / "out").exists()


def _record_of(path, where):
    """The storage record of the first tensor (more than 8 elements) of the file's model, or optimizer state."""
    from megatron_preflight.torch_file import TensorRef, TorchFile

    with TorchFile(path) as f:
        meta = f.load_metadata()
    stack = [meta["model"] if where == "model" else meta["optimizer"]["state"]]
    while stack:
        v = stack.pop(0)
        if isinstance(v, TensorRef) and v.numel > 8:
            return v.storage.key
        if isinstance(v, dict):
            stack.extend(v.values())
    raise AssertionError("no tensor")


def test_a_vocab_padded_otherwise_than_the_source_model_takes_is_said_and_its_fix_runs(tmp_path):
    """A Hugging Face model resharded to TP2 with run flags after -- that leave --make-vocab-size-divisible-by out
    (Megatron's default, 128) is padded to other rows than the model's printed flags (16) build: the summary says so
    with the fix; the fix, applied as printed, gives the rows the printed flags build, and no note."""
    pytest.importorskip("transformers")
    import contextlib
    import io
    import re
    import shlex

    from megatron_preflight.cli.main import main
    from megatron_preflight.reshard import open_index
    from tests.helpers import hf_models

    src = hf_models.write("llama", str(tmp_path / "hf"))

    def reshard(dst: str, *flags: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["reshard", src, dst, "--no-progress", "--ckpt-format", "torch", "--", *flags]) == 0
        return out.getvalue()

    said = reshard(str(tmp_path / "a"), "--tensor-model-parallel-size", "2")
    assert "hold 256 rows (128 in the source)" in said and "the source's model takes 16" in said
    fix = re.search(r"or add (--make-vocab-size-divisible-by \d+) there", said).group(1)
    said = reshard(str(tmp_path / "b"), "--tensor-model-parallel-size", "2", *shlex.split(fix))
    assert "note: the embedding" not in said
    assert open_index(str(tmp_path / "b")).layout.saved_args.padded_vocab_size == 128
