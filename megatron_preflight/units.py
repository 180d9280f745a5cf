"""Sizes as people read them."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KB, MB, GB or TB (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
