"""Fewer cyclic garbage collections while the tool builds its large, acyclic structures.

A verdict or plan on a DeepSeek-V3-sized checkpoint builds millions of small objects (DCP records, plan entries) that
all stay reachable until it returns. CPython starts a young-generation collection every 700 net allocations and
promotes survivors into older generations that are walked again and again: a torch_dist reshard verdict spent ~30%
of its time there (17.2 -> 11.8 s, measured). Within :func:`fewer_collections` a collection starts every 100,000
allocations; the previous thresholds come back on exit (the hook runs inside a training process)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG = 100_000
OLDER = (50, 50)


def collect_rarely() -> tuple[int, int, int]:
    """For the rest of this process (one the tool owns: a reshard worker); returns the thresholds before. Collections
    turned off, or already rarer, are left as they are."""
    before = gc.get_threshold()
    if before[0] != 0 and before[0] < YOUNG:
        gc.set_threshold(YOUNG, *OLDER)
    return before


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Rare collections within the block (in any process: the hook runs inside a training job)."""
    before = collect_rarely()
    try:
        yield
    finally:
        gc.set_threshold(*before)
