"""Where a Hugging Face model dir's files may be read from, and how they are opened: the one gate every read of an HF
dir passes (its config, its index, its safetensors, its tokenizer files).

A model dir is untrusted input. A name that ``model.safetensors.index.json`` (or a directory listing) gives is read
only when it is a plain relative path inside the dir (no ``..``, not absolute) that resolves inside the dir, and only
a regular file is opened, without blocking (a FIFO or a device where a shard should be would hang every command). One
kind of symlink leaving the dir is followed: a Hugging Face hub cache snapshot (``models--ORG--NAME/snapshots/REV/``)
holds every file as a link to ``../../blobs/HASH`` of the same repo, which is where transformers reads them too.

JSON files are read bounded in size and in nesting depth, and a duplicate key is refused (the second of two entries of
one name would silently win)."""

from __future__ import annotations

import itertools
import json
import os
import stat
from typing import Any

from megatron_preflight.errors import CorruptFileError, PreflightError

MAX_JSON = 64 * 2**20  # config.json ~2 kB, a DeepSeek-V3 index ~2 MB: anything this large is not one


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blobs(model_dir: str) -> str | None:
    """The ``blobs/`` dir of the hub cache repo whose snapshot ``model_dir`` is, else None."""
    snapshot = os.path.abspath(model_dir)
    snapshots = os.path.dirname(snapshot)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(("models--", "datasets--")):
        return os.path.realpath(os.path.join(repo, "blobs"))
    return None


def member(model_dir: str, name: Any, named_by: str) -> str:
    """The path of file ``name`` of ``model_dir``, which ``named_by`` (a file path) names; refused unless it lies
    inside the dir (or, for a hub cache snapshot, in its repo's ``blobs/``)."""
    fix = ("a model's index names files inside the model dir only: download the model again, or put the file in the "
           "model dir and name it relative to it")
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptFileError(f"it names a file {name!r} that is not a file name", path=named_by, fix=fix,
                               code="unsafe_path")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        raise CorruptFileError(f"it names the file {name!r}, outside the model dir {model_dir}: refused (a model "
                               "dir's files are read from inside it only)", path=named_by, fix=fix, code="unsafe_path")
    path = os.path.join(model_dir, name)
    real = os.path.realpath(path)
    root = os.path.realpath(model_dir)
    if _inside(real, root):
        return path
    blobs = _hub_blobs(model_dir)
    if blobs is not None and _inside(real, blobs):
        return path
    raise CorruptFileError(f"{name!r} is a symlink to {real}, outside the model dir {root}: refused (a model dir's "
                           "files are read from inside it only)", path=named_by,
                           fix=f"copy {real} into the model dir in place of the link, or point --load at its own dir",
                           code="unsafe_path")


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (opened without blocking, so a FIFO cannot
    hang; refused after the open, so the check is of what was opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CorruptFileError(f"cannot open the file ({exc.strerror})", path=path,
                               fix="check that it exists and is readable (download the model again)",
                               code="unreadable_file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise CorruptFileError(f"this is {kind}, not a regular file: refused (reading it could block forever)",
                               path=path, fix="replace it with the file of the model (download the model again)",
                               code="not_regular")
    return fd


def is_regular(path: str) -> bool:
    """Whether ``path`` exists and is (or links to) a regular file."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def read_bounded(path: str, limit: int = MAX_JSON) -> bytes:
    """The whole of the small regular file ``path`` (refused above ``limit`` bytes)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptFileError(f"the file has {size:,} bytes, more than the {limit:,} such a file can have",
                                   path=path, fix="download the model again", code="corrupt_file")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise CorruptFileError(f"the file grows past the {limit:,} bytes such a file can have", path=path,
                                   fix="download the model again", code="corrupt_file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # (at C speed: an index names 92k tensors; a duplicate is looked for only where one is)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


class _Duplicate(ValueError):
    pass


class _NotANumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotANumber(name)


def _infinity_only(name: str) -> Any:
    if name == "NaN":
        raise _NotANumber(name)
    return float(name)  # (Infinity / -Infinity: a config's unbounded limit; every number used is checked finite)


def parse_json(raw: bytes | str, path: str, fix: str, counted: tuple[str, ...] = (), infinity: bool = False,
               floats_as_text: bool = False) -> Any:
    """``raw`` parsed as JSON: nesting bounded (the parser's recursion limit), a duplicate key refused, naming it, and
    ``NaN`` / ``Infinity`` (which Python's parser accepts) refused (``infinity``: ``Infinity`` taken, as transformers 4
    writes an unbounded limit such as NemotronH's ``time_step_limit``; each number a reader uses is checked finite).

    ``counted``: keys that each object of the top level's values holds once (a safetensors header's ``dtype``,
    ``shape``, ``data_offsets``); their occurrences counted in ``raw`` decide, at C speed, whether the exact duplicate
    check (a Python call per object) is needed: without a duplicate, each is met as often as the objects hold it.
    ``floats_as_text``: a number with a fraction or an exponent is kept as its text (where only integers belong, one
    is then no number at all, never equal to one)."""
    try:
        if not counted:  # (the exact check in the one parse)
            return json.loads(raw, parse_constant=_infinity_only if infinity else _refuse_constant,
                              object_pairs_hook=_refuse_duplicates)
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=str if floats_as_text else None)
        if isinstance(value, dict):
            data = raw.encode() if isinstance(raw, str) else raw
            sub = [v for v in value.values() if type(v) is dict]
            # (the objects holding each key, counted at C speed: a DeepSeek-V3 header has 92k)
            need_exact = any(data.count(b'"' + k.encode() + b'"')
                             != sum(map(dict.__contains__, sub, itertools.repeat(k))) for k in counted)
            if need_exact:
                json.loads(raw, object_pairs_hook=_refuse_duplicates)
    except _NotANumber as exc:
        raise CorruptFileError(f"it holds {exc.args[0]}, which is no number a model has (and not JSON)", path=path,
                               fix=fix, code="corrupt_file") from None
    except _Duplicate as exc:
        raise CorruptFileError(f"it defines {exc.args[0]!r} twice (the second would silently replace the first)",
                               path=path, fix=fix, code="corrupt_file") from None
    except RecursionError:
        raise CorruptFileError("its JSON nests deeper than any such file does", path=path, fix=fix,
                               code="corrupt_file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptFileError(f"it is not valid JSON ({exc})", path=path, fix=fix, code="corrupt_file") from None
    return value


def load_json(path: str, fix: str, infinity: bool = False) -> Any:
    """The small JSON file ``path`` (a config, an index), read through :func:`read_bounded` and :func:`parse_json`."""
    return parse_json(read_bounded(path), path, fix, infinity=infinity)


def present(model_dir: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``model_dir`` holds, each a regular file inside it (one that is there but links out of
    the dir, or is not a regular file, is refused: it would be read, or copied into a written checkpoint)."""
    found = []
    for name in names:
        path = os.path.join(model_dir, name)
        if not os.path.lexists(path):
            continue
        member(model_dir, name, model_dir)
        if not is_regular(path):
            os.close(open_regular(path))  # raises, naming what it is
        found.append(name)
    return tuple(found)


TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_code(model_dir: str) -> str | None:
    """The class of the model's own tokenizer code that ``tokenizer_config.json`` names for ``AutoTokenizer``
    (its ``auto_map``: Kimi K2's ``tokenization_kimi.TikTokenTokenizer``, a module of the model dir and a class),
    which transformers runs only when trusted (``trust_remote_code``); None where the tokenizer is transformers' own
    (or the file cannot be read: its other checks name that). The file is read only as a regular file inside the dir."""
    try:
        if not present(model_dir, (TOKENIZER_CONFIG,)):
            return None
        doc = load_json(os.path.join(model_dir, TOKENIZER_CONFIG), "download tokenizer_config.json again")
    except (PreflightError, OSError):
        return None
    auto = doc.get("auto_map") if isinstance(doc, dict) else None
    entry = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    names = [entry] if isinstance(entry, str) else [e for e in entry if isinstance(e, str)] \
        if isinstance(entry, list) else []
    return names[0] if names else None


def tokenizer_module(code: str) -> str | None:
    """The file of the module a tokenizer class ``module.Class`` (or a hub repo's ``repo--module.Class``) lives in,
    beside the model: a plain module name, never a path."""
    module = code.split("--")[-1].rpartition(".")[0]
    return module + ".py" if module.isidentifier() else None
