"""Where a checkpoint lives: a path on a local or mounted filesystem, or an object-storage URL — Megatron-LM's
``msc://PROFILE/path`` (``--enable-msc``, NVIDIA's multi-storage-client), or another scheme's. The readers take
filesystem paths only: an ``msc://`` URL is staged first (:mod:`megatron_preflight.remote`), another scheme's is
answered as a URL; neither is ever taken for a relative path (``msc://p/x`` is not ``./msc:/p/x``)."""

from __future__ import annotations

import os
import re

from megatron_preflight.errors import PreflightError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL (``msc://``, ``s3://``, ...), not a filesystem path."""
    return isinstance(path, str) and bool(_URL.match(path))


def refuse_url(path: str | os.PathLike, role: str = "checkpoint") -> None:
    """Raise a clear error when ``path`` is a URL this reader cannot take as a path: an ``msc://`` one must be staged
    first (:mod:`megatron_preflight.remote`: every command and the hook do), another scheme's is read through an msc
    profile."""
    if not is_url(path):
        return
    scheme = str(path).split("://", 1)[0]
    if scheme == "msc":
        raise PreflightError(f"the {role} {path} is an object-storage URL, which is read through a staged mirror, "
                             "not as a path", path=None, code="object_storage",
                             fix="pass it to a megatron-preflight command or to the job's --load (both stage it), or "
                                 "in Python open it with megatron_preflight.remote.mirror.staged")
    raise PreflightError(f"the {role} {path} is a URL ({scheme}://); megatron-preflight reads object storage as "
                         "Megatron-LM does, through multi-storage-client profiles", path=None, code="object_storage",
                         fix="define a profile for that bucket in your MSC config (MSC_CONFIG) and pass "
                             "msc://PROFILE/path, or point it at a local or mounted copy")
