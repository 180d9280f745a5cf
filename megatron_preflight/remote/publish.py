"""A checkpoint written locally, published under an ``msc://`` prefix: a store has no rename, so the objects go up in
the order a reader can trust — the tensor files first (in parallel; the client uploads a large file in parts), then the
metadata that names them (``.metadata``, ``metadata.json``, ``common.pt``, an HF model's index and ``config.json``),
the tracker last, as Megatron-LM itself saves. Until the tracker (or an HF model's ``config.json``) is there, a reader
finds no checkpoint; a failed upload leaves none."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.dist import COMMON_PT, DCP_METADATA, METADATA_JSON
from megatron_preflight.layout.hf.names import CONFIG, INDEX
from megatron_preflight.remote.store import Store

WORKERS = 4
NAMING = (DCP_METADATA, METADATA_JSON, COMMON_PT, INDEX)  # the files that name the tensor files
LAST = (naming.TRACKER_FILENAME, CONFIG)  # what makes a prefix a checkpoint


def _rank(rel: str) -> int:
    name = rel.rsplit("/", 1)[-1]
    return 2 if name in LAST and "/" not in rel else 1 if name in NAMING else 0


def require_empty(store: Store) -> None:
    """Refuse a destination prefix that holds objects (as a local destination must not exist, or be empty)."""
    held = store.list()
    if held:
        raise PreflightError(f"the destination holds {len(held):,} object(s) already (e.g. {next(iter(held))})",
                             path=store.url, fix="pass an empty prefix: a checkpoint is never written over another",
                             code="usage")


def publish(local: str, store: Store, *, workers: int = WORKERS) -> int:
    """Upload every file under ``local`` to ``store`` (see the module docstring); the number of objects."""
    files = []
    for dirpath, _dirs, names in os.walk(local):
        for n in names:
            path = os.path.join(dirpath, n)
            files.append((os.path.relpath(path, local).replace(os.sep, "/"), path))
    done: list[str] = []

    def one(f: tuple[str, str]) -> None:
        store.upload(*f)
        done.append(f[0])

    try:
        for stage in (0, 1, 2):
            batch = [f for f in files if _rank(f[0]) == stage]
            if batch:
                with ThreadPoolExecutor(max_workers=max(1, min(workers, len(batch)))) as pool:
                    for _ in pool.map(one, batch):
                        pass
    except BaseException:
        _withdraw(store, done)
        raise
    return len(files)


def _withdraw(store: Store, rels: list[str]) -> None:
    """Delete what a failed publish uploaded (best effort: the store may be what failed)."""
    for rel in sorted(rels, key=_rank, reverse=True):  # the tracker first: a reader stops seeing a checkpoint
        try:
            store.delete(rel)
        except PreflightError:
            return
