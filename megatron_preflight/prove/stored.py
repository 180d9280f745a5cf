"""Where a checkpoint's fingerprints are stored: ``<root>/megatron_preflight_fingerprints/iter_NNNNNNN.json``, beside
the iteration dirs (never inside one Megatron reads). Paths only: ``inspect`` and ``check`` ask it without torch."""

from __future__ import annotations

import os

DIR = "megatron_preflight_fingerprints"


def path_for(root: str, iteration: int | str) -> str:
    """Where the fingerprints of ``root``'s iteration are stored."""
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, DIR, name + ".json")


def stored(root: str | None, iteration: int | str | None) -> str | None:
    """The fingerprint file of that iteration, when there is one."""
    if not root or iteration is None:
        return None
    try:
        path = path_for(root, iteration)
    except (TypeError, ValueError):
        return None
    return path if os.path.isfile(path) else None
