"""Dtypes by name (no torch needed) agree with torch's; one-element tensors are read as numbers without torch."""

from __future__ import annotations

import pytest
import torch

from megatron_preflight import dtypes
from megatron_preflight.torch_file import TorchFile


@pytest.mark.parametrize("name", sorted(dtypes.NAMES))
def test_named_dtype_matches_torch(name):
    real = getattr(torch, name, None)
    if not isinstance(real, torch.dtype):
        pytest.skip(f"this torch has no {name}")
    named = dtypes.DType(dtypes.canonical(name), *dtypes._INFO[dtypes.canonical(name)])
    assert str(named) == str(real)
    assert named == real and real == named
    assert named.itemsize == real.itemsize
    assert named.is_floating_point == real.is_floating_point
    assert dtypes.name_of(real) == dtypes.name_of(named)
    assert dtypes.to_torch(named) is real


def test_storage_classes_name_real_dtypes():
    for cls, name in dtypes.STORAGE_DTYPES.items():
        storage = getattr(torch, cls, None)
        if storage is None or cls == "UntypedStorage":
            continue
        assert storage(0).dtype == getattr(torch, name), cls


def test_not_a_dtype():
    assert dtypes.name_of("float32") is None and dtypes.name_of(None) is None
    assert not dtypes.is_dtype(4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_item_reads_scalars_without_torch(tmp_path, dtype):
    values = {"step": torch.tensor(37, dtype=dtype) if dtype != torch.bool else torch.tensor(True),
              "row": torch.arange(6).to(dtype)[3:4], "big": torch.zeros(3, dtype=dtype)}
    path = tmp_path / "x.pt"
    torch.save(values, path)
    with TorchFile(path) as f:
        meta = f.load_metadata()
        assert f.item(meta["step"]) == values["step"].item()
        assert f.item(meta["row"]) == values["row"].item()  # an offset into a shared storage
        assert f.item(meta["big"]) is meta["big"]  # not a scalar: left as a reference


def test_same_bits_compares_bits_in_place():
    """Bits, not values: a NaN equals its own bits, -0.0 is not 0.0; strided views compare without a copy; a shape or
    width difference is a difference; bool tensors compare too."""
    import torch

    from megatron_preflight import dtypes

    a = torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16)
    assert dtypes.same_bits(a, a.clone())
    assert not dtypes.same_bits(a, torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16))
    m = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert dtypes.same_bits(m[:, 1:3], m.clone()[:, 1:3]) and not dtypes.same_bits(m[:, 1:3], m[:, 2:4])
    assert not dtypes.same_bits(m, m.view(4, 3)) and not dtypes.same_bits(m, m.double())
    assert dtypes.same_bits(torch.tensor([True, False]), torch.tensor([True, False]))
    assert not dtypes.same_bits(torch.tensor([True, False]), torch.tensor([True, True]))
    assert dtypes.int_view(torch.float16) == torch.int16 and dtypes.int_view(dtypes.dtype("bfloat16")) == torch.int16
