"""CRC-32 (the zip / zlib polynomial) of bytes, as fast as this machine allows: ISA-L's (``isal``, ~15 GiB/s with
PCLMUL; ``pip install 'megatron-preflight[fast-crc]'``) where it is installed, zlib's (~3 GiB/s) otherwise. Every
storage record a reshard, an in-memory load or a fingerprint reads is checked with it (torch_file.TorchFile):
measured in benchmarks/bench_crc.py. Chosen on first use of a large record: a verdict, which reads only small pickles, never loads it."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_chosen: list[tuple[str, Callable[[Any], int]]] = []


def _fastest() -> tuple[str, Callable[[Any], int]]:
    try:
        from isal import isal_zlib  # deferred, optional: ISA-L's CRC-32, the same values as zlib's

        return "isal", isal_zlib.crc32
    except ImportError:
        return "zlib", zlib.crc32


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
