"""Durable writes: a file or directory is on disk (fsync) before anything that names it as complete is written.

After a crash or power loss, a renamed output directory must never hold empty or short files that look complete: each
shard file is fsynced when written, every directory of the temp tree before the rename, the tracker before the rename,
and the parent directory after it (so the rename itself survives)."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (e.g. certain network mounts) refuse fsync on directories
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Every directory under ``root`` (files are fsynced as they are written), deepest first, then ``root``."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        fsync_dir(dirpath)


def write_text(path: str, text: str) -> None:
    """Write a small file and fsync it (the tracker)."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
