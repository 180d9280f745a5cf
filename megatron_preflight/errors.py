"""User-facing errors: one paragraph naming the file and the fix, never a traceback."""

from __future__ import annotations

import errno as errno_mod
import os
import stat


class PreflightError(Exception):
    """An error the user can act on. ``str()`` is the whole message: what, where, and the fix."""

    def __init__(self, message: str, path: str | None = None, fix: str | None = None, code: str = "error"):
        self.message = message
        self.path = path
        self.fix = fix
        self.code = code
        super().__init__(message)

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        parts = [self.message.rstrip(".") + "."]
        if self.path:
            parts.insert(0, f"{self.path}:")
        if self.fix:
            parts.append(f"Fix: {self.fix.rstrip('.')}.")
        return " ".join(parts)


class UnsafePickleError(PreflightError):
    """A checkpoint pickle references a global outside the allow-list."""


class CorruptFileError(PreflightError):
    """A checkpoint file is truncated, empty or not a torch file."""


_ENV_FIXES = {
    "ENOSPC": "free space on that filesystem, or write somewhere with room",
    "EDQUOT": "free space within your quota, or write somewhere else",
    "EFBIG": "the file size limit (ulimit -f) or the filesystem's largest file is too small: raise it or write "
             "elsewhere",
    "EROFS": "the filesystem is read-only: write somewhere writable",
    "EACCES": "check the permissions of that path (or run as a user who may write/read it)",
    "EPERM": "check the permissions of that path",
    "ENOENT": "check the path (a directory on the way may have been removed meanwhile)",
    "ENOTDIR": "a part of that path is a file, not a directory: fix the path",
    "EIO": "the storage reported an I/O error: check the disk or the network filesystem, then retry",
    "ESTALE": "the network filesystem handle went stale: retry",
}


def environment_error(exc: OSError) -> PreflightError:
    """What the system did (disk full, read-only, permission, ...), as one clear error: not a bug of this tool."""
    name = errno_mod.errorcode.get(exc.errno or 0, "")
    what = exc.strerror or str(exc)
    where = exc.filename if isinstance(exc.filename, str) else None
    return PreflightError(f"the system refused an operation: {what}" + (f" [{name}]" if name else ""), path=where,
                          fix=_ENV_FIXES.get(name, "check the path, the filesystem and the permissions, then retry"),
                          code="environment")


def require_regular_file(path: str) -> None:
    """Only regular files are opened: a FIFO, a socket or a device where a checkpoint file should be would block or
    stream forever. Raises :class:`PreflightError` (code ``not_regular``) for anything else that exists."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing / unreadable: the caller's open() says so
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise PreflightError(f"this is {kind}, not a regular file; reading it could block forever", path=path,
                             fix="replace it with the file Megatron wrote (restore the checkpoint from a good copy)",
                             code="not_regular")
