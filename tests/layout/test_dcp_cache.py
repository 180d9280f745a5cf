"""layout/dcp_cache.py: a ``.metadata`` read once is not unpickled again — its facts come back from an index keyed by
its bytes, equal to the full read's on every real checkpoint Megatron-LM wrote; a changed file, a damaged index, the
other trust mode or a refused file never take facts from it."""

from __future__ import annotations

import glob
import json
import os
import pickle

import pytest
from torch.distributed.checkpoint import FileSystemReader

from megatron_preflight.cli.main import main
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import dcp_cache, dist
from tests.conftest import FIXTURES

_DIRS = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(FIXTURES, "*", "iter_*", ".metadata")))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Every .metadata indexed (whatever its size), into a dir of this test's own; the process's memory of what it
    read forgotten before and after (as in a fresh process)."""
    where = tmp_path / "cache"
    monkeypatch.setenv(dcp_cache.ENV, str(where))
    monkeypatch.setattr(dcp_cache, "MIN_BYTES", 0)
    _forget()
    yield where / "dcp-index"
    _forget()


def _forget() -> None:
    dist._FACTS_CACHE.clear()
    dist._METADATA_CACHE.clear()


def _no_full_read(monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the .metadata was unpickled again")

    monkeypatch.setattr(dist, "_read_dcp_metadata", refuse)


@pytest.mark.parametrize("iter_dir", _DIRS, ids=lambda d: os.path.basename(os.path.dirname(d)))
def test_the_index_gives_the_full_reads_facts_on_every_real_checkpoint(iter_dir, index, monkeypatch):
    full = dist.metadata_facts(iter_dir)
    assert len(os.listdir(index)) == 1
    _forget()
    _no_full_read(monkeypatch)
    assert dist.metadata_facts(iter_dir) == full
    assert full.objects and full.order  # (every real one has bytes items: the common state, extra states)


def test_the_verdict_is_the_same_from_the_index(index, monkeypatch, capsys):
    src = next(d for d in _DIRS if "moe" in d and "torch_dist" in d)
    assert main(["inspect", src, "--json"]) == 0
    cold = json.loads(capsys.readouterr().out)
    _forget()
    _no_full_read(monkeypatch)
    assert main(["inspect", src, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == cold


def _rewrite(md, iter_dir: str) -> None:
    path = os.path.join(iter_dir, ".metadata")
    st = os.stat(path)
    with open(path, "wb") as fh:
        pickle.dump(md, fh)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # (the same mtime: only the bytes tell)


def test_a_file_changed_in_place_is_read_again(index, real_fixture):
    iter_dir = os.path.dirname(glob.glob(os.path.join(real_fixture("bf16_gqa_tp2_torch_dist"), "iter_*", ".metadata"))[0])
    before = dist.metadata_facts(iter_dir)
    md = FileSystemReader(iter_dir).read_metadata()
    name = next(iter(md.state_dict_metadata))
    del md.state_dict_metadata[name]
    _rewrite(md, iter_dir)
    _forget()
    after = dist.metadata_facts(iter_dir)
    assert name in before.tensors and name not in after.tensors
    assert len(os.listdir(index)) == 2


@pytest.mark.parametrize("damage", ["garbage", "other key", "a string for an int", "an index out of range"])
def test_a_damaged_index_is_ignored_and_written_again(index, damage):
    iter_dir = _DIRS[0]
    want = dist.metadata_facts(iter_dir)
    (path,) = index.iterdir()
    doc = json.loads(path.read_bytes())
    if damage == "garbage":
        path.write_bytes(b"\x80not json")
    else:
        if damage == "other key":
            doc["key"] = "v1-safe-0"
        elif damage == "a string for an int":
            doc["objects"][2][0] = "0"
        else:
            doc["objects"][1][0] = len(doc["files"])
        path.write_text(json.dumps(doc))
    _forget()
    assert dist.metadata_facts(iter_dir) == want
    assert json.loads(path.read_bytes()) == json.loads(json.dumps(dcp_cache._encode(want, path.stem)))


def test_a_refused_metadata_is_never_indexed(index, tmp_path):
    iter_dir = tmp_path / "iter_0000001"
    iter_dir.mkdir()
    (iter_dir / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    for _ in range(2):
        _forget()
        with pytest.raises(PreflightError):
            dist.metadata_facts(str(iter_dir))
        assert not index.exists() or not os.listdir(index)


def test_the_trust_modes_are_indexed_apart():
    data = b"x" * (dcp_cache.MIN_BYTES + 1)
    assert dcp_cache.key_of(data, True) != dcp_cache.key_of(data, False)


def test_off_and_small_files_are_not_indexed(monkeypatch):
    monkeypatch.setenv(dcp_cache.ENV, "off")
    assert dcp_cache.cache_dir() is None and dcp_cache.key_of(b"x" * (dcp_cache.MIN_BYTES + 1), False) is None
    monkeypatch.setenv(dcp_cache.ENV, "/somewhere")
    assert dcp_cache.key_of(b"x" * (dcp_cache.MIN_BYTES - 1), False) is None


def test_a_dir_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(dcp_cache.ENV, str(blocker))  # (a dir cannot be made under a file)
    monkeypatch.setattr(dcp_cache, "MIN_BYTES", 0)
    _forget()
    try:
        assert dist.metadata_facts(_DIRS[0]).tensors
    finally:
        _forget()


def _count_full_reads(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    real = dist._read_dcp_metadata

    def counted(path, trust, data):
        calls.append(trust)
        return real(path, trust, data)

    monkeypatch.setattr(dist, "_read_dcp_metadata", counted)
    return calls


def test_a_trusted_reader_takes_a_safe_reads_facts_and_not_the_other_way(index, monkeypatch):
    iter_dir = _DIRS[0]
    calls = _count_full_reads(monkeypatch)
    safe = dist.metadata_facts(iter_dir)
    assert dist.metadata_facts(iter_dir, trust=True) == safe  # (from memory)
    _forget()
    assert dist.metadata_facts(iter_dir, trust=True) == safe  # (from the index)
    assert dist.read_dcp_metadata(iter_dir, trust=True) is not None and calls == [False, True]
    # a trusted read proves nothing about the allow-list: a safe reader reads the file itself
    for entry in index.iterdir():
        entry.unlink()
    _forget()
    dist.metadata_facts(iter_dir, trust=True)
    _forget()
    dist.metadata_facts(iter_dir)
    assert calls == [False, True, True, False]
    assert sorted(p.name.split("-")[1] for p in index.iterdir()) == ["safe", "trusted"]


def test_the_least_recently_used_entries_go_past_the_size_limit(index, monkeypatch):
    dirs = _DIRS[:3]
    for d in dirs:
        dist.metadata_facts(d)
    sizes = {p.name: p.stat().st_size for p in index.iterdir()}
    assert len(sizes) == 3
    first = dcp_cache.key_of(open(os.path.join(dirs[0], ".metadata"), "rb").read(), False) + ".json"
    os.utime(index / first, ns=(1, 1))  # (the oldest use)
    monkeypatch.setattr(dcp_cache, "MAX_TOTAL", sum(sizes.values()) - 1)
    _forget()
    dist.metadata_facts(_DIRS[3])  # a fourth entry: the least recently used ones go until the rest fit
    left = {p.name for p in index.iterdir()}
    assert first not in left and len(left) < 4
    assert dcp_cache.key_of(open(os.path.join(_DIRS[3], ".metadata"), "rb").read(), False) + ".json" in left


def test_where_the_index_lives(monkeypatch, tmp_path):
    monkeypatch.delenv(dcp_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dcp_cache.cache_dir() == str(tmp_path / "xdg" / "megatron-preflight")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dcp_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "megatron-preflight")
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)  # (no home: ~ stays ~)
    assert dcp_cache.cache_dir() is None
