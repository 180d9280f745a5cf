"""The destination of an offline reshard: one writer at a time, and no partial copies left behind by dead runs.

A run takes an exclusive lock (``.<DST>.lock`` next to DST, ``flock``: the kernel drops it when the holder dies, so a
lock of a killed run is never mistaken for a live one). Holding it, the run looks for temp dirs of earlier runs
(``.<DST>.tmp-<pid>``): those whose process is gone are partial output of a crashed or killed run; they are removed
(or, on request, left and named), so disks do not fill with copies of multi-TB checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from dataclasses import dataclass, field

from megatron_preflight.errors import PreflightError

log = logging.getLogger(__name__)


@dataclass
class Destination:
    path: str
    fd: int
    stale_removed: list[str] = field(default_factory=list)
    stale_kept: list[str] = field(default_factory=list)

    @property
    def parent(self) -> str:
        return os.path.dirname(self.path) or "."

    @property
    def lock_path(self) -> str:
        return lock_path(self.path)

    @property
    def tmp(self) -> str:
        return temp_path(self.path, os.getpid())

    def release(self) -> None:
        """Drop the lock (and its file)."""
        if self.fd < 0:
            return
        try:
            os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def lock_path(dst: str) -> str:
    return os.path.join(os.path.dirname(dst) or ".", f".{os.path.basename(dst)}.lock")


def temp_path(dst: str, pid: int) -> str:
    return os.path.join(os.path.dirname(dst) or ".", f".{os.path.basename(dst)}.tmp-{pid}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def claim(dst: str, *, remove_stale: bool = True) -> Destination:
    """Lock ``dst`` for this run and deal with earlier runs' temp output. Raises :class:`PreflightError` when another
    live run holds the lock."""
    parent = os.path.dirname(dst) or "."
    os.makedirs(parent, exist_ok=True)
    path = lock_path(dst)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        try:
            with open(path) as fh:
                holder = fh.read().strip() or "?"
        except OSError:
            holder = "?"
        raise PreflightError(f"another megatron-preflight reshard (pid {holder}) is writing this destination now",
                             path=dst, fix="wait for it to finish, or write to another directory",
                             code="busy") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    dest = Destination(dst, fd)
    prefix = f".{os.path.basename(dst)}.tmp-"
    for name in sorted(os.listdir(parent)):
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):])
        except ValueError:
            continue
        where = os.path.join(parent, name)
        if pid == os.getpid():
            continue
        if alive(pid):
            log.warning("%s belongs to a live process (pid %d); left alone", where, pid)
            dest.stale_kept.append(where)
        elif remove_stale:
            shutil.rmtree(where, ignore_errors=True)
            dest.stale_removed.append(where)
        else:
            dest.stale_kept.append(where)
    return dest
