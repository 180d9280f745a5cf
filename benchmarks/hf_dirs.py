"""Hugging Face model dirs for the benchmarks, written directly (no model is built): bf16 safetensors shards with an
index, and a command timed in a fresh process."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import time

ITEMSIZE = {"BF16": 2, "F8_E4M3": 1, "F32": 4}


def write_shards(path: str, groups: list[list[tuple]], *, hollow: bool) -> int:
    """One safetensors file per group of (name, shape[, dtype: BF16 unless named]) and the index naming them;
    ``hollow``: each body sparse (the size its header promises, no bytes), else random finite bf16 values (bf16
    only). Returns the tensors' bytes."""
    os.makedirs(path, exist_ok=True)
    weight_map, total = {}, 0
    for k, part in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, at = {}, 0
        for t, shape, *dtype in part:
            code = dtype[0] if dtype else "BF16"
            n = ITEMSIZE[code] * math.prod(shape)
            header[t] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + n]}
            weight_map[t] = name
            at += n
        raw = json.dumps(header).encode()
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            if hollow:
                fh.truncate(8 + len(raw) + at)
            left = 0 if hollow else at
            while left:  # random bytes, exponent bits cleared (finite values, as weights are)
                chunk = bytearray(os.urandom(min(left, 64 << 20)))
                chunk[1::2] = bytes(b & 0x3F for b in chunk[1::2])
                fh.write(chunk)
                left -= len(chunk)
        total += at
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return total


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MiB, exit status, output) of ``cmd`` under /usr/bin/time -v."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=3600)
    wall = time.perf_counter() - t0
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    return wall, rss, r.returncode, r.stdout + r.stderr
