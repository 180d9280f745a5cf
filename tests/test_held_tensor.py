"""A tensor's bytes held without torch: the scalar ``torch.tensor(value)`` makes, its value, its tensor."""

import pytest
import torch

from megatron_preflight import dtypes
from megatron_preflight.held_tensor import HeldTensor


@pytest.mark.parametrize("value", [0, 7, 10**12, -3, 2.5, 0.1, True, False])
def test_a_scalar_is_what_torch_tensor_makes(value):
    held, want = HeldTensor.scalar(value), torch.tensor(value)
    assert dtypes.name_of(held.dtype) == dtypes.name_of(want.dtype) and held.shape == tuple(want.shape)
    assert held.data == want.numpy().tobytes()
    got = held.to_torch()
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert float(held) == float(want) and int(held) == int(want)


def test_its_bytes_must_fill_its_shape_and_only_one_element_has_a_value():
    with pytest.raises(ValueError):
        HeldTensor(dtypes.dtype("float32"), (2,), b"\0" * 4)
    pair = HeldTensor(dtypes.dtype("float32"), (2,), b"\0" * 8)
    with pytest.raises(TypeError):
        float(pair)
    assert pair.to_torch().shape == (2,)


def test_it_compares_by_content():
    assert HeldTensor.scalar(1.0) == HeldTensor.scalar(1.0) and HeldTensor.scalar(1.0) != HeldTensor.scalar(2.0)
    assert HeldTensor.scalar(1) != HeldTensor.scalar(1.0)  # int64 against float32
