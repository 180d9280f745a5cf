"""Functions of the C library, called through ctypes (which drops the GIL for the call): None where there is no
libc to call, and the caller takes its portable path."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any


def function(name: str, argtypes: tuple[Any, ...], restype: Any = ctypes.c_int) -> Any:
    """libc's ``name`` with its argument and result types set, or None when it cannot be reached."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_MADVISE = function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
HAS_MADVISE = _MADVISE is not None


def madvise(addr: int, nbytes: int, advice: int) -> bool:
    """``madvise`` over ``addr .. addr + nbytes``, widened down to its first page (the kernel takes a page-aligned
    start); False when libc cannot be called or the call fails (advice is best effort)."""
    if _MADVISE is None or nbytes <= 0:
        return False
    lo = addr - addr % mmap.PAGESIZE
    return _MADVISE(lo, addr + nbytes - lo, advice) == 0


_SYNC_FILE_RANGE = function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """Linux's ``sync_file_range`` (start, or wait for, the writeback of a byte range of a file); False where there is
    none or it fails (e.g. a file system without it): the caller's fsync still makes the file durable."""
    if _SYNC_FILE_RANGE is None or nbytes <= 0:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, flags) == 0
