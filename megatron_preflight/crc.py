"""CRC-32 (the zip / zlib polynomial) of bytes, as fast as this machine allows: ISA-L's (``isal``, a default
dependency where a wheel exists: x86-64 and ARM64; 8.7 GiB/s on the 2-core CI box, ~15 with PCLMUL on a server) where
it is installed, zlib's (2.7 GiB/s there) otherwise. Every
storage record a reshard, an in-memory load or a fingerprint reads is checked with it (torch_file.TorchFile):
measured in benchmarks/bench_crc.py. Chosen on first use of a large record: a verdict, which reads only small pickles, never loads it."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_chosen: list[tuple[str, Callable[[Any, int], int], Callable[[int, int, int], int]]] = []


def _fastest() -> tuple[str, Callable[[Any, int], int], Callable[[int, int, int], int]]:
    try:
        from isal import isal_zlib  # deferred, optional: ISA-L's CRC-32, the same values as zlib's

        return "isal", isal_zlib.crc32, isal_zlib.crc32_combine
    except ImportError:
        return "zlib", zlib.crc32, _combine  # Python's zlib module has no crc32_combine


def implementation() -> str:
    """Which CRC-32 this process uses ("isal" or "zlib")."""
    if not _chosen:
        _chosen.append(_fastest())
    return _chosen[0][0]


_SMALL = 1 << 20  # below this zlib's CRC costs less than loading ISA-L (a verdict's pickles are all small)


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of a bytes-like object (a memoryview of a mapping: nothing copied); ``value``: the CRC of the bytes
    before it (a record taken in pieces)."""
    if len(data) < _SMALL:
        return zlib.crc32(data, value) & 0xFFFFFFFF
    if not _chosen:
        _chosen.append(_fastest())
    return _chosen[0][1](data, value) & 0xFFFFFFFF


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of bytes ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and ``len(B)``, without the bytes: a
    record read in pieces is checked and written with one pass over each piece (each piece's own CRC, combined)."""
    if not _chosen:
        _chosen.append(_fastest())
    return _chosen[0][2](crc1, crc2, len2) & 0xFFFFFFFF


# CRC-32 as polynomial arithmetic over GF(2) modulo the zip polynomial, bit-reflected (the top bit holds x^0): the
# CRC of A + B is (CRC(A) * x^(8 len B) mod P) xor CRC(B). _POWERS[k] = x^(2^k) mod P, for len B's binary digits.
_POLY = 0xEDB88320
_ONE = 1 << 31  # x^0


def _mul(a: int, b: int) -> int:
    """a * b mod P."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


_POWERS = [_ONE >> 1]  # x^1
for _ in range(31):
    _POWERS.append(_mul(_POWERS[-1], _POWERS[-1]))


def _combine(crc1: int, crc2: int, len2: int) -> int:
    """:func:`combine` without ISA-L: x^(8 len2) mod P from the powers of len2's set bits (~32 products)."""
    shift, k = _ONE, 3  # 8 = 2^3 bits per byte
    while len2:
        if len2 & 1:
            shift = _mul(_POWERS[k & 31], shift)
        len2 >>= 1
        k += 1
    return _mul(shift, crc1) ^ crc2
