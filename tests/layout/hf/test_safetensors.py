"""The safetensors tensor table, from headers only: offsets, sharded indexes, damaged files."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from megatron_preflight import dtypes
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.layout.hf.safetensors import INDEX, Run, SafeRef, safe_ref, tensor_table
from megatron_preflight.torch_file import StorageRef, row_major


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


def _raw(path, header: dict, body: int) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + b"\0" * body)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},  # a bool is no dim
    {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]},
    {"dtype": "F31", "shape": [2, 2], "data_offsets": [0, 16]},
    {"dtype": ["F32"], "shape": [2, 2], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", 16]},
    {"dtype": "F32", "shape": [[2], 2], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [2, 2]},
])
def test_a_malformed_entry_is_named_after_well_formed_ones_of_its_form(tmp_path, entry):
    """Entries are checked per (dtype, shape) form: one checked form lets no later malformed entry through."""
    good = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    _raw(tmp_path / "model.safetensors", {"a": good, "b": dict(good, data_offsets=[16, 32]), "bad": entry}, 48)
    with pytest.raises(CorruptFileError, match="tensor 'bad'"):
        tensor_table(str(tmp_path))


def test_a_second_entry_of_a_known_form_with_the_wrong_byte_count_is_refused(tmp_path):
    good = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    _raw(tmp_path / "model.safetensors", {"a": good, "b": dict(good, data_offsets=[16, 28])}, 32)
    with pytest.raises(CorruptFileError, match="tensor 'b': 12 bytes for shape"):
        tensor_table(str(tmp_path))


def test_empty_tensors_overlap_nothing_and_overlaps_are_named(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},  # inside a's bytes, but has none
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    _raw(tmp_path / "model.safetensors", header, 32)
    assert sorted(tensor_table(str(tmp_path)).tensors) == ["a", "b", "e"]
    header["c"] = {"dtype": "F32", "shape": [2], "data_offsets": [28, 36]}
    _raw(tmp_path / "model.safetensors", header, 36)
    with pytest.raises(CorruptFileError, match="tensors 'b' and 'c' share bytes"):
        tensor_table(str(tmp_path))


def test_a_truncated_file_names_only_its_own_cut_tensors(tmp_path):
    _write(str(tmp_path / "m-1.safetensors"), {"x": ("F32", [4, 4]), "w": ("F32", [2])})
    _write(str(tmp_path / "m-2.safetensors"), {"y": ("F32", [2]), "z": ("F32", [4])}, truncate=4)
    with open(tmp_path / INDEX, "w") as fh:
        json.dump({"weight_map": {"x": "m-1.safetensors", "w": "m-1.safetensors", "y": "m-2.safetensors",
                                  "z": "m-2.safetensors"}}, fh)
    (problem,) = tensor_table(str(tmp_path)).problems
    assert problem[0] == "truncated_file" and problem[1].endswith("m-2.safetensors")
    assert "1 tensor(s) cut: 'z'" in problem[2] and "up to byte" in problem[2]


@pytest.mark.parametrize("dim", ["true", "1.0", "1e0"])
def test_a_dim_equal_to_a_checked_one_but_not_an_int_is_refused(tmp_path, dim):
    """``true`` and ``1.0`` equal 1 in Python: a form checked with ``[1, 4]`` must not admit ``[true, 4]``."""
    raw = ('{"a": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]}, '
           f'"b": {{"dtype": "F32", "shape": [{dim}, 4], "data_offsets": [16, 32]}}}}').encode()
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + b"\0" * 32)
    with pytest.raises(CorruptFileError, match="tensor 'b': its header entry is malformed"):
        tensor_table(str(tmp_path))


def test_a_text_dim_beside_a_huge_one_is_refused_without_building_anything(tmp_path):
    """``"2" * 10**15`` would be a petabyte string: the dims' types are checked before any product."""
    _raw(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": ["2", 10**15], "data_offsets": [0, 8]},
                                          "b": {"dtype": "F32", "shape": [1.5, 10**15], "data_offsets": [8, 16]}}, 16)
    with pytest.raises(CorruptFileError, match="tensor 'a': its header entry is malformed"):
        tensor_table(str(tmp_path))


def test_a_ref_filled_directly_is_the_one_its_constructor_makes():
    """``safe_ref`` fills SafeRef / StorageRef without their ``__init__``: every field of both must be given (a field
    added to either dataclass later fails here, not in a load)."""
    runs = (Run("a.safetensors", 8, 48, 0),)
    made = safe_ref("k", "bfloat16", (4, 6), runs, add=1.0)
    built = SafeRef("a.safetensors", StorageRef("k", dtypes.dtype("bfloat16"), 24), 0, (4, 6), row_major((4, 6)),
                    runs=runs, add=1.0)
    assert made == built and hash(made) == hash(built)
    assert set(vars(made)) == {f.name for f in dataclasses.fields(SafeRef)}
    assert set(vars(made.storage)) == {f.name for f in dataclasses.fields(StorageRef)}
