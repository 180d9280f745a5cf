"""A remote checkpoint staged as a local sparse mirror: every object a file of its size under a temp dir, only the
byte ranges a command needs fetched into place.

What each need fetches:

- ``metadata`` (inspect / check / plan / flags, the hook's verdict): the tracker, every small non-tensor file of the
  root and of the iteration read (``.metadata``, ``metadata.json``, ``common.pt``, ``config.json``, tokenizer
  files...), each safetensors file's header, and a torch_dist iteration's non-tensor items (the common state,
  optimizer param groups, extra states: the ``.metadata`` says where each lies in its ``.distcp`` file). No tensor
  byte is asked for; the rest of each file stays a hole.
- ``all`` (an offline reshard, diff, fingerprint): every byte, in parts fetched in parallel.
- :meth:`Mirror.fetch` fetches any other ranges (a rank's own bytes at job start).

A legacy checkpoint (``--ckpt-format torch``: Megatron-LM writes only torch_dist through msc) is staged whole for
``all`` and refused for ``metadata``: deciding on it would mean fetching every shard's pickle."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.dist import COMMON_PT, DCP_METADATA, object_index, read_dcp_metadata
from megatron_preflight.layout.hf.safetensors import MAX_HEADER  # (a longer header: not fetched, the reader refuses it)
from megatron_preflight.remote.store import NO_OBJECTS, Store
from megatron_preflight.units import human_bytes

log = logging.getLogger(__name__)

TENSOR_SUFFIXES = (".distcp", ".safetensors", ".bin", ".pt", ".pth")  # files whose bulk is tensor bytes
SMALL_FILES = (COMMON_PT,)  # ... except these, read whole
MAX_SMALL = 512 * 2**20  # a non-tensor file larger than this is not metadata (a DeepSeek-V3 .metadata is ~60 MB)
PART = 64 * 2**20  # one ranged GET of an ``all`` fetch
WORKERS = 8  # GETs in flight (each up to PART bytes held)
SMALL_WORKERS = 32  # ... when every GET is small (a verdict's metadata: one range per .distcp file, ~1,000 of them
SMALL = 4 * 2**20  # for a 1,024-rank save: latency-bound, not bandwidth-bound)
STAGING_ENV = "MEGATRON_PREFLIGHT_STAGING"  # where mirrors are staged (default: staging_root's choice)
SHM = "/dev/shm"
MANIFEST = "manifest.json"  # beside the mirrored tree (whose root is named for the profile)


def staging_root(nbytes: int) -> str:
    """Where a mirror that may hold ``nbytes`` is staged: ``$MEGATRON_PREFLIGHT_STAGING``, else memory (``/dev/shm``)
    when it and the free memory hold twice that, else the system's temp dir. Measured (benchmarks/bench_remote.py,
    1.2 GB reshard from the store): staged on this box's disk the fetched copy's writeback competes with the
    output's (13.3 s), in memory the reshard takes the local one's time plus the fetch (7.6 s vs 6.7 s)."""
    chosen = os.environ.get(STAGING_ENV)
    if chosen:
        return chosen
    try:
        st = os.statvfs(SHM)
        shm_free = st.f_bavail * st.f_frsize
        with open("/proc/meminfo", encoding="ascii") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return tempfile.gettempdir()
    return SHM if min(shm_free, avail) > 2 * nbytes else tempfile.gettempdir()


def _is_tensor_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(TENSOR_SUFFIXES) and name not in SMALL_FILES


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges sorted, adjacent and overlapping ones merged."""
    out: list[list[int]] = []
    for off, n in sorted(r for r in ranges if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(a, b) for a, b in out]


class Mirror:
    """The objects under ``url`` as sparse local files under :attr:`local`."""

    def __init__(self, url: str, *, root: str | None = None) -> None:
        """``root``: where the temp dir is made (default: :func:`staging_root`'s choice)."""
        self.store = Store(url)
        self.url = self.store.url
        self.objects = self.store.list()
        if not self.objects:
            raise PreflightError("no objects under this prefix: no checkpoint here", path=self.url,
                                 fix="pass the prefix Megatron-LM saved to (its --save msc://... dir)",
                                 code=NO_OBJECTS)
        self.root = tempfile.mkdtemp(prefix="preflight-msc-", dir=root or staging_root(self.size))
        self.local = os.path.join(self.root, self.store.profile)
        self.fetched: dict[str, list[tuple[int, int]]] = {}
        os.makedirs(self.local)
        for rel, size in self.objects.items():
            path = self.path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.truncate(size)  # a hole until fetched

    @classmethod
    def attach(cls, at: str, url: str) -> Mirror:
        """The mirror another process of this node made ``at`` (:meth:`save_manifest`): no listing, nothing fetched."""
        with open(os.path.join(at, MANIFEST), encoding="utf-8") as fh:
            doc = json.load(fh)
        if doc.get("url") != url:
            raise PreflightError(f"the staging dir holds {doc.get('url')!r}, not this URL", path=at,
                                 fix="remove it and rerun", code="remote")
        self = cls.__new__(cls)
        self.store, self.url, self.root = Store(url), url.rstrip("/"), at
        self.local = os.path.join(at, self.store.profile)
        self.objects = {k: int(v) for k, v in doc["objects"].items()}
        self.fetched = {k: [tuple(r) for r in v] for k, v in doc["fetched"].items()}
        return self

    def save_manifest(self) -> None:
        """What :meth:`attach` reads: the objects and what is fetched (written last, atomically)."""
        tmp = os.path.join(self.root, MANIFEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"url": self.url, "objects": self.objects, "fetched": self.fetched}, fh)
        os.replace(tmp, os.path.join(self.root, MANIFEST))

    @property
    def size(self) -> int:
        return sum(self.objects.values())

    def path(self, rel: str) -> str:
        return os.path.join(self.local, *rel.split("/"))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_files(self) -> list[str]:
        """Files written into the mirror that the store does not hold (relative paths): what a command wrote beside
        the checkpoint (``fingerprint``'s file)."""
        out = []
        for dirpath, _dirs, files in os.walk(self.local):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), self.local).replace(os.sep, "/")
                if rel not in self.objects:
                    out.append(rel)
        return sorted(out)

    def shown(self, text: str) -> str:
        """``text`` with the mirror's local paths written as the URLs they stand for."""
        return text.replace(self.local, self.url)

    def summary(self) -> str:
        c = self.store.counters
        return (f"{self.url}: {human_bytes(c.fetched)} fetched of {human_bytes(self.size)} in {len(self.objects):,} "
                f"objects ({c.requests:,} requests)")

    # -- fetching ------------------------------------------------------------------------------------------------
    def fetch(self, ranges: dict[str, Iterable[tuple[int, int]]], *, workers: int | None = None) -> None:
        """Fetch ``rel -> (offset, length) ranges`` into place (ranges already fetched are not fetched again)."""
        jobs = []
        asked: dict[str, list[tuple[int, int]]] = {}
        for rel, want in ranges.items():
            size = self.objects[rel]
            have = self.fetched.get(rel, [])
            asked[rel] = _merged((o, min(n, size - o)) for o, n in want if o < size)
            for off, n in asked[rel]:
                if any(a <= off and off + n <= a + b for a, b in have):
                    continue
                for part in range(off, off + n, PART):
                    jobs.append((rel, part, min(PART, off + n - part)))
        if not jobs:
            return

        def one(job: tuple[str, int, int]) -> None:
            rel, off, n = job
            data = self.store.read(rel, off, n)
            fd = os.open(self.path(rel), os.O_WRONLY)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(fd, view, off + len(data) - len(view)):]
            finally:
                os.close(fd)

        if workers is None:
            workers = SMALL_WORKERS if all(n <= SMALL for _, _, n in jobs) else WORKERS
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
            for _ in pool.map(one, jobs):
                pass
        for rel, got in asked.items():
            self.fetched[rel] = _merged([*self.fetched.get(rel, []), *got])

    def fetch_all(self, rels: Iterable[str] | None = None) -> None:
        """Every byte of ``rels`` (default: every object: refused up front when the staging dir cannot hold it)."""
        if rels is None:
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
            if free < self.size:
                raise PreflightError(f"staging the checkpoint ({human_bytes(self.size)}) needs that much free space "
                                     f"where it is staged, and {self.root} has {human_bytes(free)}", path=self.url,
                                     fix=f"set {STAGING_ENV} to a dir with room (a local disk), or run it where "
                                         "there is", code="environment")
        self.fetch({rel: [(0, self.objects[rel])] for rel in (self.objects if rels is None else rels)})

    def stage_metadata(self, iteration: int | str | None = None) -> None:
        """Fetch what a verdict reads (see the module docstring)."""
        scope = self._scope(iteration)
        self._refuse_legacy(scope)
        small = [r for r in scope if not _is_tensor_file(r) and self.objects[r] <= MAX_SMALL]
        self.fetch_all(small)
        heads = [r for r in scope if r.endswith(".safetensors")]
        self.fetch({r: [(0, 8)] for r in heads})  # each header's length, then the header: no tensor byte
        lengths = {}
        for r in heads:
            with open(self.path(r), "rb") as fh:
                lengths[r] = int.from_bytes(fh.read(8), "little")
        self.fetch({r: [(8, n)] for r, n in lengths.items() if 0 < n <= MAX_HEADER})
        for rel in scope:
            if rel.rsplit("/", 1)[-1] == DCP_METADATA and any(r.endswith(".distcp") for r in scope):
                self._stage_objects(rel.rsplit("/", 1)[0] if "/" in rel else "")

    def _scope(self, iteration: int | str | None) -> list[str]:
        """The objects a verdict may read: the root's files and the iteration dir's (the tracker's, or ``iteration``);
        every object when there is no tracker (an HF model, an iteration dir passed itself)."""
        tracker = naming.TRACKER_FILENAME
        if iteration is None and tracker in self.objects:
            self.fetch_all([tracker])
            with open(self.path(tracker), encoding="utf-8", errors="replace") as fh:
                iteration = naming.parse_tracker(fh.read(64))
        if iteration is None:
            return list(self.objects)
        name = naming.iteration_dir_name(iteration)
        # the root's files, the iteration's, and those of other dirs that are no iteration (fingerprints, tokenizer)
        return [r for r in self.objects if "/" not in r or r.startswith(name + "/")
                or naming.parse_iteration_dir(r.split("/", 1)[0]) is None]

    def _refuse_legacy(self, scope: list[str]) -> None:
        legacy = [r for r in scope if r.endswith((naming.MODEL_FILENAME, naming.DISTRIB_OPTIM_FILENAME))]
        if legacy:
            raise PreflightError("a legacy (--ckpt-format torch) checkpoint on object storage: deciding on it would "
                                 "fetch every shard's pickle, and Megatron-LM itself saves only torch_dist through "
                                 "msc://", path=self.url,
                                 fix=f"reshard it to torch_dist once (`megatron-preflight reshard {self.url} "
                                     f"{self.url}_torch_dist` fetches it and writes torch_dist there), or check a "
                                     "local copy",
                                 code="usage")

    def _stage_objects(self, iter_rel: str) -> None:
        """A torch_dist iteration's non-tensor items, where its ``.metadata`` says they lie."""
        md = read_dcp_metadata(self.path(iter_rel) if iter_rel else self.local)
        want: dict[str, list[tuple[int, int]]] = {}
        for info in object_index(md).values():
            rel = f"{iter_rel}/{info.relative_path}" if iter_rel else str(info.relative_path)
            if rel in self.objects:
                want.setdefault(rel, []).append((int(info.offset), int(info.length)))
        self.fetch(want)


@contextmanager
def staged(url: str, need: str, iteration: int | str | None = None) -> Iterator[Mirror]:
    """``url`` staged for ``need`` (``metadata`` or ``all``), removed after."""
    with Mirror(url) as mirror:
        if need == "metadata":
            mirror.stage_metadata(iteration)
        elif need == "all":
            mirror.fetch_all()
        else:
            raise ValueError(need)
        log.info("%s", mirror.summary())
        yield mirror
