"""Nested state (dicts, lists, tuples) walked leaf by leaf: the one place that knows how a state tree nests."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any


def map_leaves(tree: Any, fn: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """A copy of ``tree`` with every leaf replaced by ``fn(leaf, path)`` (dict order and OrderedDict kept)."""
    if isinstance(tree, dict):
        kind = OrderedDict if isinstance(tree, OrderedDict) else dict
        return kind((k, map_leaves(v, fn, (*path, k))) for k, v in tree.items())
    if isinstance(tree, list):
        return [map_leaves(v, fn, (*path, i)) for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(map_leaves(v, fn, (*path, i)) for i, v in enumerate(tree))
    return fn(tree, path)


def iter_leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) for every leaf of ``tree``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, (*path, i))
    else:
        yield path, tree
