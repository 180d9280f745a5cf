"""What one torch_dist chunk blob costs to write: ``stream_save.write_tensor_blob`` (a cached frame per dtype and
shape, the data's CRC-32 patched in: three writes) beside laying the same six records out one by one with
``TorchZipWriter`` (what it did before) and ``torch.save`` — a torch_dist save writes one blob per chunk, 10^4-10^5 of
them for a large MoE. Into a file on disk (page cache; no fsync), best of 5 rounds, microseconds per blob.

Usage: python benchmarks/bench_blob.py [--count 3000]
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time

import torch

from megatron_preflight.reshard.targets import stream_save as ss
from megatron_preflight.reshard.targets.zip_writer import TorchZipWriter


def by_records(fh, t: torch.Tensor) -> None:
    raw = t.reshape(-1).view(torch.uint8).numpy()
    zw = TorchZipWriter(None, "archive", fh=fh)
    for name, data in (("data.pkl", ss._blob_pickle(t.dtype, tuple(t.shape))), (".format_version", ss._FORMAT_VERSION),
                       ("byteorder", ss._BYTEORDER), ("data/0", raw), ("version", ss._VERSION),
                       (".data/serialization_id", ss._serialization_id("archive", raw.nbytes).encode())):
        zw.write(name, data)
    zw.close()


def with_torch_save(fh, t: torch.Tensor) -> None:
    buf = io.BytesIO()
    torch.save(t, buf)
    fh.write(buf.getbuffer())


def per_blob_us(write, t: torch.Tensor, count: int, path: str) -> float:
    best = float("inf")
    for _ in range(5):
        with open(path, "wb") as fh:
            start = time.perf_counter()
            for _ in range(count):
                write(fh, t)
            best = min(best, time.perf_counter() - start)
    return best / count * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=3000, help="blobs per round for the smallest chunk")
    ns = ap.parse_args()
    chunks = [("expert chunk 32x112 bf16 (7 KiB)", torch.randn(32, 112).to(torch.bfloat16)),
              ("256x1024 fp32 (1 MiB)", torch.randn(256, 1024)),
              ("2048x2048 fp32 (16 MiB)", torch.randn(2048, 2048))]
    path = os.path.join(tempfile.mkdtemp(prefix="bench_blob_"), "__0_0.distcp")
    print(f"{'chunk':<36} {'frame us':>9} {'records us':>11} {'torch.save us':>14}")
    try:
        for label, t in chunks:
            count = max(20, ns.count * 7168 // max(t.numel() * t.element_size(), 7168))
            row = [per_blob_us(w, t, count, path) for w in (ss.write_tensor_blob, by_records, with_torch_save)]
            print(f"{label:<36} {row[0]:>9.1f} {row[1]:>11.1f} {row[2]:>14.1f}")
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    main()
