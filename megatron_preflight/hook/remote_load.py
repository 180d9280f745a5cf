"""The in-memory reshard of an ``msc://`` checkpoint: one staged mirror per node (its metadata fetched once, by the
node's local rank 0, in a dir the node's ranks share), and each rank's own bytes fetched into it before the rank
builds its state dict (reshard/sources/byte_ranges.py: only the chunks, rows and scales its plan reads).

The node's staging dir is made by its local rank 0 (remote/mirror.staging_root: ``$MEGATRON_PREFLIGHT_STAGING``,
else memory when it holds twice the checkpoint, else the temp dir) and named to the node's other ranks; it holds the
node's share of the checkpoint during the load and is removed right after it (:func:`release`; a job killed during
its load leaves it: ``preflight-msc-*``, also removed at the local rank 0's normal exit)."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook import consensus
from megatron_preflight.remote.store import is_msc
from megatron_preflight.units import human_bytes

if TYPE_CHECKING:
    from megatron_preflight.remote.mirror import Mirror

log = logging.getLogger(__name__)
_MIRRORS: dict[str, Mirror] = {}  # URL -> this process's view of its node's mirror


def local_dir(load_dir: str, *, whole: bool = False) -> str:
    """``load_dir`` itself, or for an ``msc://`` URL its node's staged mirror (made on first use: every rank calls it
    at the same point, the loader's first read). ``whole``: every byte fetched by the node's local rank 0 (a loader
    whose reads are not planned per rank: the Megatron-FSDP one, which serves DCP's read requests)."""
    if not is_msc(load_dir):
        return load_dir
    url = load_dir.rstrip("/")
    if url in _MIRRORS:
        return _MIRRORS[url].local
    from megatron_preflight.remote.mirror import Mirror  # (an msc:// load only)

    first = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    mirror, failed = None, None
    if first:
        started = time.perf_counter()
        try:
            mirror = Mirror(url)
            mirror.stage_metadata()
            if whole:
                mirror.fetch_all()
            mirror.save_manifest()
            atexit.register(mirror.close)
            log.info("%s staged at %s on %s in %.2f s", mirror.summary(), mirror.root, socket.gethostname(),
                     time.perf_counter() - started)
        except PreflightError as exc:
            failed = (exc.message, exc.path, exc.fix, exc.code)
    # every node's stage done (the barrier), any node's failure every rank's, and each node's dir its ranks'
    said = consensus.all_gather((socket.gethostname(), first, mirror.root if mirror else None, failed))
    errors = [e for _, _, _, e in said if e is not None]
    if errors:
        message, path, fix, code = errors[0]
        raise PreflightError(message, path=path, fix=fix, code=code)
    if mirror is None:
        host = socket.gethostname()
        at = next((root for h, f, root, _ in said if f and h == host), None)
        if at is None:
            raise PreflightError(f"no rank of this node ({host}) has LOCAL_RANK 0 to stage {url}", path=url,
                                 fix="launch with torchrun (it sets LOCAL_RANK per node)", code="remote")
        mirror = Mirror.attach(at, url)
    _MIRRORS[url] = mirror
    return mirror.local


def release(load_dir: str | None) -> None:
    """After the load, on every rank (collective when ``load_dir`` was staged): the node's staging dir removed by its
    local rank 0 once every rank is past its reads. What was built from it stays readable (a mapped file outlives its
    name), and the node's memory or disk does not hold the checkpoint for the rest of the run."""
    mirror = _MIRRORS.pop(load_dir.rstrip("/"), None) if is_msc(load_dir) else None
    if mirror is None:
        return
    consensus.all_gather(None)  # every rank past its reads
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
        mirror.close()
        log.info("%s: its staging dir %s removed after the load", mirror.url, mirror.root)


def _mirror_of(path: str) -> Mirror | None:
    return next((m for m in _MIRRORS.values() if path == m.local or path.startswith(m.local + os.sep)), None)


def prefetch(r: Any, plan: Any) -> None:
    """Fetch the bytes ``plan`` (a rank plan of the resharder ``r``) reads, when its checkpoint is a staged mirror."""
    mirror = _mirror_of(r.layout.path)
    if mirror is None:
        return
    from megatron_preflight.reshard.sources.byte_ranges import relative, total  # (a remote load)

    started = time.perf_counter()
    before = mirror.store.counters.fetched
    ranges = relative(r.byte_ranges(plan), mirror.local)
    mirror.fetch(ranges)
    log.info("rank %d: fetched %s for its plan (%s asked, of %s) from %s in %.2f s", consensus.rank(),
             human_bytes(mirror.store.counters.fetched - before), human_bytes(total(ranges)),
             human_bytes(mirror.size), mirror.url, time.perf_counter() - started)


def shown(text: str) -> str:
    """``text`` with staged mirrors' paths written as their URLs."""
    for m in _MIRRORS.values():
        text = m.shown(text)
    return text
