"""layout/dcp_index.py: the facts a verdict reads from a DCP ``.metadata``, gathered in the pass that bounds it —
the same facts as the lenient read on every real torch_dist / fsdp_dtensor checkpoint Megatron-LM wrote, a departure
from torch's shape read leniently, and the bound held (a chunk list shared by every tensor is refused)."""

from __future__ import annotations

import glob
import os
import pickle
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from megatron_preflight.errors import UnsafePickleError
from megatron_preflight.layout import dcp_index, dist
from megatron_preflight.safe_pickle import safe_loads
from tests.conftest import FIXTURES

_DIRS = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(FIXTURES, "*", "iter_*", ".metadata")))


def _lenient(data: bytes, source: str) -> dcp_index.DcpFacts:
    got: list = []
    safe_loads(data, source=source, check=lambda obj, n, s: got.append(obj))
    return dcp_index._facts(*dcp_index._lenient_rows(got[0]))


def _strict(data: bytes, source: str) -> dcp_index.DcpFacts:
    got: list = []

    def check(obj, n, s):
        fields = dcp_index._fields(obj)
        rows, tensors, _rest, order = dcp_index._strict_rows(fields)  # raises _Departs off torch's shape
        got.append(dcp_index._facts(rows, tensors, [], order))

    safe_loads(data, source=source, check=check)
    return got[0]


def test_there_are_real_dcp_checkpoints_to_compare():
    assert len(_DIRS) >= 40


@pytest.mark.parametrize("iter_dir", _DIRS, ids=lambda d: os.path.basename(os.path.dirname(d)))
def test_the_one_pass_gives_the_lenient_reads_facts_on_a_real_checkpoint(iter_dir):
    path = os.path.join(iter_dir, ".metadata")
    with open(path, "rb") as fh:
        data = fh.read()
    strict, lenient = _strict(data, path), _lenient(data, path)  # (the strict pass takes every real one)
    assert strict == lenient
    assert strict.tensors and strict.file_ends and not strict.chunk_problems and not strict.unreadable
    assert dist.metadata_facts(iter_dir) == strict


def _write(md: Metadata, tmp_path) -> str:
    iter_dir = tmp_path / "iter_0000001"
    iter_dir.mkdir()
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return str(iter_dir)


def test_a_field_torch_does_not_write_is_read_leniently_with_the_same_facts(tmp_path):
    src = _DIRS[0]
    md = FileSystemReader(src).read_metadata()
    want = dist.metadata_facts(src)
    for info in md.storage_data.values():
        info.added_by_a_future_torch = 1  # not a field the strict pass knows: it departs
    got = dist.metadata_facts(_write(md, tmp_path))
    assert got == want


def test_a_chunk_list_shared_by_every_tensor_is_refused_and_quickly():
    # 8,000 tensors whose chunk lists are one memoised list of 8,000 chunks: a ~0.9 MB stream, 6.4 * 10^7 chunk visits
    n = 8000
    chunks = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(n)]
    tensors = {f"t{i}": TensorStorageMetadata(_properties(), torch.Size([n]), chunks) for i in range(n)}
    data = pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data={}))
    assert len(data) < 1_000_000
    with pytest.raises(dcp_index._Departs):  # the one pass departs at the second reference ...
        safe_loads(data, source="x/.metadata", check=lambda obj, n, s: dcp_index._strict_rows(obj.__dict__))
    start = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="expands"):  # ... and the generic walk refuses it
        safe_loads(data, source="x/.metadata", check=dcp_index.bounded_facts)
    assert time.perf_counter() - start < 30


def test_one_wide_chunk_record_referenced_by_every_chunk_is_counted_and_refused():
    # one tensor whose 300,000 chunks are one memoised record of two 64-dim shapes: a ~1.5 MB stream whose walk makes
    # ~4 * 10^7 references (every record shared, each expanding to 128 ints); torch's own shape otherwise
    shape = torch.Size([1] * 64)
    chunk = ChunkStorageMetadata(torch.Size([0] * 64), shape)
    tensors = {"t": TensorStorageMetadata(_properties(), shape, [chunk] * 300_000)}
    data = pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data={}))
    assert len(data) < 2_000_000
    dcp_index._strict_rows(safe_loads(data, source="x/.metadata", check=lambda *_: None).__dict__)  # shape: torch's
    start = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="expands"):  # counted past the limit: the generic walk refuses it
        safe_loads(data, source="x/.metadata", check=dcp_index.bounded_facts)
    assert time.perf_counter() - start < 30


def _properties():
    from torch.distributed.checkpoint.metadata import TensorProperties

    return TensorProperties(dtype=torch.float32)


def test_a_truncated_storage_entry_is_named_not_a_traceback(tmp_path):
    md = FileSystemReader(_DIRS[0]).read_metadata()
    first = next(iter(md.storage_data.values()))
    del first.length
    iter_dir = _write(md, tmp_path)
    facts = dist.metadata_facts(iter_dir)
    assert len(facts.unreadable) == 1 and "storage entry" in facts.unreadable[0]
