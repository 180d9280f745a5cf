"""The facts of a DCP ``.metadata`` kept once read: a compact index beside no checkpoint, keyed by the file's bytes.

A torch_dist ``.metadata`` of a 1 T-parameter MoE is ~17 MB of pickle; proving it bounded and gathering what a verdict
needs (:mod:`~megatron_preflight.layout.dcp_index`) takes about a second, every time a job starts, a planner runs or
``inspect`` is asked. Its facts are a few MB of plain rows. Once a ``.metadata`` has been read (and passed the safe
unpickler and the bound), its facts are written here as JSON, under the SHA-256 of the file's bytes, the trust mode
and this index's version: the same bytes give the same facts, so a later read hashes the file (~15 ms for 17 MB) and
loads the rows instead. A file that was refused is never indexed, so it is refused again in full. The index is read
as JSON and checked field by field (nothing in it is executed); anything unexpected in it is ignored and the file is
read again. The source checkpoint is never written to.

Where: ``$MEGATRON_PREFLIGHT_CACHE`` (``off`` turns it off), else ``$XDG_CACHE_HOME/megatron-preflight``, else
``~/.cache/megatron-preflight``; files under :data:`MIN_BYTES` are read directly (they take milliseconds). A cache
dir that cannot be written is skipped (the facts are read as before). The least recently used entries go past
:data:`MAX_TOTAL` bytes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from megatron_preflight.layout.dcp_index import DcpFacts, StoredItem

log = logging.getLogger(__name__)

ENV = "MEGATRON_PREFLIGHT_CACHE"
VERSION = 1  # of the index's form and of what the pass that proves a file bounded checks: bump on either's change
MIN_BYTES = 1 << 20  # smaller .metadata files are read whole each time (the index would not save a millisecond)
MAX_TOTAL = 256 << 20  # the index dir's size: past it the least recently used entries go (a run that saves every
# hour indexes each save: a 1 T-parameter MoE's entry is ~5 MB)
_SUBDIR = "dcp-index"


def cache_dir() -> str | None:
    """The dir the indexes live in, or None when turned off."""
    where = os.environ.get(ENV)
    if where is not None:
        return None if where.strip().lower() in ("", "off", "0", "no", "false") else where
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if not os.path.isabs(home):  # (no home to name: not a dir relative to wherever the job runs)
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(os.path.abspath(base), "megatron-preflight")


def key_of(data: bytes, trust: bool) -> str | None:
    """The index's name for a ``.metadata`` of these bytes read in this trust mode (None: not indexed)."""
    if len(data) < MIN_BYTES or cache_dir() is None:
        return None
    import hashlib  # deferred: a verdict on a small .metadata (or a legacy checkpoint) hashes nothing

    digest = hashlib.sha256(data).hexdigest()
    return f"v{VERSION}-{'trusted' if trust else 'safe'}-{digest}"


def _path(key: str) -> str | None:
    where = cache_dir()
    return None if where is None else os.path.join(where, _SUBDIR, key + ".json")


def load(key: str | None) -> DcpFacts | None:
    """The facts indexed under ``key``; None when there are none (or they do not read as this module writes them)."""
    path = _path(key) if key else None
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
        facts = _decode(doc, key or "")
        try:
            os.utime(path)  # (used: the last to go)
        except OSError:
            pass
        return facts
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        log.info("ignoring the metadata index %s (%s): reading the .metadata again", path, exc)
        return None


def store(key: str | None, facts: DcpFacts) -> None:
    """Index ``facts`` under ``key`` (atomically: a temp file renamed into place); a dir that cannot be written is
    skipped."""
    path = _path(key) if key else None
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        import tempfile  # deferred: only a new index is written

        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as fh:  # (one string, one write: json.dump's many small writes cost 3x)
                fh.write(json.dumps(_encode(facts, key or ""), separators=(",", ":")).encode())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _trim(os.path.dirname(path), keep=path)
    except OSError as exc:
        log.info("could not write the metadata index %s (%s)", path, exc)


def _trim(where: str, keep: str) -> None:
    """Remove the least recently used entries while the dir holds more than :data:`MAX_TOTAL` bytes (never ``keep``,
    the one just written)."""
    entries = []
    for entry in os.scandir(where):
        try:
            if entry.name.endswith(".json") and entry.is_file():
                st = entry.stat()
                entries.append((st.st_mtime_ns, st.st_size, entry.path))
        except OSError:
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, old in sorted(entries):
        if total <= MAX_TOTAL:
            break
        if old == keep:
            continue
        try:
            os.unlink(old)
            total -= size
        except OSError:
            pass


def _encode(facts: DcpFacts, key: str) -> dict[str, Any]:
    """Columns of ints and one table of names (the ~5 * 10^4 extra-state items of a large MoE are most of it)."""
    files = sorted({item.relative_path for item in facts.objects.values()} | set(facts.file_ends))
    file_at = {f: i for i, f in enumerate(files)}
    names = list(facts.order)
    name_at = {n: i for i, n in enumerate(names)}
    for n in (*facts.tensors, *facts.objects):
        if n not in name_at:
            name_at[n] = len(names)
            names.append(n)
    items = facts.objects.values()
    return {
        "key": key,
        "files": files,
        "ends": [facts.file_ends.get(f, -1) for f in files],
        "names": names,
        "order": len(facts.order),  # (the first names)
        "tensors": [[name_at[n] for n in facts.tensors], [list(shape) for shape, _ in facts.tensors.values()],
                    [dtype for _, dtype in facts.tensors.values()]],
        "objects": [[name_at[n] for n in facts.objects], [file_at[i.relative_path] for i in items],
                    [i.offset for i in items], [i.length for i in items]],
        "chunk_problems": [list(p) for p in facts.chunk_problems],
        "unreadable": facts.unreadable,
    }


def _ints(values: Any, below: int | None = None) -> list[int]:
    if type(values) is not list or not set(map(type, values)) <= {int}:
        raise ValueError("not a list of ints")
    if below is not None and values and not 0 <= min(values) <= max(values) < below:
        raise ValueError("an index out of range")
    return values


def _strs(values: Any) -> list[str]:
    if type(values) is not list or not set(map(type, values)) <= {str}:
        raise ValueError("not a list of strings")
    return values


def _columns(value: Any, count: int) -> list[Any]:
    if type(value) is not list or len(value) != count or len({len(c) for c in value if type(c) is list}) > 1:
        raise ValueError("not columns of one length")
    return value


def _decode(doc: Any, key: str) -> DcpFacts:
    """The facts of an index, every field checked to be what :func:`_encode` writes (else ValueError)."""
    if type(doc) is not dict or doc.get("key") != key:
        raise ValueError("not an index of this file")
    files, ends, names, order = _strs(doc["files"]), _ints(doc["ends"]), _strs(doc["names"]), doc["order"]
    if len(files) != len(ends) or type(order) is not int or not 0 <= order <= len(names):
        raise ValueError("the tables disagree in length")
    facts = DcpFacts(order=names[:order], unreadable=_strs(doc["unreadable"]))
    facts.file_ends = {f: e for f, e in zip(files, ends) if e >= 0}  # noqa: B905 - lengths checked
    at, shapes, dtypes = _columns(doc["tensors"], 3)
    for n, shape, dtype in zip(_ints(at, len(names)), shapes, _strs(dtypes)):  # noqa: B905 - lengths checked
        facts.tensors[names[n]] = (tuple(_ints(shape)), dtype)
    at, file, offset, length = _columns(doc["objects"], 4)
    _ints(at, len(names)), _ints(file, len(files)), _ints(offset), _ints(length)
    where = map(StoredItem._make, zip(map(files.__getitem__, file), offset, length))  # noqa: B905 - lengths checked
    facts.objects = dict(zip(map(names.__getitem__, at), where))  # noqa: B905
    for row in doc["chunk_problems"]:
        fqn, why = _strs(row)
        facts.chunk_problems.append((fqn, why))
    return facts
