"""Hostile pickles built only from allow-listed operations are refused at once, with a clear error."""

from __future__ import annotations

import pickle
import pickletools
import struct
import time
import tracemalloc

import pytest

from megatron_preflight import pickle_limits
from megatron_preflight.errors import UnsafePickleError
from megatron_preflight.safe_pickle import bounded_load


def _load(data: bytes) -> object:
    return bounded_load(data, source="hostile.pkl")


def test_every_opcode_is_classified() -> None:
    known = (set(pickle_limits._NO_ARG) | set(pickle_limits._FIXED) | set(pickle_limits._LEN1)
             | set(pickle_limits._LEN4) | set(pickle_limits._LEN8) | set(pickle_limits._LINE)
             | set(pickle_limits._TWO_LINES) | {pickle_limits._FRAME})
    missing = [op.name for op in pickletools.opcodes if ord(op.code) not in known]
    assert missing == []


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_ordinary_objects_load_at_every_protocol(protocol: int) -> None:
    obj = {"a": [1, 2.5, "x", b"y", None, True], "b": (1, (2, (3,))), "c": {1, 2}, "d": frozenset({3}),
           "e": bytearray(b"zz"), "big": 2**100, "s": "é" * 300}
    assert _load(pickle.dumps(obj, protocol=protocol)) == obj


def test_memo_slot_beyond_the_stream_is_refused_before_allocation() -> None:
    data = b"\x80\x02]r" + struct.pack("<I", 0x7FFFFFF0) + b"."
    with pytest.raises(UnsafePickleError, match="memo slot"):
        _load(data)


def test_length_prefix_longer_than_the_data_is_refused() -> None:
    data = b"\x80\x02B" + struct.pack("<I", 0x7FFFFFF0) + b"abc."
    with pytest.raises(UnsafePickleError, match="announces"):
        _load(data)


def test_unknown_opcode_is_refused() -> None:
    with pytest.raises(UnsafePickleError, match="unknown opcode"):
        _load(b"\x80\x02\xff.")


def test_deep_nesting_is_refused_without_recursion() -> None:
    # Built bottom-up (stack depth 1), so only the object walk can see the depth.
    data = b"\x80\x02)" + b"\x85" * 100_000 + b"."
    with pytest.raises(UnsafePickleError, match="levels deep"):
        _load(data)


def test_billion_laughs_is_refused_quickly() -> None:
    node: list = ["lol"]
    for _ in range(40):
        node = [node, node]  # 2**40 paths, 41 objects: pickle memoises the shared list
    data = pickle.dumps(node, protocol=2)
    assert len(data) < 2_000
    start = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="expands"):
        _load(data)
    assert time.perf_counter() - start < 30  # bounded by the expansion limit, not by 2**40


def test_a_dense_unshared_tree_loads_and_a_wide_amplifier_is_refused_within_bounded_memory() -> None:
    """Without sharing a pickle makes about one reference per byte, and loads; a 1 MB stream that references one
    memoised 1,000-element list 100,000 times (10^8 references) is refused, and the walk's lists stay well below
    what that many references would take (8 bytes each: 800 MB; the limit lets it list ~5 * 10^6 before refusing)."""
    dense = pickle.dumps([None] * 2_000_000, protocol=2)  # 'N' per element: ~1 reference per byte
    assert len(_load(dense)) == 2_000_000  # type: ignore[arg-type]
    body = b"\x80\x02]q\x00(" + b"N" * 1_000 + b"e" + b"(" + b"h\x00" * 100_000 + b"l."
    assert len(body) < 250_000
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePickleError, match="expands"):
            _load(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_quadratic_copying_through_an_allowed_builtin_is_refused() -> None:
    # One memoised 100k-element list, then set(that list) 2,000 times: 2e8 element copies from ~0.3 MB of stream.
    body = b"\x80\x02c__builtin__\nset\nq\x00]q\x01(" + b"K\x01" * 100_000 + b"e"
    body += b"0" + b"(" + b"h\x00h\x01\x85R" * 2_000 + b"l."
    with pytest.raises(UnsafePickleError, match="builtins.set"):
        _load(body)


def test_huge_bytes_call_is_refused() -> None:
    data = b"\x80\x02c__builtin__\nbytes\n\x8a\x05\x00\x00\x00\x00\x01\x85R."  # bytes(2**32)
    with pytest.raises(UnsafePickleError, match="builtins.bytes"):
        _load(data)


@pytest.mark.parametrize("large", [False, True], ids=["small-stream-tables", "large-stream-tables"])
def test_the_scan_keeps_its_place_through_runs_of_every_plain_opcode(large: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The opcodes with nothing to check are skipped by one regular expression; a memo store hidden after runs of
    strings of every short length, longs, floats, ints and containers is found all the same (the scan stays aligned
    with the opcode stream), at each of several places, with either string table (a small stream's, a large one's)."""
    monkeypatch.setattr(pickle_limits, "_LARGE_STREAM", 0 if large else 1 << 40)
    obj = [["s" * n, b"b" * n, 2 ** (8 * (n % 40)), n * 0.5, -n, (n, [n])] for n in range(300)]
    data = pickle.dumps(obj, protocol=2)  # protocol 2 memoises with BINPUT / LONG_BINPUT (index > 255)
    puts = [pos for op, arg, pos in pickletools.genops(data) if op.name == "LONG_BINPUT"]
    assert len(puts) > 100
    pickle_limits.scan(data, "ok.pkl")  # its own indexes are small: nothing refused
    for pos in (puts[0], puts[len(puts) // 2], puts[-1]):
        forged = data[:pos + 1] + struct.pack("<I", 2**31) + data[pos + 5:]
        with pytest.raises(UnsafePickleError, match="memo slot 2,147,483,648"):
            pickle_limits.scan(forged, "hostile.pkl")


@pytest.mark.parametrize("forged", [
    b"X\x05\x00\x00\x00ab",  # a short key (in the run's fast path) cut off: the unpickler would read past the end
    b"X\x05\x00\x00\x01abcde",  # its length's top bytes set: 16 MiB announced, not a short key
])
def test_a_forged_string_length_is_refused_where_the_run_takes_short_keys(forged: bytes) -> None:
    """BINUNICODE of a short length and LONG_BINPUT of a small slot are skipped inside the regular expression (a
    legacy .pt is made of them); a length the stream does not hold still leaves the run and is refused."""
    data = b"\x80\x02]r\x01\x00\x00\x00" + forged
    with pytest.raises(UnsafePickleError, match="announces"):
        pickle_limits.scan(data, "hostile.pkl")
