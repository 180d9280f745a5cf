"""layout/dist.py: a torch_dist checkpoint's sharded objects read one by one and through ObjectReader (real
checkpoints Megatron-LM wrote, with Transformer Engine's extra states)."""

from __future__ import annotations

import io
import os
import shutil
import types

import pytest
import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import dist
from tests.conftest import fixture_path


def _objects(name: str) -> tuple[str, dict]:
    iter_dir = os.path.join(fixture_path(name), "iter_0000002")
    return iter_dir, dist.object_index(dist.read_dcp_metadata(iter_dir))


@pytest.mark.parametrize("tensors", [False, True])
def test_the_reader_gives_each_object_as_read_object_does_parsing_each_distinct_blob_once(tensors):
    iter_dir, objects = _objects("mtp_moe_te_ep2_torch_dist")
    extra = {fqn: info for fqn, info in objects.items() if "_extra_state" in fqn}
    assert len(extra) > 20
    reader = dist.ObjectReader(iter_dir)
    try:
        for fqn, info in extra.items():
            got = reader.read(fqn, info, tensors=tensors)
            want = dist.read_object(iter_dir, fqn, info, tensors=tensors)
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want)
            else:
                assert repr(got) == repr(want)
        assert len(reader._parsed) < len(extra)  # TE's extra states repeat: parsed once per distinct blob
    finally:
        reader.close()


def test_a_tensor_in_an_object_is_a_copy_for_each_caller(tmp_path):
    """Two objects with the same bytes (an FP8 extra state is a uint8 tensor) come back as two tensors."""
    blob = io.BytesIO()
    torch.save([torch.arange(10, dtype=torch.uint8)], blob)
    data = blob.getvalue()
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 7 + data + data)
    reader = dist.ObjectReader(str(tmp_path))
    try:
        a, b = (reader.read(f"m{i}._extra_state/shard_0_1", types.SimpleNamespace(
            relative_path="__0_0.distcp", offset=7 + i * len(data), length=len(data)), tensors=True) for i in (0, 1))
        assert torch.equal(a, torch.arange(10, dtype=torch.uint8)) and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr() and len(reader._parsed) == 1
    finally:
        reader.close()


def test_a_truncated_data_file_is_reported_as_read_object_reports_it(tmp_path):
    src = fixture_path("mtp_moe_te_ep2_torch_dist")
    copy = tmp_path / "ckpt"
    shutil.copytree(src, copy)
    iter_dir, objects = _objects("mtp_moe_te_ep2_torch_dist")
    iter_dir = str(copy / "iter_0000002")
    fqn, info = max(objects.items(), key=lambda kv: int(kv[1].offset))  # the last object of some data file
    with open(os.path.join(iter_dir, info.relative_path), "r+b") as fh:
        fh.truncate(int(info.offset) + int(info.length) // 2)
    reader = dist.ObjectReader(iter_dir)
    try:
        with pytest.raises(PreflightError) as got:
            reader.read(fqn, info)
    finally:
        reader.close()
    with pytest.raises(PreflightError) as want:
        dist.read_object(iter_dir, fqn, info)
    assert got.value.message == want.value.message and "truncated" in got.value.message
