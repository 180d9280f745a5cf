"""Offline resharding: write a legacy checkpoint at the target layout — atomically, never touching the source.

Every shard is written into ``.<DST>.tmp-<pid>/``; the tracker is written last; then the temp dir is renamed to DST.
Shards are built in parallel worker processes (each one plans and reads only what its shards need).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.reshard.api import Resharder, TargetLayout, open_resharder
from megatron_preflight.reshard.executor import SourceFiles
from megatron_preflight.reshard.planner import RankPlan
from megatron_preflight.reshard.stream_save import save_streaming
from megatron_preflight.torch_file import TensorRef, TorchFile

log = logging.getLogger(__name__)


@dataclass
class Summary:
    shards: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    verified_tensors: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    destination: str = ""

    def render(self) -> str:
        lines = [
            f"wrote {self.shards} shard(s) to {self.destination}",
            f"read {self.bytes_read / 2**20:.1f} MiB, wrote {self.bytes_written / 2**20:.1f} MiB in "
            f"{self.seconds:.2f} s; peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB",
        ]
        if self.verified_tensors:
            lines.append(f"verified {self.verified_tensors} tensors against their source slices (crc32): all match")
        for key, why in self.dropped.items():
            lines.append(f"not carried: {key} — {why}")
        return "\n".join(lines)


def _peak_rss() -> int:
    """Peak resident set of this process (VmHWM: reset at exec, unlike ru_maxrss) and of its worker processes."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    self_kb = int(line.split()[1])
    except OSError:
        pass
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(self_kb, child_kb) * 1024


_WORKER: Resharder | None = None


def _init_worker(src: str, target: TargetLayout, iteration: Any, trust: bool) -> None:
    global _WORKER
    _WORKER = open_resharder(src, target, iteration=iteration, trust_checkpoint=trust)


def _write_shard(name: str, iter_out: str, verify: bool, resharder: Resharder | None = None) -> tuple[int, int, int]:
    r = resharder or _WORKER
    assert r is not None
    plan = r.plan_for_coords(r.tgt.shard_dirs()[name], name)
    files = SourceFiles(r.layout.iter_dir or "", trust=r.trust)
    try:
        out_dir = os.path.join(iter_out, name)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, naming.MODEL_FILENAME)
        save_streaming(r.header(files), plan, files, path)
        checked = verify_shard(plan, path, files) if verify else 0
        return files.bytes_read, os.path.getsize(path), checked
    finally:
        files.close()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def verify_shard(plan: RankPlan, path: str, files: SourceFiles) -> int:
    """Re-read a written shard and check every planned slice against its source slice (crc32). Returns the number of
    tensors checked; raises on any difference."""
    checked = 0
    with TorchFile(path) as out:
        meta = out.load_metadata()
        for tp in plan.tensors:
            written = meta[tp.chunk].get(tp.key, "<missing>")
            if tp.shape is None:
                if written != tp.value:
                    raise PreflightError(f"verify: {tp.key} differs from its source value", path=path, code="verify")
                continue
            if not isinstance(written, TensorRef) or tuple(written.shape) != tuple(tp.shape):
                raise PreflightError(f"verify: {tp.key} is missing or has the wrong shape", path=path, code="verify")
            dst = out.tensor(written)
            mask = torch.zeros(tp.shape[tp.ops[0].dst[0]] if tp.ops and tp.ops[0].dst else 0, dtype=torch.bool)
            for op in tp.ops:
                src = files.tensor(op.shard, op.ref)
                s = src if op.src is None else src.narrow(*op.src)
                d = dst if op.dst is None else dst.narrow(*op.dst)
                if _crc(s) != _crc(d):
                    raise PreflightError(f"verify: {tp.key} does not match its source slice in {op.shard}", path=path,
                                         code="verify")
                if op.dst is not None:
                    mask[op.dst[1]: op.dst[1] + op.dst[2]] = True
            if tp.zero_fill and len(mask) and not bool(mask.all()):
                dim = tp.ops[0].dst[0]
                rest = dst.index_select(dim, torch.nonzero(~mask).flatten())
                if bool(rest.any()):
                    raise PreflightError(f"verify: padding rows of {tp.key} are not zero", path=path, code="verify")
            checked += 1
    return checked


def _progress(done: int, total: int, name: str, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name:<24}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def write_resharded(src: str, dst: str, target: TargetLayout, *, workers: int = 1, verify: bool = False,
                    iteration: int | str | None = None, trust_checkpoint: bool = False,
                    progress: bool = False, drop_optimizer: bool = False) -> Summary:
    """Reshard the legacy checkpoint at ``src`` into a new checkpoint root ``dst`` at ``target``."""
    t0 = time.perf_counter()
    src_abs, dst_abs = os.path.abspath(src), os.path.abspath(dst)
    if os.path.exists(dst_abs) and (not os.path.isdir(dst_abs) or os.listdir(dst_abs)):
        raise PreflightError("the destination exists and is not empty", path=dst_abs,
                             fix="pass a new directory (the source is never overwritten)", code="usage")
    if dst_abs == src_abs or dst_abs.startswith(src_abs + os.sep):
        raise PreflightError("the destination is inside the source checkpoint", path=dst_abs,
                             fix="write the new checkpoint somewhere else: the source is never written to", code="usage")
    r = open_resharder(src, target, iteration=iteration, trust_checkpoint=trust_checkpoint)
    if "optimizer" in r.dropped and not drop_optimizer:
        raise PreflightError("the source holds optimizer state, which follows the saved layout and is not resharded; "
                             "writing the new layout would drop it", path=r.layout.iter_dir,
                             fix="pass --drop-optimizer to write the weights without it (then start the run with "
                                 "--no-load-optim)", code="usage")
    names = list(r.tgt.shard_dirs())
    parent = os.path.dirname(dst_abs) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst_abs)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    iteration_value = r.layout.iteration if r.layout.iteration is not None else 0
    iter_out = os.path.join(tmp, naming.iteration_dir_name(iteration_value))
    os.makedirs(iter_out)
    summary = Summary(shards=len(names), dropped=dict(r.dropped), destination=dst_abs)
    try:
        results: list[tuple[int, int, int]] = []
        if workers > 1 and len(names) > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=min(workers, len(names)), mp_context=ctx, initializer=_init_worker,
                                     initargs=(src, target, iteration, trust_checkpoint)) as pool:
                futures = {pool.submit(_write_shard, n, iter_out, verify): n for n in names}
                for i, fut in enumerate(futures, 1):
                    results.append(fut.result())
                    _progress(i, len(names), futures[fut], progress)
        else:
            for i, name in enumerate(names, 1):
                results.append(_write_shard(name, iter_out, verify, r))
                _progress(i, len(names), name, progress)
        for read, written, checked in results:
            summary.bytes_read += read
            summary.bytes_written += written
            summary.verified_tensors += checked
        with open(os.path.join(tmp, naming.TRACKER_FILENAME), "w") as fh:  # the tracker last
            fh.write(str(iteration_value))
        if os.path.isdir(dst_abs):
            os.rmdir(dst_abs)  # empty (checked above)
        os.rename(tmp, dst_abs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary.seconds = time.perf_counter() - t0
    summary.peak_rss_bytes = _peak_rss()
    return summary
