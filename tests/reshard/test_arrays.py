"""The bytes kit's value conversions are torch's, bit for bit: rounding to nearest even, ties, subnormals, overflow to
infinity, NaN kept a NaN; every bf16 and fp16 bit pattern widened exactly."""

import numpy as np
import pytest
import torch

from megatron_preflight import dtypes
from megatron_preflight.reshard.arrays import BYTES, float_values


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(dtypes.int_view(t.dtype)).numpy().view(dtypes.byte_element(t.dtype))


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    scaled = rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-45, 38, 20000)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 65504, 65520, 6e-8,
               1.00390625, 1.01171875, 1.0078125, 1.0000001]  # ties of bf16 and fp16 among them
    patterns = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaNs too
    with np.errstate(over="ignore"):
        return np.concatenate([scaled.astype(np.float32), np.array(special, np.float32), patterns])


@pytest.mark.parametrize("src", ["float32", "float64"])
@pytest.mark.parametrize("dst", ["bfloat16", "float16", "float32", "float64"])
def test_a_narrowing_or_widening_is_torch_s(src, dst):
    with np.errstate(invalid="ignore"):  # (signalling NaN patterns among them)
        values = _values().astype(src)
    got = BYTES.converted(values.view(dtypes.byte_element(dtypes.dtype(src))), dtypes.dtype(src), dtypes.dtype(dst))
    want = torch.from_numpy(values.copy()).to(getattr(torch, dst))
    nan = torch.isnan(want).numpy()
    assert np.array_equal(got[~nan], _bits(want)[~nan])
    assert np.array_equal(np.isnan(float_values(got, dtypes.dtype(dst))), nan)


@pytest.mark.parametrize("src", ["bfloat16", "float16"])
def test_every_half_precision_pattern_widens_exactly(src):
    patterns = np.arange(2**16, dtype=np.uint16)
    got = float_values(patterns, dtypes.dtype(src)).astype(np.float32)
    want = torch.from_numpy(patterns.view(np.int16).copy()).view(getattr(torch, src)).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
