"""Where a checkpoint lives: a path on a local or mounted filesystem, or an object-storage URL — Megatron-LM's
``msc://PROFILE/path`` (``--enable-msc``, NVIDIA's multi-storage-client), or another scheme's. This version reads
filesystems only: a URL is answered as such, never taken for a relative path (``msc://p/x`` is not ``./msc:/p/x``),
and a job loading from one is not stopped for it (Megatron reads it itself)."""

from __future__ import annotations

import os
import re

from megatron_preflight.errors import PreflightError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL (``msc://``, ``s3://``, ...), not a filesystem path."""
    return isinstance(path, str) and bool(_URL.match(path))


def refuse_url(path: str | os.PathLike, role: str = "checkpoint") -> None:
    """Raise a clear error when ``path`` is a URL: what it is, and what to do instead."""
    if not is_url(path):
        return
    scheme = str(path).split("://", 1)[0]
    what = ("an object-storage URL (Megatron-LM's --enable-msc: NVIDIA's multi-storage-client)" if scheme == "msc"
            else f"a URL ({scheme}://)")
    raise PreflightError(f"the {role} {path} is {what}; this version of megatron-preflight reads checkpoints on local "
                         "or mounted filesystems only", path=None, code="object_storage",
                         fix="point it at a local or mounted copy of the checkpoint (the storage's own client can "
                             "copy one), or run the job with --preflight off (Megatron then loads it as it would)")
