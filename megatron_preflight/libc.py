"""Functions of the C library, called through ctypes (which drops the GIL for the call): None where there is no
libc to call, and the caller takes its portable path."""

from __future__ import annotations

import ctypes
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
