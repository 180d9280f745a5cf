"""Bounds on what an unpickled checkpoint may cost: hostile pickles are refused at once, not after minutes or an OOM.

The allow-list in :mod:`megatron_preflight.safe_pickle` stops code from running; it does not stop a pickle built to
exhaust memory or CPU with allowed operations alone. Three guards close that:

* :func:`scan` walks the opcode stream once before the C unpickler sees it (no objects are built) and refuses a memo
  index beyond the stream's own size (CPython allocates the memo up to the largest index: ``LONG_BINPUT 2**31``
  asks for 32 GB), a length prefix longer than the data left (it is allocated before it is read), or an unknown
  opcode (the opcode count is not bounded beyond the stream's length: each opcode takes a byte or more, and the
  unpickler's work per opcode is constant except for calls); the opcodes with nothing to check are skipped by one
  regular expression, at C speed;
* :class:`CallBudget` charges every call of an allow-listed builtin (``set(list)``, ``bytes(n)``, ``list(range)``...)
  by the size of what it builds, against a budget proportional to the stream: copying one big memoised list over and
  over (quadratic) or ``bytes(10**12)`` is refused;
* :func:`check_shape` walks the loaded object without recursion and refuses nesting deeper than any checkpoint holds
  and a tree that expands far beyond the stream (a small DAG of shared lists that every tree walk, JSON rendering or
  comparison would expand exponentially: a "billion laughs").

Every refusal is an :class:`UnsafePickleError` naming the file.
"""

from __future__ import annotations

import argparse
import functools
import re
import struct
import types
from collections.abc import Callable
from typing import Any

from megatron_preflight.errors import UnsafePickleError
from megatron_preflight.placeholders import Placeholder, Record

MAX_OBJECT_DEPTH = 200  # Megatron's state nests < 10 deep
# a tree may hold at most this many references per byte of its stream (plus a floor). Without shared containers a
# pickle makes at most ~1 per byte (each reference costs an opcode); Megatron's own make <= 0.19 (every .pt and
# .metadata in the fixtures, written by Megatron-LM 0.13 ... main). The walk lists up to this many before refusing,
# 8 bytes each: 4 keeps a hostile 17 MB stream under ~0.6 GB (64 let it reach ~9 GB).
EXPANSION_FACTOR = 4
EXPANSION_FLOOR = 1_000_000
CALL_BUDGET_FACTOR = 16  # allow-listed calls may build this many elements per stream byte (plus a floor)
CALL_BUDGET_FLOOR = 10_000_000

_FIX = ("the file was not written by Megatron-LM's torch.save, or it was built to exhaust memory or CPU: do not load "
        "it; restore the checkpoint from a trusted copy")

# Opcode -> how its argument is encoded: None (no argument), an int (fixed size in bytes), or a tag.
_NO_ARG = frozenset(b"(.012N\x88\x89}])\x8faeblttu\x85\x86\x87s\x90\x91R\x81\x92o\x93\x94Q\x98\x97d")
_FIXED = {ord("K"): 1, ord("h"): 1, ord("q"): 1, ord("r"): 4, ord("\x82"): 1, ord("\x80"): 1, ord("M"): 2, ord("\x83"): 2, ord("J"): 4,
          ord("j"): 4, ord("\x84"): 4, ord("G"): 8}
_LEN1 = frozenset(b"\x8aUC\x8c")  # one length byte, then data
_LEN4 = frozenset(b"\x8bTBX")  # four length bytes (little endian), then data
_LEN8 = frozenset(b"\x8d\x8e\x96")  # eight length bytes, then data
_LINE = frozenset(b"ILFSVgpP")  # argument up to a newline
_TWO_LINES = frozenset(b"ci")
_PUT4, _PUTLINE, _FRAME, _MARK = ord("r"), ord("p"), ord("\x95"), ord("(")
_POPS_MARK = frozenset(b"1eltud\x90\x91o")  # opcodes that consume the topmost MARK


def _refuse(source: str, why: str) -> UnsafePickleError:
    return UnsafePickleError(f"refused to load: its pickle {why}", path=source, fix=_FIX, code="unsafe_pickle")


# opcode -> the bytes of its argument, for the opcodes that need nothing else checked; _OPENS / _CLOSES: a MARK, an
# opcode that consumes one; _SHORT: one length byte, then data; -1: see the full rules
_OPENS, _CLOSES, _SHORT = -2, -3, -4
_SKIP = [-1] * 256
for _op in _NO_ARG - {_MARK, 46} - _POPS_MARK:
    _SKIP[_op] = 0
for _op, _size in _FIXED.items():
    if _op != _PUT4:
        _SKIP[_op] = _size
_SKIP[_MARK] = _OPENS
for _op in _POPS_MARK:
    _SKIP[_op] = _CLOSES
for _op in _LEN1:
    _SKIP[_op] = _SHORT


_SMALL_MEMO = 1 << 16  # the memo bound is never below this (see scan)
# The run's string tables: one branch per length, ~35 us each to compile (once per process). A stream under
# _LARGE_STREAM (a legacy shard's pickle, a small .metadata: the scan takes milliseconds) is walked with
# _SMALL_TABLES, a larger one with _LARGE_TABLES; a longer string stops the run for one opcode. (At 64 / 64 the 11 MB
# DeepSeek-V3 .metadata scans in 170 ms, at 256 / 128 in 150 ms; the tables compile in 4.5 ms and 11.7 ms.)
_LARGE_STREAM = 4 << 20
_SMALL_TABLES = (64, 64)  # (SHORT_BINUNICODE and the other one-length-byte opcodes, BINUNICODE) lengths in the run
_LARGE_TABLES = (256, 128)


@functools.cache
def _plain_run(short: int, unicode: int) -> re.Pattern[bytes]:
    """A run of opcodes that need nothing checked: no argument or a fixed-size one, a length byte and its data, MARK
    and the opcodes that pop one (their nesting is bounded by the stream — the unpickler's mark stack takes a word
    per MARK byte — and the objects they nest are :func:`check_shape`'s to refuse). Matched by the regex engine at C
    speed: a torch_dist ``.metadata`` is ~5*10^6 opcodes, ~95% of them these. Two more kinds are in the run when
    their argument is small, which is what a legacy ``.pt`` (pickle protocol 2) is made of, ~95% of the opcodes the
    run stopped at: ``LONG_BINPUT`` below 2**16 (within any stream's memo bound, :data:`_SMALL_MEMO`) and
    ``BINUNICODE`` (a state-dict key). ``short`` and ``unicode``: how many string lengths the run takes (0 .. n - 1)
    after a one-byte and a four-byte length."""
    by_size: dict[int, list[int]] = {}
    for op, size in enumerate(_SKIP):
        if size >= 0 or size in (_OPENS, _CLOSES):
            by_size.setdefault(max(size, 0), []).append(op)
    # (the opcodes without an argument as one repeated class: a run of them, ~half a .metadata's opcodes, is matched
    # in one step of the regex engine's tight loop, not one alternation each)
    alternatives = [_one_of(ops) + (b".{%d}" % size if size else b"+") for size, ops in sorted(by_size.items())]
    # a short string, bytes or long: its length byte, then that many bytes (one branch per length; the regex engine
    # rejects a branch on its first literal at once)
    lengths = b"|".join(b"\\x%02x" % n + (b".{%d}" % n if n else b"") for n in range(short))
    alternatives.append(_one_of(sorted(_LEN1)) + b"(?:" + lengths + b")")
    alternatives.append(b"r..\\x00\\x00")  # LONG_BINPUT below 2**16
    keys = b"|".join(b"\\x%02x\\x00\\x00\\x00" % n + (b".{%d}" % n if n else b"") for n in range(unicode))
    alternatives.append(b"X(?:" + keys + b")")  # BINUNICODE: four length bytes (the top three zero), then data
    return re.compile(b"(?:" + b"|".join(alternatives) + b")*+", re.DOTALL)


def _one_of(ops: list[int]) -> bytes:
    return b"[" + b"".join(b"\\x%02x" % op for op in ops) + b"]"


def scan(data: bytes, source: str) -> None:
    """Walk the opcodes of ``data`` without building anything (a Kimi K2 ``.metadata``: 5 million). Raises
    :class:`UnsafePickleError` for a stream that would make the unpickler allocate or loop beyond its own size."""
    n = len(data)
    max_memo = max(n, _SMALL_MEMO)
    i = 0
    unpack4 = struct.Struct("<I").unpack_from
    unpack8 = struct.Struct("<Q").unpack_from
    skip = _SKIP
    plain = _plain_run(*(_LARGE_TABLES if n >= _LARGE_STREAM else _SMALL_TABLES)).match
    while i < n:
        i = plain(data, i).end()  # type: ignore[union-attr]  # (matches the empty run at least)
        if i >= n:
            break
        op = data[i]
        i += 1
        size = skip[op]
        if size == _SHORT:  # a short string, bytes or long
            if i >= n:
                break
            i += 1 + data[i]
            continue
        if op == 46:  # STOP
            return
        size = _FIXED.get(op)
        if size is not None:
            if op == _PUT4 and i + 4 <= n and unpack4(data, i)[0] > max_memo:
                raise _refuse(source, f"stores into memo slot {unpack4(data, i)[0]:,}, beyond its own size "
                                      f"({n:,} bytes): the unpickler would allocate that many slots")
            i += size
        elif op in _LEN4 or op in _LEN8 or op == _FRAME:
            width = 4 if op in _LEN4 else 8
            if i + width > n:
                break
            length = unpack4(data, i)[0] if width == 4 else unpack8(data, i)[0]
            i += width
            if op == _FRAME:
                if length > n - i:
                    raise _refuse(source, f"announces a {length:,}-byte frame with {n - i:,} bytes left (truncated)")
                continue
            if length > n - i:
                raise _refuse(source, f"announces {length:,} bytes of data with only {n - i:,} left: the unpickler "
                                      "would allocate them first (a truncated or forged file)")
            i += length
        elif op in _LINE or op in _TWO_LINES:
            end = data.find(b"\n", i)
            if end < 0:
                break
            if op == _PUTLINE:
                text = data[i:end]
                if text.isdigit() and int(text) > max_memo:
                    raise _refuse(source, f"stores into memo slot {int(text):,}, beyond its own size")
            i = end + 1
            if op in _TWO_LINES:
                end = data.find(b"\n", i)
                if end < 0:
                    break
                i = end + 1
        else:
            raise _refuse(source, f"holds an unknown opcode 0x{op:02x} at byte {i - 1:,} (corrupt or not a pickle)")
    # no STOP: the unpickler reports the truncation itself


class CallBudget:
    """How many elements allow-listed builtins may still build while one pickle is loaded."""

    def __init__(self, stream_bytes: int, source: str) -> None:
        self.left = CALL_BUDGET_FACTOR * stream_bytes + CALL_BUDGET_FLOOR
        self.source = source

    def charge(self, name: str, args: tuple[Any, ...]) -> None:
        cost = 1
        for a in args:
            if isinstance(a, bool):
                continue
            if isinstance(a, int):
                cost += max(0, a)  # bytes(n), bytearray(n)
            elif isinstance(a, range):
                cost += len(a) if a.step else 0
            elif hasattr(a, "__len__"):
                try:
                    cost += len(a)
                except Exception:  # noqa: BLE001 - an object without a usable length costs one
                    pass
        self.left -= cost
        if self.left < 0:
            raise _refuse(self.source, f"calls {name}() to build far more than the stream holds (a memory or CPU "
                                       "exhaustion pattern)")

    def guard(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not kwargs and type(args[0]) is tuple:  # torch.Size((..)), list((..)): a
                self.left -= len(args[0]) + 1  # .metadata makes ~10^5 of these; charged as charge() would
                if self.left < 0:
                    self.charge(name, args)  # (refuses, naming the builder)
                return fn(args[0])
            self.charge(name, args)
            return fn(*args, **kwargs)

        guarded.__name__ = name
        return guarded


_ATOMS = frozenset((str, bytes, int, float, bool, type(None)))
_PLAIN, _RECORD, _OPAQUE = 0, 1, 2


def _children(value: Any) -> Any:
    """The objects a container holds (None: not a container this walk descends into); placeholders are
    :func:`check_shape`'s own case."""
    kind = type(value)
    if kind is dict:
        return [*value.keys(), *value.values()]
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if kind is tuple or kind is list or isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return list(vars(value).values())
    return None


def check_shape(obj: Any, stream_bytes: int, source: str) -> None:
    """Refuse an object tree nested deeper than :data:`MAX_OBJECT_DEPTH`, or that expands (shared containers counted
    once per path) far beyond its stream. Walks one depth level at a time without recursion, counts a level's
    objects from its containers' lengths before building it (a blow-up is refused before it is materialised), and
    leaves atoms to C-level list extension (the walk visits every object of a torch_dist ``.metadata``: it was most
    of a verdict's reading time)."""
    limit = EXPANSION_FACTOR * stream_bytes + EXPANSION_FLOOR
    seen = 1
    atoms = _ATOMS
    kinds: dict[type, int] = {}  # kind -> _PLAIN, _RECORD or _OPAQUE (~10^5 DCP records in a torch_dist .metadata)
    level: list[Any] = [obj]
    depth = 0
    while level:
        below: list[Any] = []
        for value in level:
            kind = type(value)
            if kind in atoms:
                continue
            if kind is tuple or kind is list:
                children: Any = value
            else:
                how = kinds.get(kind)
                if how is None:
                    how = kinds[kind] = (_RECORD if issubclass(kind, Record) else
                                         _OPAQUE if issubclass(kind, Placeholder) else _PLAIN)
                if how == _RECORD:  # its fields' names and values, one level
                    state = value.__dict__
                    children = [*state, *state.values()]
                elif how == _OPAQUE:
                    state = value._state
                    if type(state) is dict and not value._args and not value._new_args:
                        children = [*state, *state.values()]
                    else:
                        children = (value._args, state, value._new_args)
                else:
                    children = _children(value)
                    if children is None:
                        continue
            seen += len(children)
            if seen > limit:
                raise _refuse(source, f"expands to more than {limit:,} objects from {stream_bytes:,} bytes (shared "
                                      "containers nested to blow up every walk over them)")
            below += children
        depth += 1
        if below and depth > MAX_OBJECT_DEPTH:
            raise _refuse(source, f"nests objects more than {MAX_OBJECT_DEPTH} levels deep (no checkpoint does)")
        level = below
