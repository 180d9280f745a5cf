"""libc functions through ctypes: set up with their types, or None where they cannot be reached."""

import ctypes

from megatron_preflight import libc


def test_a_libc_function_is_callable_with_its_types_and_a_missing_one_is_none():
    memcmp = libc.function("memcmp", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t))
    a, b = ctypes.create_string_buffer(b"abcd"), ctypes.create_string_buffer(b"abce")
    assert memcmp(a, a, 4) == 0 and memcmp(a, b, 4) < 0 and memcmp(a, b, 3) == 0
    assert libc.function("no_such_function_in_libc", ()) is None
