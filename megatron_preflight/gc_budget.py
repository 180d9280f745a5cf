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


@contextmanager
def no_collections(*, restore: bool = True) -> Iterator[None]:
    """No cyclic collections within the block: for a command that answers in a few seconds and builds only acyclic
    structures (a verdict over a 1 T-parameter checkpoint's ~2 * 10^6 metadata objects spent ~0.13 s in the
    collections :func:`fewer_collections` still makes, finding nothing). The previous state comes back on exit,
    unless ``restore`` is False: when the process ends with the block, turning collections back on would start a
    full collection of everything built (the same 0.13 s), for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled and restore:
            gc.enable()
