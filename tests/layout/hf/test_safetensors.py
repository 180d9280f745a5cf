"""The safetensors tensor table, from headers only: offsets, sharded indexes, damaged files."""

from __future__ import annotations

import json
import struct

import pytest

from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.hf.safetensors import INDEX, tensor_table


def _write(path: str, tensors: dict[str, tuple[str, list[int]]], truncate: int = 0) -> None:
    header, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = 4 if dtype == "F32" else 2
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + b"\0" * (at - truncate))


def test_offsets_are_absolute_and_match_the_safetensors_package(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    import torch

    a, b = torch.randn(3, 5), torch.randn(7).to(torch.bfloat16)
    safetensors.save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    table = tensor_table(str(tmp_path))
    data = (tmp_path / "model.safetensors").read_bytes()
    t = table.tensors["a"]
    assert (t.dtype, t.shape) == ("float32", (3, 5))
    assert torch.equal(torch.frombuffer(bytearray(data[t.start:t.end]), dtype=torch.float32).view(3, 5), a)
    assert table.tensors["b"].dtype == "bfloat16" and table.problems == []


def test_a_sharded_index_with_a_missing_file_and_a_truncated_one(tmp_path):
    _write(str(tmp_path / "m-1.safetensors"), {"x": ("F32", [4, 4])}, truncate=8)
    with open(tmp_path / INDEX, "w") as fh:
        json.dump({"weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors", "z": "m-1.safetensors"}}, fh)
    table = tensor_table(str(tmp_path))
    codes = sorted(p[0] for p in table.problems)
    assert codes == ["missing_file", "missing_tensor", "truncated_file"]
    assert any(p[1].endswith("m-2.safetensors") for p in table.problems)


def test_a_header_that_is_not_one(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CorruptFileError, match="not a safetensors file"):
        tensor_table(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 3) + b"{no")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        tensor_table(str(tmp_path))
