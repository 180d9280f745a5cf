"""What Megatron-LM main keeps in an iteration dir beside the tensors: the tokenizer's files and the integrity manifest.

* ``iter_*/tokenizer/`` (``--save-tokenizer-assets``, on by default; main writes it for torch_dist saves): the files a
  run's tokenizer needs, so the checkpoint is self-contained. A written checkpoint carries the source's (a Megatron
  checkpoint's ``tokenizer/``, or a Hugging Face model's tokenizer files), in every Megatron format.
* ``iter_*/integrity.json`` (``--verify-integrity``): ``{"algorithm": "sha256", "files": {name: hex digest}}`` over the
  files directly in a torch_dist iteration dir (not the manifest itself, not subdirectories); Megatron's dist load
  with ``--verify-integrity`` refuses a checkpoint without it or with a file that no longer matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any

from megatron_preflight.layout.hf import files
from megatron_preflight.layout.hf.names import TOKENIZER_FILES
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.reshard.targets import durable
from megatron_preflight.reshard.targets.output_file import open_output

logger = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"
INTEGRITY = "integrity.json"
_HF_TOKENIZER = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_CHUNK = 8 << 20


def tokenizer_source(layout: Layout) -> tuple[str, tuple[str, ...]] | None:
    """(dir, its files to copy) of the source's tokenizer assets; None when it has none."""
    if layout.format == Format.HF:
        where = layout.root or ""
        names = files.present(where, _HF_TOKENIZER)
    else:
        where = os.path.join(layout.iter_dir or "", TOKENIZER_DIR)
        names = tuple(sorted(n for n in os.listdir(where) if os.path.isfile(os.path.join(where, n)))) \
            if os.path.isdir(where) else ()
    if layout.format == Format.HF:
        return (where, names) if names else None
    return (where, names) if os.path.isdir(where) else None  # (a NullTokenizer run's is empty: kept so)


def copy_tokenizer(layout: Layout, iter_out: str) -> list[str]:
    """Copy the source's tokenizer assets into ``iter_out/tokenizer/`` (each file fsynced); what was done."""
    found = tokenizer_source(layout)
    if found is None:
        return []
    where, names = found
    out = os.path.join(iter_out, TOKENIZER_DIR)
    os.makedirs(out, exist_ok=True)
    for name in names:
        dst = os.path.join(out, name)
        shutil.copyfile(os.path.join(where, name), dst)
        with open(dst, "rb+") as fh:
            os.fsync(fh.fileno())
    durable.fsync_dir(out)
    durable.fsync_dir(iter_out)
    return [f"tokenizer assets: {', '.join(names) or 'the empty dir'} copied from {where} into {TOKENIZER_DIR}/"]


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


DIGEST_PREFIX = ".preflight-sha256-"  # beside a file hashed as it was written: {"size", "sha256"} (removed by seal)


class HashedFile:
    """A file written front to back whose SHA-256 is computed as it is written: a large write is hashed on a helper
    thread while the write system call runs (hashlib and the write both release the GIL), and both finish before
    ``write`` returns (the caller may reuse its buffer). :meth:`close` leaves the digest beside the file
    (:data:`DIGEST_PREFIX`), which :func:`write_integrity` takes instead of reading the file back."""

    PARALLEL = 1 << 20  # smaller writes are hashed inline

    def __init__(self, path: str) -> None:
        from concurrent.futures import ThreadPoolExecutor  # (a torch_dist write only)

        self.path = path
        self.fh = open_output(path)  # (closed by close())
        self._h = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes < self.PARALLEL:
            self._h.update(view)
            return self.fh.write(view)
        hashing = self._pool.submit(self._h.update, view)
        try:
            return self.fh.write(view)
        finally:
            hashing.result()

    @property
    def name(self) -> str:
        return self.path

    def tell(self) -> int:
        return self.fh.tell()

    def flush(self) -> None:
        self.fh.flush()

    def commit(self) -> None:
        """Everything written is on disk (fsync)."""
        self.fh.commit()

    def fileno(self) -> int:
        return self.fh.fileno()

    def close(self) -> None:
        """Close the file and the helper thread; the digest is left beside it (the file made durable by the caller:
        :meth:`commit`)."""
        self._pool.shutdown()
        if self.fh.closed:
            return
        size = self.fh.tell()
        self.fh.close()
        name = os.path.basename(self.path)
        with open(os.path.join(os.path.dirname(self.path), DIGEST_PREFIX + name), "w") as fh:
            json.dump({"size": size, "sha256": self._h.hexdigest()}, fh)


def _digest(entry: os.DirEntry) -> str:
    """A file's SHA-256: the one taken as it was written (its size unchanged since), else read back."""
    side = os.path.join(os.path.dirname(entry.path), DIGEST_PREFIX + entry.name)
    try:
        with open(side) as fh:
            known = json.load(fh)
        if int(known["size"]) == entry.stat().st_size:
            return str(known["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return file_digest(entry.path)


def remove_digests(iter_out: str) -> None:
    """The digests :class:`HashedFile` left in ``iter_out`` (never part of a checkpoint)."""
    for e in os.scandir(iter_out):
        if e.name.startswith(DIGEST_PREFIX):
            os.remove(e.path)


def write_integrity(iter_out: str) -> None:
    """``integrity.json`` over the files directly in ``iter_out``, in Megatron's own format (a file hashed as it was
    written is not read again)."""
    files = {e.name: _digest(e) for e in sorted(os.scandir(iter_out), key=lambda e: e.path)
             if e.is_file() and e.name != INTEGRITY and not e.name.startswith(DIGEST_PREFIX)}
    remove_digests(iter_out)
    durable.write_text(os.path.join(iter_out, INTEGRITY), json.dumps({"algorithm": "sha256", "files": files},
                                                                      indent=2))
    durable.fsync_dir(iter_out)


def integrity_problems(iter_dir: str) -> list[str] | None:
    """A source's ``integrity.json`` checked against its files: each mismatch or missing file said; None when the
    dir has no manifest."""
    path = os.path.join(iter_dir, INTEGRITY)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            manifest = json.load(fh)
        files = manifest["files"]
        algorithm = manifest.get("algorithm", "sha256")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{INTEGRITY} cannot be read ({e})"]
    if algorithm != "sha256":
        return [f"{INTEGRITY} uses the hash {algorithm!r}; Megatron writes sha256"]
    out = []
    for name, want in sorted(files.items()):
        full = os.path.join(iter_dir, name)
        if not os.path.isfile(full):
            out.append(f"{name}: listed in {INTEGRITY} but missing")
        elif file_digest(full) != want:
            out.append(f"{name}: its SHA-256 no longer matches {INTEGRITY}")
    return out
