"""Offline resharding: write a new checkpoint at the target layout — atomically, never touching the source.

Every shard is written into ``.<DST>.tmp-<pid>/``; the tracker is written last; then the temp dir is renamed to DST.
The format's writer does the writing (:mod:`.legacy`: one file per shard, in parallel worker processes, each of
which indexes the layout the main process sends and reads only what its shards need; :mod:`.torch_dist`: the global
tensors, in this process). Under torchrun every rank writes its share.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as WaitTimedOut  # the builtin from 3.11; its own class in 3.10
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import dtypes, parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.gc_budget import collect_rarely
from megatron_preflight.layout import naming, storage, transport
from megatron_preflight.layout.dist import DCP_METADATA
from megatron_preflight.layout.model import Format
from megatron_preflight.reshard.checkpoint_index import CheckpointIndex
from megatron_preflight.reshard.execute.replicas import Drifted
from megatron_preflight.reshard.plan.topology import saved_arg
from megatron_preflight.reshard.resharder import Resharder, open_resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets import destination, durable, lifeline, share
from megatron_preflight.reshard.targets.unit import ShardResult, Tapping, Target
from megatron_preflight.units import human_bytes


@dataclass
class Summary:
    shards: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    verified_tensors: int = 0
    replicas_compared: int = 0
    replicas_full: bool = False
    converted: str = ""
    stale_removed: list[str] = field(default_factory=list)
    stale_kept: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    destination: str = ""
    source_notes: list[str] = field(default_factory=list)  # what about the source the user should know
    added: list[str] = field(default_factory=list)  # files a tap added beside the iteration dir (fingerprints)
    drifted: str = ""  # the replicas Megatron lets drift that differed (replicas.Drifted.render)

    def render(self) -> str:
        lines = [
            f"wrote {self.shards} shard(s) to {self.destination}",
            *self.source_notes,
            f"read {self.bytes_read / 2**20:.1f} MiB, wrote {self.bytes_written / 2**20:.1f} MiB in "
            f"{self.seconds:.2f} s; peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB",
        ]
        if self.verified_tensors:
            lines.append(f"verified {self.verified_tensors} tensors against their source slices (crc32): all match")
        if self.replicas_compared:
            how = "whole" if self.replicas_full else "sampled"
            agree = "all agree" if not self.drifted else "all agree but those Megatron lets drift"
            lines.append(f"compared {self.replicas_compared} source replicas with their main copy ({how}): {agree}")
        if self.drifted:
            lines.append(self.drifted)
        if self.converted:
            lines.append(self.converted)
        for path in self.stale_removed:
            lines.append(f"removed {path}: partial output of an earlier run that died")
        for path in self.stale_kept:
            lines.append(f"left {path}: partial output of an earlier run (remove it when that run is gone)")
        for path in self.added:
            lines.append(f"wrote {path}")
        for key, why in self.dropped.items():
            lines.append(f"not carried: {key} — {why}")
        return "\n".join(lines)


def _vocab_note(r: Resharder, target: TargetLayout) -> list[str]:
    """Where the padded vocab changed and Megatron's default divisor is not what both sides use: what a run of the new
    checkpoint must pass (a run with another ``--make-vocab-size-divisible-by`` builds an embedding of another size
    and fails to load it)."""
    v = r.vocab
    if v is None or v.target_padded == v.source_padded or target.ckpt_format == "hf":
        return []
    saved = int(saved_arg(r.layout.saved_args, "make_vocab_size_divisible_by", parallel.VOCAB_DIVISOR) or parallel.VOCAB_DIVISOR)
    div = v.divisor  # (the planner's: the run's flag, else the source's)
    if div is None or div == saved == parallel.VOCAB_DIVISOR:
        return []
    why = (f"; the source's model takes {saved} (`megatron-preflight flags` prints it): give the run's flags after --, "
           f"or add --make-vocab-size-divisible-by {saved} there" if div != saved else "")
    return [f"note: the embedding and output layer hold {v.target_padded:,} rows ({v.source_padded:,} in the source): "
            f"its {v.real:,} vocab rows padded for --make-vocab-size-divisible-by {div} at TP{r.tgt.tp} (a run of it "
            f"must use the same){why}"]


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


Progress = Callable[[int, int, str], None]  # (shards done, shards in all, the shard just written)


_WORKER: Resharder | None = None


def _init_worker(layout: bytes, target: TargetLayout, trust: bool, keep_optimizer: bool, parent_pid: int,
                 with_torch: bool = True) -> None:
    """A worker's resharder, from the layout the main process discovered and checked (sent compact: no worker lists,
    parses or checks the source again; each builds its one index), read as the main process read it (``with_torch``:
    torch loaded first)."""
    global _WORKER
    lifeline.die_with_parent(parent_pid)  # a killed main process takes its workers with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (and to stop us)
    collect_rarely()
    if with_torch:
        import torch  # noqa: F401 - the layout's values read as torch's, as in the main process
    _WORKER = open_resharder(CheckpointIndex(transport.loads(layout), trust=trust), target,
                             keep_optimizer=keep_optimizer)


# The output formats: ``--ckpt-format`` -> its target's module and class (see targets/unit.py), imported when a run
# writes that format (a legacy output is written without torch: the others' modules import it)
TARGETS: dict[str, tuple[str, str]] = {
    "torch": ("legacy", "LegacyTarget"), "torch_dist": ("torch_dist", "TorchDistTarget"),
    "fsdp_dtensor": ("fsdp_dtensor", "FsdpDtensorTarget"), "hf": ("hf", "HfTarget"),
}
_MADE: dict[str, Target] = {}


def target_of(target: TargetLayout) -> Target:
    fmt = target.ckpt_format or "torch"
    if fmt not in _MADE:
        module, cls = TARGETS[fmt]
        _MADE[fmt] = getattr(importlib.import_module(f"{__package__}.{module}"), cls)()
    return _MADE[fmt]


def _write_shard(name: str, iter_out: str, verify: bool, tapping: Tapping | None,
                 resharder: Resharder | None = None) -> ShardResult:
    """One unit, in a worker (its resharder) or in the main process (``resharder``)."""
    r = resharder or _WORKER
    assert r is not None
    return target_of(r.target).write(r, name, iter_out, verify, tapping)


def write_resharded(src: str, dst: str, target: TargetLayout, *, workers: int = 1, verify: bool = False,
                    iteration: int | str | None = None, trust_checkpoint: bool = False,
                    progress: Progress | None = None, drop_optimizer: bool = False,
                    distributed: bool = False, keep_stale: bool = False, tapping: Tapping | None = None,
                    precheck: Callable[[tuple[int, int]], None] | None = None) -> Summary:
    """Reshard the legacy checkpoint at ``src`` into a new checkpoint root ``dst`` at ``target``. Under torchrun
    (``distributed``), every rank writes its share of the shards (see :mod:`share`). ``progress`` is called after
    each shard (on rank 0); the engine itself never prints. ``tapping`` sees every tensor written and adds its files
    to the output before the rename (``reshard --fingerprint``). ``precheck`` runs on every rank, with (rank, world),
    before anything is written (``reshard --verify``: the source's content against its stored fingerprints, each
    rank a share); an error it raises stops every rank."""
    t0 = time.perf_counter()
    grp = share.from_env() if distributed else None
    done = False
    try:
        summary = _write(src, dst, target, workers=workers, verify=verify, iteration=iteration,
                         trust_checkpoint=trust_checkpoint, progress=progress, drop_optimizer=drop_optimizer, grp=grp,
                         keep_stale=keep_stale, tapping=tapping, precheck=precheck)
        done = True
    finally:
        if grp is not None:
            grp.close(meet=done)
    summary.seconds = time.perf_counter() - t0
    return summary


def _agree(grp: share.Share | None, error: BaseException | None) -> None:
    """Every rank raises the first error any rank had (so no rank waits on, or renames for, a failed one)."""
    if grp is None:
        if error is not None:
            raise error
        return
    msg = None if error is None else (error.render() if isinstance(error, PreflightError) else repr(error))
    errors = [(r, m) for r, m in enumerate(grp.gather(msg)) if m is not None]
    if error is not None:
        raise error
    if errors:
        rank, m = errors[0]
        raise PreflightError(f"rank {rank} failed: {m}", code="reshard")


def _check_parent(dst: str) -> None:
    """The nearest existing ancestor of the destination is a directory this user may write into."""
    here = os.path.dirname(dst)
    while here and not os.path.lexists(here):
        here = os.path.dirname(here)
    here = here or "."
    if not os.path.isdir(here):
        raise PreflightError(f"the destination's path goes through {here}, which is a file, not a directory",
                             path=dst, fix="pass a destination under an existing directory", code="usage")
    if not os.access(here, os.W_OK | os.X_OK):
        raise PreflightError(f"this user may not create anything in {here}", path=dst,
                             fix="pass a destination in a directory you can write to (or fix its permissions)",
                             code="usage")


def _check_room(parent: str, need: int | None, dst: str) -> None:
    """The destination's file system has room for at least the new checkpoint's tensor bytes: a full disk is said
    before the first byte is written, not hours into the write."""
    if not need:
        return
    try:
        st = os.statvfs(parent)
    except OSError:
        return  # (a file system that cannot say: the writes will)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise PreflightError(f"the new checkpoint needs at least {human_bytes(need)} (its tensors' bytes) and the "
                             f"destination's file system has {human_bytes(free)} free", path=dst,
                             fix="free space there, or write the new checkpoint to a file system with room",
                             code="no_space")


def check_destination(src: str, dst: str) -> None:
    """The destination is new (or empty), writable, and not inside the source."""
    storage.refuse_url(src, "source")
    storage.refuse_url(dst, "destination")  # (never a local dir named msc: created by accident)
    src_abs, dst_abs = os.path.abspath(src), os.path.abspath(dst)
    if os.path.exists(dst_abs) and (not os.path.isdir(dst_abs) or os.listdir(dst_abs)):
        raise PreflightError("the destination exists and is not empty", path=dst_abs,
                             fix="pass a new directory (the source is never overwritten)", code="usage")
    _check_parent(dst_abs)
    src_real, dst_real = os.path.realpath(src_abs), os.path.realpath(dst_abs)  # through symlinks
    if dst_real == src_real or dst_real.startswith(src_real + os.sep):
        raise PreflightError("the destination is inside the source checkpoint", path=dst_abs,
                             fix="write the new checkpoint somewhere else: the source is never written to",
                             code="usage")


def starts_without_torch(src: str, target: TargetLayout, *, tapped: bool = False) -> bool:
    """Whether the run may start without torch: a legacy output, not tapped (a fingerprint hashes tensors), from what
    looks like a legacy source (a shard dir and no DCP metadata, in the dir or its iteration dirs). A legacy ->
    legacy reshard moves bytes and never loads torch (~2 s of a fresh process); any other source is read with torch
    loaded first (the run opens it again if the look was wrong)."""
    if (target.ckpt_format or "torch") != "torch" or tapped:
        return False
    try:
        dirs = [src] + [os.path.join(src, d) for d in os.listdir(src) if naming.parse_iteration_dir(d) is not None]
        names = [n for d in dirs if os.path.isdir(d) for n in os.listdir(d)]
    except OSError:
        return False  # (the open says what is wrong)
    return DCP_METADATA not in names and any(naming.parse_shard_dir_name(n) is not None for n in names)


def open_checked(src: str, target: TargetLayout, *, iteration: Any, trust_checkpoint: bool,
                 drop_optimizer: bool) -> Resharder:
    """The resharder for an offline run; refuses to drop optimizer state the user did not ask to drop."""
    r = open_resharder(src, target, iteration=iteration, trust_checkpoint=trust_checkpoint,
                       keep_optimizer=not drop_optimizer)
    saved = r.layout.saved_args
    if saved is not None and parallel.gtp_sizes(saved, r.layout.tp or 1, r.layout.etp or r.layout.tp or 1) != (1, 1):
        raise PreflightError("the checkpoint was saved with generalized tensor parallelism (--tensor-parallel-num-"
                             "weight-shards above the TP size): its shards' offsets are composite (tp_rank x GTP + "
                             "gtp_rank), which megatron-preflight does not reshard yet", path=r.layout.iter_dir,
                             fix="load it at its saved TP and --tensor-parallel-num-weight-shards",
                             code="unsupported")
    if r.optimizer_problem is not None and not drop_optimizer:
        p = r.optimizer_problem
        raise PreflightError(f"the source holds optimizer state that cannot be resharded ({p.message}); writing "
                             "the new layout would drop it", path=p.path or r.layout.iter_dir,
                             fix="pass --drop-optimizer to write the weights without it (then start the run with "
                                 "--no-load-optim)", code="optimizer")  # a refusal: exit 1, not a usage error
    return r


def _write(src: str, dst: str, target: TargetLayout, *, workers: int, verify: bool, iteration: int | str | None,
           trust_checkpoint: bool, progress: Progress | None, drop_optimizer: bool,
           grp: share.Share | None, keep_stale: bool = False, tapping: Tapping | None = None,
           precheck: Callable[[tuple[int, int]], None] | None = None) -> Summary:
    dst_abs = os.path.abspath(dst)
    root = grp is None or grp.rank == 0
    error: BaseException | None = None
    r: Resharder | None = None
    try:
        check_destination(src, dst)
        if not starts_without_torch(src, target, tapped=tapping is not None):
            import torch  # noqa: F401 - loaded before the source is read: its values read as tensors
        r = open_checked(src, target, iteration=iteration, trust_checkpoint=trust_checkpoint,
                         drop_optimizer=drop_optimizer)
        if r.source_format != Format.TORCH and not dtypes.torch_loaded():  # (not the legacy source it looked like)
            import torch  # noqa: F401 - as above

            r = open_checked(src, target, iteration=iteration, trust_checkpoint=trust_checkpoint,
                             drop_optimizer=drop_optimizer)
        files = SourceFiles(r.layout.iter_dir or "", trust=trust_checkpoint)
        try:
            r.check_masters(files)
        finally:
            files.close()
        if precheck is not None:
            precheck((grp.rank, grp.world) if grp is not None else (0, 1))
    except BaseException as e:  # noqa: BLE001 - agreed on below, then re-raised
        error = e
    _agree(grp, error)
    assert r is not None
    dest_box: list[destination.Destination] = []
    try:
        return _write_claimed(r, src, dst_abs, target, workers=workers, verify=verify, iteration=iteration,
                              trust_checkpoint=trust_checkpoint, progress=progress,
                              drop_optimizer=drop_optimizer, grp=grp, root=root, keep_stale=keep_stale,
                              claimed=lambda d: dest_box.append(d), tapping=tapping)
    finally:
        for claimed_dest in dest_box:
            claimed_dest.release()


def _write_claimed(r: Resharder, src: str, dst_abs: str, target: TargetLayout, *, workers: int, verify: bool,
                   iteration: Any, trust_checkpoint: bool, progress: Progress | None, drop_optimizer: bool,
                   grp: share.Share | None, root: bool, keep_stale: bool, claimed: Callable,
                   tapping: Tapping | None = None) -> Summary:
    out = target_of(target)
    names = out.units(r)
    parent = os.path.dirname(dst_abs) or "."
    iteration_value = r.layout.iteration if r.layout.iteration is not None else 0
    tmp = ""
    error: BaseException | None = None
    dest: destination.Destination | None = None
    if root:
        try:  # one writer at a time; earlier runs' partial output found (and removed unless kept)
            dest = destination.claim(dst_abs, remove_stale=not keep_stale)
            claimed(dest)
            if os.path.exists(dst_abs) and (not os.path.isdir(dst_abs) or os.listdir(dst_abs)):
                raise PreflightError("the destination exists and is not empty", path=dst_abs,
                                     fix="pass a new directory (the source is never overwritten)", code="usage")
            tmp = dest.tmp
            shutil.rmtree(tmp, ignore_errors=True)
            _check_room(parent, out.least_bytes(r), dst_abs)
            os.makedirs(out.out_dir(tmp, iteration_value), exist_ok=True)
        except BaseException as e:  # noqa: BLE001 - agreed on below, then re-raised
            error = e
    _agree(grp, error)
    mine = names
    if grp is not None:
        tmp = grp.broadcast(tmp)  # after rank 0 made it
        owner = share.deal(out.weights(r), grp.world)
        mine = [n for n in names if owner[n] == grp.rank]
    iter_out = out.out_dir(tmp, iteration_value)
    # (an HF model holds weights only, said by its target: nothing else is "not carried")
    summary = Summary(shards=len(names), dropped=dict(r.dropped) if target.ckpt_format != "hf" else {},
                      destination=dst_abs, converted=r.converted)
    summary.source_notes = [f"note: the source's tracker is unusable ({p.message.split(';')[0]}): resharded "
                            f"iteration {r.layout.iteration}, the latest present; the new checkpoint's tracker names it"
                            for p in r.layout.problems if p.code in ("no_tracker", "bad_tracker")]
    summary.source_notes += _vocab_note(r, target)
    if dest is not None:
        summary.stale_removed, summary.stale_kept = list(dest.stale_removed), list(dest.stale_kept)
    results: list[ShardResult] = []
    error = None
    try:
        results = _write_shards(r, mine, iter_out, src, target, workers=workers, verify=verify,
                                iteration=iteration, trust=trust_checkpoint, progress=progress if root else None,
                                keep_optimizer=not drop_optimizer, tapping=tapping)
    except BaseException as e:  # noqa: BLE001 - agreed on below, then re-raised
        error = e
    try:
        _agree(grp, error)
    except BaseException:
        if root:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    totals = [(sum(x.bytes_read for x in results), sum(x.bytes_written for x in results),
               sum(x.verified for x in results), _peak_rss(), sum(x.replicas for x in results),
               _merged(x.drifted for x in results))]
    if grp is not None:
        totals = grp.gather(totals[0])
    summary.bytes_read = sum(t[0] for t in totals)
    summary.bytes_written = sum(t[1] for t in totals)
    summary.verified_tensors = sum(t[2] for t in totals)
    summary.peak_rss_bytes = max(t[3] for t in totals)
    summary.replicas_compared = sum(t[4] for t in totals)
    summary.replicas_full = verify
    summary.drifted = _merged(t[5] for t in totals).render()
    tapped = [x.tapped for x in results]
    if grp is not None and tapping is not None:
        tapped = [t for part in grp.gather(tapped) for t in part]
    error = None
    if root:
        try:
            if tapping is not None:
                summary.added = tapping.finish(r, tapped, tmp, dst_abs)
            durable.fsync_tree(tmp)  # every shard file is already on disk; now the dirs that name them
            summary.source_notes += out.seal(r, tmp, iteration_value)  # the tracker (an HF model's index) last
            durable.fsync_dir(tmp)
            if os.path.isdir(dst_abs):
                os.rmdir(dst_abs)  # empty (checked above)
            os.rename(tmp, dst_abs)
            durable.fsync_dir(parent)  # the rename itself
        except BaseException as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    _agree(grp, error)
    return summary


def _block_sigint() -> set[int] | None:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return None
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}))


def _restore_mask(old: set[int] | None) -> None:
    if old is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's workers at once (their partial files are in the temp dir, which the caller removes)."""
    procs = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _result(fut: Any) -> Any:
    """A worker's result, waited for in half-second slices. A Ctrl-C the kernel hands to another thread of this
    process (this main process has a native thread that does not block SIGINT) only sets Python's flag: a wait
    without a timeout returns to Python code, and acts on it, only when that worker's shard is done."""
    while True:
        try:
            return fut.result(timeout=0.5)
        except WaitTimedOut:
            continue


def _write_shards(r: Resharder, names: list[str], iter_out: str, src: str, target: TargetLayout, *, workers: int,
                  verify: bool, iteration: Any, trust: bool, progress: Progress | None,
                  keep_optimizer: bool, tapping: Tapping | None = None) -> list[ShardResult]:
    """Write ``names`` into ``iter_out`` (in worker processes when ``workers`` > 1)."""
    results: list[ShardResult] = []
    if workers > 1 and len(names) > 1:
        ctx = mp.get_context("spawn")
        pool = ProcessPoolExecutor(max_workers=min(workers, len(names)), mp_context=ctx, initializer=_init_worker,
                                   initargs=(transport.dumps(r.checkpoint.layout), target, trust, keep_optimizer,
                                             os.getpid(), dtypes.torch_loaded()))
        try:
            # Workers start inside submit(); with SIGINT blocked meanwhile they (and the resource tracker) start with
            # it blocked, so a Ctrl-C while one is still importing cannot print a half traceback from it. A Ctrl-C
            # that arrives here is delivered when the mask is restored.
            old_mask = _block_sigint()
            try:
                futures = {pool.submit(_write_shard, n, iter_out, verify, tapping): n for n in names}
            finally:
                _restore_mask(old_mask)
            for i, fut in enumerate(futures, 1):
                results.append(_result(fut))
                if progress:
                    progress(i, len(names), futures[fut])
        except BaseException:  # an error, Ctrl-C or SIGTERM: stop the workers now, not after their shards
            _stop(pool)
            raise
        pool.shutdown(wait=True)
    else:
        for i, name in enumerate(names, 1):
            results.append(_write_shard(name, iter_out, verify, tapping, r))
            if progress:
                progress(i, len(names), name)
    return results


def _merged(parts: Any) -> Drifted:
    """One :class:`Drifted` of several units' (None: a unit that compared none)."""
    out = Drifted()
    for d in parts:
        if d is not None:
            for key, diff in d.tensors.items():
                out.tensors[key] = max(diff, out.tensors.get(key, 0.0))
            out.causes |= d.causes
    return out
