"""libc functions through ctypes: set up with their types, or None where they cannot be reached."""

import ctypes
import mmap

from megatron_preflight import libc


def test_a_libc_function_is_callable_with_its_types_and_a_missing_one_is_none():
    memcmp = libc.function("memcmp", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t))
    a, b = ctypes.create_string_buffer(b"abcd"), ctypes.create_string_buffer(b"abce")
    assert memcmp(a, a, 4) == 0 and memcmp(a, b, 4) < 0 and memcmp(a, b, 3) == 0
    assert libc.function("no_such_function_in_libc", ()) is None


def test_madvise_widens_an_unaligned_start_to_its_page():
    """Advice at an address inside a page (a tensor's bytes rarely start on one) is given from that page's start;
    the call succeeds where it would fail (EINVAL) unaligned, and nothing is asked for an empty range."""
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    m[:] = b"\x01" * len(m)
    anchor = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(anchor)
    try:
        assert libc.madvise(base + 100, mmap.PAGESIZE, mmap.MADV_WILLNEED) is True
        raw = libc.function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
        assert raw(base + 100, mmap.PAGESIZE, mmap.MADV_WILLNEED) != 0  # what the widening avoids
        assert libc.madvise(base, 0, mmap.MADV_WILLNEED) is False
    finally:
        del anchor
        m.close()
