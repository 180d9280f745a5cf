"""Damage a copy of a safetensors file in place (test-only): its JSON header and body handed to an edit."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable


def edit_header(path: str, fn: Callable[[dict, bytearray], None]) -> None:
    """Rewrite ``path`` after ``fn(header, body)`` changed its header (a dict) and body (bytes) in place."""
    with open(path, "rb") as fh:
        raw = fh.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = bytearray(raw[8 + n:])
    fn(header, body)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # (the data starts 8-byte aligned, as the safetensors package writes it)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head + bytes(body))
