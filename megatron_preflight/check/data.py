"""The data, checked at job start from file headers: Megatron opens its indexed datasets only after the model and the
checkpoint are loaded, and a missing or truncated ``.bin``/``.idx`` (or token ids beyond the vocab) fails then.

A Megatron indexed dataset (``megatron/core/datasets/indexed_dataset.py``) is a prefix with two files: ``.idx`` —
the magic ``MMIDIDX\\x00\\x00``, a version (``<Q``, 1), a dtype code (``<B``), the sequence and document counts
(``<Q`` each), then int32 sequence lengths, int64 byte pointers and int64 document indices — and ``.bin``, the tokens.
Only the header, the last sequence's length and pointer (two small reads), and a bounded sample of the first tokens
are read.

The index cache: rank 0 builds each dataset's shuffle/sample indices and writes them to ``--data-cache-path`` or, by
default, ``<prefix>/cache/GPTDataset_indices`` (``gpt_dataset.py``); a directory it cannot write fails there ("Failed
to write dataset materials to the data cache directory"), after the model and the checkpoint are loaded.
"""

from __future__ import annotations

import json
import os
import struct

from megatron_preflight.check import save
from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs

FATAL, INFO = Severity.FATAL, Severity.INFO

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8), 6: ("float64", 8),
          7: ("float32", 4), 8: ("uint16", 2)}
_FORMAT = {"uint8": "B", "int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint16": "H"}
SAMPLE_BYTES = 1 << 16  # tokens sampled from the start of each .bin


def prefixes(values: list[str] | None) -> list[str]:
    """The dataset prefixes of a ``--data-path``-style list: ``PREFIX ...`` or ``WEIGHT PREFIX WEIGHT PREFIX ...``."""
    if not values:
        return []
    words = [w for v in values for w in str(v).split()]
    try:
        float(words[0])
    except ValueError:
        return words
    return words[1::2]


def _all_prefixes(rt: RuntimeArgs) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset the run reads."""
    out = [("--data-path", p) for p in prefixes(rt.data_path)]
    for flag, values in (("--train-data-path", rt.train_data_path), ("--valid-data-path", rt.valid_data_path),
                         ("--test-data-path", rt.test_data_path)):
        out += [(flag, p) for p in prefixes(values)]
    if rt.per_split_data_args_path:
        try:
            with open(rt.per_split_data_args_path) as fh:
                splits = json.load(fh)
            for split in ("train", "valid", "test"):
                words = splits.get(split) or []
                out += [("--per-split-data-args-path", p) for p in prefixes(
                    words.split() if isinstance(words, str) else [str(w) for w in words])]
        except OSError as exc:
            out.append(("--per-split-data-args-path", f"<unreadable {rt.per_split_data_args_path}: {exc.strerror}>"))
        except (ValueError, AttributeError):
            out.append(("--per-split-data-args-path",
                        f"<unreadable {rt.per_split_data_args_path}: not a JSON object of train/valid/test lists>"))
    if rt.data_args_path:
        try:
            with open(rt.data_args_path) as fh:
                out += [("--data-args-path", p) for p in prefixes(fh.read().split())]
        except OSError as exc:
            out.append(("--data-args-path", f"<unreadable {rt.data_args_path}: {exc.strerror}>"))
    return out


def check_prefix(prefix: str, vocab: int | None) -> str | None:
    """Why the indexed dataset at ``prefix`` cannot be read as Megatron reads it (None: it can)."""
    idx, binf = prefix + ".idx", prefix + ".bin"
    for path in (idx, binf):
        if not os.path.isfile(path):
            return f"{path} does not exist"
    try:
        with open(idx, "rb") as fh:
            head = fh.read(len(MAGIC) + 8 + 1 + 16)
            if len(head) < len(MAGIC) + 25 or not head.startswith(MAGIC):
                return f"{idx} is not a Megatron indexed dataset index (no MMIDIDX header)"
            version, code = struct.unpack("<QB", head[len(MAGIC):len(MAGIC) + 9])
            count, _docs = struct.unpack("<QQ", head[len(MAGIC) + 9:])
            if version != 1:
                return f"{idx} has index version {version}; Megatron reads version 1"
            if code not in DTYPES:
                return f"{idx} has an unknown dtype code {code}"
            dtype, size = DTYPES[code]
            need = len(head) + count * 4 + count * 8
            if os.path.getsize(idx) < need:
                return f"{idx} is truncated ({os.path.getsize(idx)} bytes, its {count} sequences need {need})"
            expected = 0
            if count:
                fh.seek(len(head) + (count - 1) * 4)
                (last_len,) = struct.unpack("<i", fh.read(4))
                fh.seek(len(head) + count * 4 + (count - 1) * 8)
                (last_ptr,) = struct.unpack("<q", fh.read(8))
                expected = last_ptr + last_len * size
        actual = os.path.getsize(binf)
        if actual < expected:
            return f"{binf} is truncated: {actual} bytes, its index says {expected}"
        if actual > expected:
            return f"{binf} holds {actual} bytes, its index says {expected}: the two files are of different datasets"
        if vocab and dtype in _FORMAT and actual:
            with open(binf, "rb") as fh:
                blob = fh.read(min(actual, SAMPLE_BYTES) // size * size)
            top = max(struct.unpack(f"<{len(blob) // size}{_FORMAT[dtype]}", blob))
            if top >= vocab:
                return f"{binf} holds token id {top}, beyond the run's vocab of {vocab} (another tokenizer?)"
    except OSError as exc:
        return f"cannot read {prefix}.idx/.bin ({exc.strerror})"
    return None


def data_findings(rt: RuntimeArgs) -> list[Finding]:
    """Every dataset the run reads: present, consistent, of a known dtype, token ids within the vocab (sampled)."""
    if rt.mock_data:
        return []
    vocab = rt.padded_vocab_size or rt.vocab_size
    out = []
    readable = []
    for flag, prefix in _all_prefixes(rt):
        problem = prefix[1:-1] if prefix.startswith("<unreadable") else check_prefix(prefix, vocab)
        if not problem:
            readable.append(prefix)
        if problem:
            out.append(Finding("data", None, prefix, FATAL,
                               f"{flag} {prefix}: {problem}; Megatron would find this only after building the model "
                               "and loading the checkpoint", "fix the path (the prefix without .bin/.idx), or "
                               "rebuild the dataset with Megatron's tools/preprocess_data.py"))
    return out + cache_findings(rt, readable)


def _cached(path: str) -> bool:
    try:
        return any(name.endswith("-document_index.npy") for name in os.listdir(path))
    except OSError:
        return False


def cache_findings(rt: RuntimeArgs, prefixes_read: list[str]) -> list[Finding]:
    """Every index cache dir the run's rank 0 writes: writable (or creatable), or already holding indices."""
    dirs = [rt.data_cache_path] if rt.data_cache_path else [
        os.path.join(p, "cache", "GPTDataset_indices") for p in prefixes_read]
    out = []
    for path in dict.fromkeys(dirs):
        probe = save.nearest_existing(path)
        if os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK):
            continue
        flag = "--data-cache-path" if rt.data_cache_path else "the default index cache"
        fix = ("give --data-cache-path a writable directory (on a filesystem all nodes share, so the indices are "
               "built once)")
        if probe == os.path.abspath(path) and _cached(path):
            out.append(Finding("data_cache_path", None, path, INFO,
                               f"warning: {flag} {path} is not writable; the indices already there are used, but a "
                               "run whose indices are not among them (another sequence length, sample count, split "
                               "or seed) fails on rank 0 after the load", fix))
        else:
            out.append(Finding("data_cache_path", None, path, FATAL,
                               f"{flag} {path} cannot be written ({probe} is not a writable directory): Megatron's "
                               "rank 0 fails building the dataset indices ('Failed to write dataset materials to the "
                               "data cache directory'), after the model and the checkpoint are loaded", fix))
    return out
