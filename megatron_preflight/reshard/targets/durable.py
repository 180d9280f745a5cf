"""Durable writes: a file or directory is on disk (fsync) before anything that names it as complete is written.

After a crash or power loss, a renamed output directory must never hold empty or short files that look complete: each
shard file is fsynced when written, every directory of the temp tree before the rename, the tracker before the rename,
and the parent directory after it (so the rename itself survives)."""

from __future__ import annotations

import os
from typing import IO

from megatron_preflight import libc


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


class Writeback:
    """Starts the disk's writeback of a file's bytes while the rest is still being built (``sync_file_range``), so
    the fsync that makes the file durable finds little left: the disk writes as the data is made, where ``cp && sync``
    writes it all to the page cache first and then waits for the disk. Every ``window`` bytes written are handed to
    the disk; once ``lag`` windows are in flight the writer waits for the oldest (the dirty pages a shard leaves in the
    page cache stay bounded). Best effort: without ``sync_file_range`` (not Linux) the final fsync does it all."""

    def __init__(self, fh: IO[bytes], window: int = 32 << 20, lag: int = 8) -> None:
        self.fh, self.window, self.lag = fh, window, lag
        self.started = self.done = 0  # bytes [0, started) handed to the disk, [0, done) waited for
        self.works = True

    def advance(self) -> None:
        """Call after each write: hands the disk every whole window written since the last call."""
        if not self.works:
            return
        end = self.fh.tell()
        if end - self.started < self.window:
            return
        self.fh.flush()  # (the buffered tail into the kernel)
        fd = self.fh.fileno()
        while end - self.started >= self.window:
            if not libc.sync_file_range(fd, self.started, self.window, libc.SYNC_FILE_RANGE_WRITE):
                self.works = False
                return
            self.started += self.window
            if self.started - self.done > self.lag * self.window:
                libc.sync_file_range(fd, self.done, self.window, libc.SYNC_FILE_RANGE_WAIT_BEFORE |
                                     libc.SYNC_FILE_RANGE_WRITE | libc.SYNC_FILE_RANGE_WAIT_AFTER)
                self.done += self.window
