"""A persistent gloo world of worker processes that run the same task on every rank (test-only).

Starting a process and importing megatron.core costs seconds; building a tiny model costs milliseconds. So the test
session starts one world and reuses it for every layout (``destroy_model_parallel`` + re-init per task).
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import tempfile
import traceback
from typing import Any

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    sys.path.insert(0, ROOT)
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from tests.helpers import cpu_compat

    cpu_compat.apply()
    while True:
        item = tasks.get()
        if item is None:
            break
        module, func, kwargs = item
        try:
            fn = getattr(importlib.import_module(module), func)
            result = (rank, True, fn(**kwargs))
        except BaseException as exc:  # report and keep serving
            result = (rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        release_groups()
        results.put(result)
    dist.destroy_process_group()


def release_groups() -> None:
    """Destroy every process group a task made (megatron-core's destroy_model_parallel only forgets most of them:
    each gloo group keeps its threads, and a long session would pile up thousands of threads per worker)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    except ImportError:
        pass
    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)


def thread_counts(pids: list[int]) -> dict[int, int]:
    """Threads of each process (Linux /proc), for the suite-health check."""
    out = {}
    for pid in pids:
        try:
            out[pid] = len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            out[pid] = 0
    return out


class Pool:
    def __init__(self, world: int = 4) -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="mp_pool_")
        init_file = os.path.join(self._tmp, "init")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world, init_file, self._tasks[r], self._results),
                                   daemon=False) for r in range(world)]
        for p in self._procs:
            p.start()

    def run(self, func: str, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run ``module:function`` on every rank with ``kwargs``; the per-rank results, in rank order."""
        module, name = func.split(":")
        dead = [p.pid for p in self._procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"pool workers {dead} are gone (an earlier task timed out or crashed)")
        for q in self._tasks:
            q.put((module, name, kwargs))
        out: dict[int, Any] = {}
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                import signal

                for p in self._procs:  # dump every worker's stack to stderr before giving up
                    if p.is_alive() and p.pid:
                        os.kill(p.pid, signal.SIGUSR1)
                import time

                time.sleep(2)
                self.close()
                raise TimeoutError(f"pool task {func} timed out after {timeout}s; ranks done: {sorted(out)}") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                out[rank] = None
        if errors:
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(self.world)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
