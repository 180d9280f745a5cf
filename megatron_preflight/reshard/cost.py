"""What a reshard will cost, before any byte moves: bytes read and written, files opened, peak memory and time —
per offline worker (``megatron-preflight reshard --dry-run``) or per runtime rank (the in-memory loader).

Everything comes from the plans (metadata only). Bytes read are the source slices the plans copy (what the writer
counts); bytes written are the sizes of the files the streaming writer makes (the same pickled tree and zip records,
without the tensor bytes: exact but for the pickle's memo of repeated values, tens of bytes a file). Memory is a model of the writer: each process holds the resharder's index (its
resident size now, measured) plus the pieces it streams (:data:`stream_save.CHUNK_BYTES` rows of one tensor and the
source pages under them); an in-memory rank holds its whole state dict. Time is the bytes over a bandwidth the user
gives, or quick probes (a read of the source, an fsync'd write to the OS temp dir), plus the start-up (this process's
own age when it predicts: interpreter, torch, metadata), paid again by spawned workers.
"""

from __future__ import annotations

import heapq
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_preflight.layout import naming
from megatron_preflight.layout.model import Format
from megatron_preflight.reshard.plan.types import RankPlan, flat_parts, planned
from megatron_preflight.reshard.sources.byte_ranges import read_plans
from megatron_preflight.reshard.sources.files import SourceFiles

PROBE_BYTES = 64 * 2**20  # the quick read (and write) that measure the filesystems


@dataclass
class ShardCost:
    """One target shard dir (offline) or one runtime rank's state dict (in memory)."""

    name: str
    bytes_read: int
    bytes_written: int  # the files written (offline); 0 in memory
    bytes_built: int  # the tensors built (the state dict's size)
    largest_tensor: int
    files_opened: int
    sources: list[str] = field(default_factory=list)
    largest_source: int = 0  # the largest source piece read from (a torch_dist chunk is mapped whole for its CRC)


@dataclass
class WorkerCost:
    worker: int
    shards: list[str]
    bytes_read: int
    bytes_written: int
    files_opened: int
    peak_rss_bytes: int
    seconds: float


@dataclass
class Prediction:
    """The cost of a reshard, in total and per worker (offline) or per rank (in memory)."""

    mode: str  # offline | in_memory
    bytes_read: int
    bytes_written: int
    peak_rss_bytes: int  # offline: the whole run (main process + concurrent workers); in memory: the largest rank
    estimated_seconds: float | None  # None: no bandwidth known (the check reads metadata only: it does not probe)
    bandwidth_bytes_per_s: float | None  # reading the source
    bandwidth_from: str  # given | measured | none
    files_opened: int
    write_bandwidth_bytes_per_s: float = 0.0  # writing (and syncing) the output; offline only
    startup_seconds: float = 0.0  # interpreter, torch and the metadata: paid by the main process and each worker
    workers: list[WorkerCost] = field(default_factory=list)  # offline
    ranks: list[ShardCost] = field(default_factory=list)  # in memory: one per target shard dir (its DP replicas alike)
    of_ranks: int = 0  # in memory, when ``ranks`` are a sample (see representative_ranks): how many dirs they stand for

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.mode == "offline":
            out.pop("ranks")
        else:
            out.pop("workers")
            for r in out["ranks"]:
                r.pop("bytes_written")
        return out

    def render(self) -> str:
        mib = 2**20
        if self.mode == "in_memory":
            worst = max(self.ranks, key=lambda r: r.bytes_read, default=None)
            if worst is None:
                return "reshard cost: nothing to read"
            time = ("" if self.estimated_seconds is None or not self.bandwidth_bytes_per_s else
                    f"; about {self.estimated_seconds:.1f} s at {self.bandwidth_bytes_per_s / mib:.0f} MiB/s "
                    f"({self.bandwidth_from})")
            total = (f"{self.bytes_read / mib:.1f} MiB read in all; " if not self.of_ranks else "")
            sample = (f" ({len(self.ranks)} of {self.of_ranks} shard dirs planned: each stage's first and last "
                      "tensor-parallel ranks stand for the rest)" if self.of_ranks else "")
            return (f"reshard cost: {total}each rank reads at most "
                    f"{worst.bytes_read / mib:.1f} MiB from {max(r.files_opened for r in self.ranks)} file(s) and "
                    f"holds at most {self.peak_rss_bytes / mib:.1f} MiB of resharded state{time}{sample}")
        lines = [f"dry run: nothing written. Predicted: read {self.bytes_read / mib:.1f} MiB, write "
                 f"{self.bytes_written / mib:.1f} MiB, {self.files_opened} source file(s) opened, peak RSS "
                 f"{self.peak_rss_bytes / mib:.0f} MiB (all processes), about {self.estimated_seconds:.1f} s "
                 f"(reading at {self.bandwidth_bytes_per_s / mib:.0f} MiB/s, writing at "
                 f"{self.write_bandwidth_bytes_per_s / mib:.0f} MiB/s: {self.bandwidth_from}; "
                 f"{self.startup_seconds:.1f} s start-up)",
                 f"{'worker':>6} {'shards':>6} {'read MiB':>10} {'write MiB':>10} {'files':>6} {'peak MiB':>9} "
                 f"{'seconds':>8}"]
        for w in self.workers:
            lines.append(f"{w.worker:>6} {len(w.shards):>6} {w.bytes_read / mib:>10.1f} {w.bytes_written / mib:>10.1f} "
                         f"{w.files_opened:>6} {w.peak_rss_bytes / mib:>9.0f} {w.seconds:>8.1f}")
        return "\n".join(lines)


def _numel(shape: Any) -> int:
    n = 1
    for s in shape or ():
        n *= s
    return n


def slices_read(plan: RankPlan) -> tuple[int, set[tuple[str, str]], int]:
    """Bytes of the source slices ``plan`` copies, the (shard dir, file) pairs it opens, and the largest source piece
    it reads from."""
    total = largest = 0
    opened: set[tuple[str, str]] = set()
    for tp in read_plans(plan):
        for op in tp.ops:
            largest = max(largest, _numel(op.ref.shape) * op.ref.dtype.itemsize)
            shape = list(op.ref.shape)
            if op.src is not None:
                shape[op.src[0]] = op.src[2]
            total += _numel(shape) * op.ref.dtype.itemsize
            opened.add((op.shard, os.path.basename(getattr(op.ref, "file", "") or naming.MODEL_FILENAME)))
    return total, opened, largest


def _built(plan: RankPlan) -> tuple[int, int]:
    """(bytes of every tensor the plan builds, the largest one); a world tensor counts whole, its padding included."""
    sizes = [_numel(tp.shape) * tp.dtype.itemsize for tp in planned(plan) if tp.shape is not None]
    sizes += [fp.numel * fp.dtype.itemsize for _, fp in flat_parts(plan.dist_optimizer)]
    return sum(sizes), max(sizes, default=0)


def shard_cost(r: Any, name: str, plan: RankPlan, header: dict[str, Any] | None) -> ShardCost:
    """The cost of one target shard; with ``header`` (offline), the sizes of the files written."""
    read, opened, largest_source = slices_read(plan)
    built, largest = _built(plan)
    written = 0
    if header is not None:
        from megatron_preflight.reshard.targets.stream_save import planned_size, shard_tree  # the writer's (torch)

        written = planned_size(shard_tree(header, plan), naming.MODEL_FILENAME)
        if plan.dist_optimizer is not None:
            written += planned_size(plan.dist_optimizer, naming.DISTRIB_OPTIM_FILENAME)
    return ShardCost(name, read, written, built, largest, len(opened), sorted({s for s, _ in opened}),
                     largest_source)


def rss_now() -> int:
    """This process's resident set (VmRSS), bytes."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_bandwidth(iter_dir: str, limit: int = PROBE_BYTES) -> float:
    """Bytes per second of a quick sequential read of the biggest source file (up to ``limit`` bytes). On a warm
    page cache this is the cache's speed: pass --bandwidth for a cold parallel filesystem."""
    biggest, size = None, 0
    for dirpath, _dirs, files in os.walk(iter_dir):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                s = os.path.getsize(p)
            except OSError:
                continue
            if s > size:
                biggest, size = p, s
    if biggest is None or size == 0:
        return 1e9
    t0 = time.perf_counter()
    done = 0
    with open(biggest, "rb", buffering=0) as fh:
        while done < min(size, limit):
            chunk = fh.read(4 * 2**20)
            if not chunk:
                break
            done += len(chunk)
    return done / max(time.perf_counter() - t0, 1e-6)


def measure_write_bandwidth(limit: int = PROBE_BYTES) -> float:
    """Bytes per second of writing and fsyncing ``limit`` bytes to a temp file of the OS temp dir, the way a shard is
    written there (:func:`~.targets.output_file.open_output`: direct where the file system supports it); removed at
    once: nothing is written near the checkpoint (pass --bandwidth when the destination is another filesystem)."""
    from megatron_preflight.reshard.targets import output_file  # (deferred: a verdict writes nothing)

    block = b"\0" * (4 * 2**20)
    fd, path = tempfile.mkstemp(prefix="preflight-bandwidth-")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        with output_file.open_output(path) as fh:
            for _ in range(max(1, limit // len(block))):
                fh.write(block)
            fh.commit()
        took = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return max(1, limit // len(block)) * len(block) / max(took, 1e-6)


def process_age() -> float:
    """Seconds since this process started (its interpreter and imports: what every worker pays again)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _bandwidth(r: Any, bandwidth: float | None) -> tuple[float, str]:
    if bandwidth:
        return bandwidth, "given"
    return measure_bandwidth(r.layout.iter_dir or r.layout.path), "measured"


def _load_writer() -> None:
    """Import what the run being predicted imports before it writes (the writer and the arrays it builds pieces in:
    numpy for a torch-free legacy run), so that the resident set measured as its base is the run's."""
    import numpy  # noqa: F401 - the pieces' arrays (torch's tensors share numpy's buffers too)

    # the writers' modules, loaded as the run loads them (their own imports deferred: no torch unless loaded)
    from megatron_preflight.reshard.targets import legacy, write_behind, zip_writer  # noqa: F401


def predict_offline(r: Any, *, workers: int = 1, verify: bool = False, bandwidth: float | None = None,
                    names: list[str] | None = None, startup_seconds: float = 0.0) -> Prediction:
    """The cost of ``megatron-preflight reshard`` (legacy output) with ``workers`` processes, from resharder ``r``
    (``startup_seconds``: what starting up and opening ``r`` took, which each worker spends again)."""
    from megatron_preflight.reshard.targets.stream_save import CHUNK_BYTES, PIECE_BUFFERS  # (deferred: the writer)

    _load_writer()
    base = rss_now()  # the index and the imports: what the main process holds, and each worker again
    files = SourceFiles(r.layout.iter_dir or "", trust=r.trust)
    try:
        header = r.header(files)
        costs = [shard_cost(r, n, r.plan_for_coords(naming.shard_writers(r.tgt)[n], n), header)
                 for n in (names or list(naming.shard_writers(r.tgt)))]
    finally:
        files.close()
    bw, source = _bandwidth(r, bandwidth)
    wbw = bandwidth or measure_write_bandwidth()
    n_workers = max(1, min(workers, len(costs))) if workers > 1 and len(costs) > 1 else 1
    # The pool hands shards out in order to whichever worker is free first.
    free = [(0.0, w) for w in range(n_workers)]
    assigned: dict[int, list[ShardCost]] = {w: [] for w in range(n_workers)}
    for c in costs:
        t, w = heapq.heappop(free)
        assigned[w].append(c)
        heapq.heappush(free, (t + c.bytes_read / bw + c.bytes_written / wbw, w))
    out = []
    for w, mine in assigned.items():
        biggest = max((c.largest_tensor for c in mine), default=0)
        # the writer's piece buffers, each up to a chunk of rows, and the source pages mapped for the piece being built
        # (released after it: sources/files.py); a torch_dist source's chunk is mapped whole where its CRC chain reads
        # past the rows taken, until it is released
        mapped = max((c.largest_source for c in mine), default=0) \
            if r.source_format in (Format.TORCH_DIST, Format.FSDP_DTENSOR) else 0
        working = PIECE_BUFFERS * min(biggest, CHUNK_BYTES) + max(min(biggest, CHUNK_BYTES), mapped) + (
            2 * biggest + max((c.bytes_written for c in mine), default=0) if verify else 0)
        read, written = sum(c.bytes_read for c in mine), sum(c.bytes_written for c in mine)
        again = read + written if verify else 0  # --verify re-reads the source slices and the written files
        out.append(WorkerCost(w, [c.name for c in mine], read, written, len({s for c in mine for s in c.sources}),
                              base + working, (read + again) / bw + written / wbw))
    # the main process starts, then its spawned workers (at once); more workers than cores share them
    crowd = max(1.0, n_workers / (os.cpu_count() or 1))
    start = startup_seconds * (1 + crowd if n_workers > 1 else 1)
    peak = sum(w.peak_rss_bytes for w in out) + (base if n_workers > 1 else 0)
    tracker = len(str(r.layout.iteration if r.layout.iteration is not None else 0))
    return Prediction("offline", sum(c.bytes_read for c in costs), sum(c.bytes_written for c in costs) + tracker, peak,
                      start + crowd * max(w.seconds for w in out), bw, source,
                      len({s for c in costs for s in c.sources}), workers=out, write_bandwidth_bytes_per_s=wbw,
                      startup_seconds=startup_seconds)


SAMPLE_ABOVE = 16  # a target with more shard dirs is predicted from representative_ranks


def representative_ranks(tgt: Any) -> list[str]:
    """The target shard dirs whose costs stand for all: in each pipeline stage, one dir for each of the first and
    last rank of tensor (and expert tensor) parallelism — the first such dir, at the lowest expert rank. The ranks
    between hold slices of the same tensors of the same sizes (experts divide evenly over EP ranks; only the last TP
    rank's vocab rows may differ)."""
    dirs = naming.shard_writers(tgt)
    last = {k: max(c[k] for c in dirs.values()) for k in ("tp", "etp")}
    picked: dict[tuple[int, int, int], str] = {}
    for name, c in sorted(dirs.items(), key=lambda kv: (kv[1]["ep"], kv[0])):
        if all(c[k] in (0, last[k]) for k in last):
            picked.setdefault((c["pp"], c["tp"], c["etp"]), name)
    return [n for n in dirs if n in picked.values()]


def predict_in_memory(r: Any, *, bandwidth: float | None = None, names: list[str] | None = None,
                      sample: bool = False) -> Prediction:
    """The cost of loading through the in-memory resharder: per target shard dir (every runtime rank with those
    coordinates reads the same), what the rank reads and the state it builds; the time only with a ``bandwidth``
    (nothing is probed: the check reads metadata only). ``sample``: a target of more than :data:`SAMPLE_ABOVE` dirs
    is planned at :func:`representative_ranks` only (the worst rank's figures hold; the totals are left out)."""
    every = naming.shard_writers(r.tgt)
    if names is None and sample and len(every) > SAMPLE_ABOVE:
        names = representative_ranks(r.tgt)
    costs = [shard_cost(r, n, r.plan_for_coords(every[n], n), None) for n in (names or list(every))]
    worst = max(costs, key=lambda c: c.bytes_read, default=None)
    seconds = worst.bytes_read / bandwidth if worst and bandwidth else (0.0 if bandwidth else None)
    return Prediction("in_memory", sum(c.bytes_read for c in costs), 0, max((c.bytes_built for c in costs), default=0),
                      seconds, bandwidth, "given" if bandwidth else "none",
                      len({s for c in costs for s in c.sources}), ranks=costs,
                      of_ranks=len(every) if len(costs) < len(every) else 0)


DIST_CHUNK_OVERHEAD = 1200  # a torch_dist chunk's torch.save wrapper and .metadata entry, bytes (measured ~1 KB)


def predict_torch_dist(r: Any, g: Any, *, bandwidth: float | None = None,
                       startup_seconds: float = 0.0) -> Prediction:
    """The cost of writing the torch_dist form (one process: the global tensors of ``g``, the TP1·PP1·EP1 plan, as
    chunks; an estimate: chunk wrappers are counted at :data:`DIST_CHUNK_OVERHEAD` bytes each)."""
    from megatron_preflight.reshard.targets.stream_save import CHUNK_BYTES  # deferred: the writer imports torch

    base = rss_now()
    name, coords = next(iter(naming.shard_writers(g.tgt).items()))
    plan = g.plan_for_coords(coords, name)
    c = shard_cost(g, name, plan, None)
    tensors = len(read_plans(plan))
    written = c.bytes_built + DIST_CHUNK_OVERHEAD * tensors
    bw, source = _bandwidth(r, bandwidth)
    wbw = bandwidth or measure_write_bandwidth()
    # one global tensor is held whole while its chunks are serialized (a section of it copied out first: one more of
    # its size at most), beside the source pages mapped to build it
    peak = base + 2 * c.largest_tensor + min(c.largest_tensor, CHUNK_BYTES)
    w = WorkerCost(0, ["torch_dist"], c.bytes_read, written, c.files_opened, peak, c.bytes_read / bw + written / wbw)
    return Prediction("offline", c.bytes_read, written, peak, startup_seconds + w.seconds, bw, source, c.files_opened,
                      workers=[w], write_bandwidth_bytes_per_s=wbw, startup_seconds=startup_seconds)
