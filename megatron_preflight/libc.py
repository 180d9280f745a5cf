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


_STATX = function("statx", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p))
_AT_EMPTY_PATH, _STATX_DIOALIGN = 0x1000, 0x2000
_STATX_SIZE, _DIO_MEM_ALIGN_AT = 256, 0x98  # struct statx's size; its stx_dio_mem_align, stx_dio_offset_align


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """The memory and file-offset alignment direct I/O (``O_DIRECT``) needs on the open file ``fd``, as the kernel
    reports it (``statx``'s ``STATX_DIOALIGN``, Linux 6.1+); None where the file system does not support direct I/O
    or does not say (tmpfs, most network and FUSE file systems, older kernels)."""
    if _STATX is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _STATX(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    raw = buf.raw
    if not int.from_bytes(raw[0:4], "little") & _STATX_DIOALIGN:
        return None
    mem = int.from_bytes(raw[_DIO_MEM_ALIGN_AT:_DIO_MEM_ALIGN_AT + 4], "little")
    offset = int.from_bytes(raw[_DIO_MEM_ALIGN_AT + 4:_DIO_MEM_ALIGN_AT + 8], "little")
    return (mem, offset) if mem and offset else None
