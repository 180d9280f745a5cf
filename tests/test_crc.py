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
