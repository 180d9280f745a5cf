"""The CRC-32 every record read is checked with: ISA-L's where installed, zlib's otherwise — the same values."""

import os
import sys
import zlib

import pytest

from megatron_preflight import crc


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1 << 20])
def test_the_crc_is_zlibs(size):
    data = os.urandom(size)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])


def test_without_isal_zlib_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)  # import isal fails
    monkeypatch.setattr(crc, "_chosen", [])
    assert crc.implementation() == "zlib"
    data = os.urandom(1000)
    assert crc.crc32(data) == zlib.crc32(data)


def test_isal_is_used_where_installed(monkeypatch):
    pytest.importorskip("isal")
    monkeypatch.setattr(crc, "_chosen", [])
    assert crc.implementation() == "isal"


@pytest.mark.parametrize("split", [0, 1, 999, 4096, 70_000])
def test_combine_gives_the_crc_of_the_joined_bytes(split, monkeypatch):
    """Both the ISA-L combine (where installed) and the pure-Python one (without it)."""
    data = os.urandom(70_000)
    a, b = data[:split], data[split:]
    want = zlib.crc32(data)
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    assert crc._combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setattr(crc, "_chosen", [])
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want


def test_the_pure_combine_agrees_with_isal_on_lengths_too_long_to_hash_here():
    """Lengths past 2^32 bytes wrap the table of powers (x^(2^32) = x mod P): checked against ISA-L's C code."""
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    for length in (1 << 31, (1 << 32) + 17, (1 << 40) + 12345, 3 * (1 << 45) + 1):
        for c1, c2 in ((0, 0), (0xDEADBEEF, 0x12345678), (1, 0xFFFFFFFF)):
            assert crc._combine(c1, c2, length) == isal_zlib.crc32_combine(c1, c2, length) & 0xFFFFFFFF
