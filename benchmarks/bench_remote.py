"""Checkpoints on object storage: ``reshard`` from and to a real S3-compatible server (SeaweedFS on loopback,
tests/helpers/s3_server.py) beside a plain client moving the same bytes, and a verdict's bytes fetched beside the
checkpoint's size. Same minutes, median of N, each row a fresh process.

Rows:
  download          boto3 download of every object to local disk (8 threads; the plain client's floor for a read)
  upload            boto3 upload of those files to another prefix (8 threads; multipart above 8 MiB)
  reshard disk->disk  the same reshard of the local copy (the tool's own cost, without the store)
  reshard s3->disk  ``megatron-preflight reshard msc://.../src DST <flags> --ckpt-format torch_dist``
  reshard s3->s3    the same to ``msc://.../dst``
  inspect           ``megatron-preflight inspect msc://.../src`` (its bytes fetched said on stderr)

The checkpoint: a torch_dist checkpoint dir, or ``--make-gb N``: bench_copy's synthetic TP2 legacy checkpoint with
Adam state, converted to torch_dist at the same layout (what Megatron-LM saves to msc://).

Usage: python benchmarks/bench_remote.py [CKPT] [--make-gb 1.2] [--flags "--tp 1"] [--repeat 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from hf_dirs import timed  # noqa: E402

from tests.helpers import s3_server  # noqa: E402


def _size(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs)


def _download(store: s3_server.S3Server, prefix: str, dst: str) -> None:
    c = store.client()
    keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=s3_server.BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]

    def one(key: str) -> None:
        path = os.path.join(dst, key[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        c.download_file(s3_server.BUCKET, key, path)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, keys))


def _upload(store: s3_server.S3Server, src: str, prefix: str) -> None:
    c = store.client()
    files = [os.path.join(d, f) for d, _s, fs in os.walk(src) for f in fs]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: c.upload_file(p, s3_server.BUCKET, prefix + os.path.relpath(p, src)), files))


def _clear(store: s3_server.S3Server, prefix: str) -> None:
    c = store.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=s3_server.BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            c.delete_object(Bucket=s3_server.BUCKET, Key=o["Key"])


def main() -> None:
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--make-gb", type=float)
    ap.add_argument("--flags", default="--tp 1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work")
    ns = ap.parse_args()
    work = ns.work or tempfile.mkdtemp(prefix="bench_remote_")
    src = ns.checkpoint
    if src is None:
        if not ns.make_gb:
            raise SystemExit("give a torch_dist checkpoint, or --make-gb N")
        from bench_copy import make

        legacy = os.path.join(work, f"synthetic_{ns.make_gb:g}gb")
        src = legacy + "_torch_dist"
        if not os.path.isdir(src):
            make(legacy, ns.make_gb)
            subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", legacy, src, "--ckpt-format",
                            "torch_dist", "--no-progress"], check=True, env=dict(os.environ, PYTHONPATH=ROOT))
            shutil.rmtree(legacy)
    store = s3_server.server()
    env = dict(os.environ, PYTHONPATH=ROOT, MSC_CONFIG=store.config("bench.yaml", attempts=3),
               PYTHONPYCACHEPREFIX=os.path.join(work, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    _upload(store, src, "bench/src/")
    size = _size(src)
    cli = [sys.executable, "-m", "megatron_preflight"]
    flags = shlex.split(ns.flags)
    subprocess.run(cli + ["inspect", "msc://store/bench/src"], env=env, capture_output=True)  # fills the cache
    rows: dict[str, list[float]] = {}
    fetched = ""
    for _ in range(ns.repeat):
        down = os.path.join(work, "down")
        shutil.rmtree(down, ignore_errors=True)
        t = time.perf_counter()
        _download(store, "bench/src/", down + "/")
        rows.setdefault("download (boto3, 8 threads)", []).append(time.perf_counter() - t)
        _clear(store, "bench/up/")
        t = time.perf_counter()
        _upload(store, down, "bench/up/")
        rows.setdefault("upload (boto3, 8 threads)", []).append(time.perf_counter() - t)
        shutil.rmtree(down)
        out = os.path.join(work, "out")
        shutil.rmtree(out, ignore_errors=True)
        wall, _rss, rc, text = timed(cli + ["reshard", src, out, *flags, "--ckpt-format", "torch_dist",
                                            "--no-progress"], env=env)
        assert rc == 0, text[-2000:]
        rows.setdefault("reshard disk -> disk", []).append(wall)
        shutil.rmtree(out)
        wall, _rss, rc, text = timed(cli + ["reshard", "msc://store/bench/src", out, *flags, "--ckpt-format",
                                            "torch_dist", "--no-progress"], env=env)
        assert rc == 0, text[-2000:]
        rows.setdefault("reshard s3 -> disk", []).append(wall)
        shutil.rmtree(out)
        _clear(store, "bench/dst/")
        wall, _rss, rc, text = timed(cli + ["reshard", "msc://store/bench/src", "msc://store/bench/dst", *flags,
                                            "--no-progress"], env=env)
        assert rc == 0, text[-2000:]
        rows.setdefault("reshard s3 -> s3", []).append(wall)
        wall, _rss, rc, text = timed(cli + ["inspect", "msc://store/bench/src"], env=env)
        assert rc == 0, text[-2000:]
        rows.setdefault("inspect (metadata only)", []).append(wall)
        m = re.search(r"msc://store/bench/src: (.*?) fetched of (.*?) in (\d+) objects \((\d+) requests\)", text)
        fetched = f"{m.group(1)} of {m.group(2)} ({m.group(4)} requests)" if m else "?"
    gib = size / 2**30
    print(f"checkpoint {src}: {gib:.2f} GiB torch_dist; reshard flags {ns.flags}; median of {ns.repeat}")
    print(f"{'row':34} {'seconds':>8} {'GiB/s':>7}")
    for name, values in rows.items():
        s = statistics.median(values)
        print(f"{name:34} {s:8.2f} {gib / s if 'inspect' not in name else 0:7.2f}")
    print(f"inspect fetched {fetched}")
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
