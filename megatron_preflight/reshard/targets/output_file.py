"""A shard file written front to back (a few small patches behind its end allowed: a zip record's header once its
CRC-32 is known) and made durable by :meth:`commit`, by the write strategy the file system calls for.

:func:`open_output` chooses per file, from what the kernel says of it, not from a flag:
- **direct I/O** (:class:`DirectFile`) where ``statx`` reports direct-I/O alignment (ext4, XFS, btrfs on a block
  device; Linux 6.1+) and one aligned test write through ``O_DIRECT`` succeeds: the bytes are gathered in reused,
  aligned staging buffers and written with ``O_DIRECT`` a few MiB at a time, straight to the device. Nothing lands in the page cache, so no page-cache page is allocated,
  zeroed or faulted in, no dirty page is throttled and no writeback has to catch up at the fsync. Measured on this
  project's box (a VM disk, docs/performance.md): a 0.66 GB file buffered 2.9 s when the kernel handed out page-cache
  pages the host had taken back (most of it in the kernel's copy into them), direct 0.59 s, every time.
- **buffered** (:class:`BufferedOutput`) everywhere else (tmpfs, where the page cache *is* the file; NFS, Lustre and
  FUSE clients, which do not report an alignment; older kernels): the page cache with early writeback
  (:class:`~.durable.Writeback`), as before.

``MEGATRON_PREFLIGHT_DIRECT_IO=0`` forces buffered writes (and ``--verify``'s mapped read-back: read_back.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import threading
from typing import Any

from megatron_preflight import libc
from megatron_preflight.reshard.targets.durable import Writeback

log = logging.getLogger(__name__)

STAGE_BYTES = 8 << 20  # a direct file's staging buffer: the size of each write to the device
STAGES = 3  # its staging buffers: one filled while the others are written
_POLL = 0.5  # seconds: a caller waiting for a buffer wakes this often to see whether the writing thread failed
_ENV = "MEGATRON_PREFLIGHT_DIRECT_IO"


def direct_io_wanted() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def open_output(path: str) -> DirectFile | BufferedOutput:
    """Create (or truncate) ``path`` for writing, direct where its file system supports it, else buffered."""
    # (read-write: a patch of blocks already written reads them back)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        align = enable_direct(fd)
        if align is not None and _direct_writes_work(fd, align):
            return DirectFile(fd, path, align)
        return BufferedOutput(os.fdopen(fd, "wb"), path)
    except BaseException:
        os.close(fd)
        raise


def enable_direct(fd: int) -> int | None:
    """Turn ``O_DIRECT`` on for the open file ``fd`` where its file system reports a direct-I/O alignment no coarser
    than a page (an ``mmap``'s buffers are page-aligned) and direct I/O is wanted: the alignment offsets, lengths and
    buffers then need; None (the flag left off) elsewhere."""
    align = libc.dio_alignment(fd) if direct_io_wanted() and hasattr(os, "O_DIRECT") else None
    if align is None or max(align) > mmap.PAGESIZE:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return None
    return max(align)


def aligned_span(offset: int, nbytes: int, align: int) -> tuple[int, int]:
    """The aligned byte range ``[lo, hi)`` that holds ``[offset, offset + nbytes)``."""
    return offset - offset % align, -(-(offset + nbytes) // align) * align


def _direct_writes_work(fd: int, align: int) -> bool:
    """Write one aligned block through the empty file ``fd`` (``O_DIRECT`` on), then cut it back to empty: a file
    system that reports an alignment yet refuses direct writes is found here, not mid-file (the flag turned off)."""
    block = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        works = os.pwrite(fd, memoryview(block)[:align], 0) == align
    except OSError as exc:
        log.info("direct writes refused (%s): writing through the page cache", exc)
        works = False
    finally:
        block.close()
    os.ftruncate(fd, 0)
    if not works:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return works


class BufferedOutput:
    """A buffered file whose writeback starts while it is written (:class:`~.durable.Writeback`)."""

    def __init__(self, fh: Any, path: str) -> None:
        self.fh, self.name = fh, path
        self._writeback = Writeback(fh)

    def write(self, data: Any) -> int:
        n = self.fh.write(data)
        self._writeback.advance()
        return n

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        return self.fh.seek(pos, whence)

    def flush(self) -> None:
        self.fh.flush()

    def fileno(self) -> int:
        return self.fh.fileno()

    @property
    def closed(self) -> bool:
        return self.fh.closed

    def commit(self) -> None:
        """Everything written is on disk (fsync)."""
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> BufferedOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectFile:
    """A file written with ``O_DIRECT`` through aligned staging buffers: appends are copied into one while a thread
    of its own writes the full ones, each at its aligned file offset (the device kept busy while the next fills);
    :meth:`flush` writes the partial last block padded and cuts the file to its size. A write behind the end (after
    :meth:`seek`) patches the staging buffer, or — once its bytes are on their way — the aligned blocks on disk that
    hold them, read, changed and written back once the writes before them are done."""

    def __init__(self, fd: int, path: str, align: int, stage_bytes: int | None = None, stages: int = STAGES) -> None:
        self.name = path
        self._fd: int | None = fd
        self._align = align
        stage_bytes = STAGE_BYTES if stage_bytes is None else stage_bytes
        size = max(stage_bytes - stage_bytes % align, align)
        self._device = _Writer(fd, [mmap.mmap(-1, size) for _ in range(stages)])
        self._stage = self._device.take()
        self._base = 0  # the file offset of the staging buffer's first byte (a multiple of align)
        self._fill = 0  # bytes in the staging buffer
        self._pos = 0  # where the next write goes
        self._patches: list[tuple[int, bytes]] = []  # (offset, bytes) behind the staging buffer, applied by flush()

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        assert self._fd is not None, "the file is closed"
        return self._fd

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        end = self._base + self._fill
        pos = pos + (self._pos if whence == os.SEEK_CUR else end if whence == os.SEEK_END else 0)
        if not 0 <= pos <= end:
            raise ValueError(f"{self.name}: a direct file is written front to back (seek to {pos}, end {end})")
        self._pos = pos
        return pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        end = self._base + self._fill
        if self._pos < end:  # a patch behind the end (it may run past it)
            inside = min(n, end - self._pos)
            self._patch(self._pos, view[:inside])
            self._pos += inside
            view = view[inside:]
        size = len(self._stage)
        while view.nbytes:
            take = min(view.nbytes, size - self._fill)
            self._stage[self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == size:
                self._device.submit(self._stage, size, self._base)
                self._stage = self._device.take()
                self._base += size
                self._fill = 0
        self._pos = self._base + self._fill
        return n

    def _patch(self, at: int, data: memoryview) -> None:
        """Bytes behind the end: into the staging buffer, or kept for :meth:`flush` (their blocks are on their way)."""
        lo, hi = at, at + data.nbytes
        if hi > self._base:  # (the part in the staging buffer)
            s = max(lo, self._base)
            self._stage[s - self._base:hi - self._base] = data[s - lo:]
            hi = s
        if lo < hi:
            self._patches.append((lo, bytes(data[:hi - lo])))

    def _apply_patches(self) -> None:
        """The patches of bytes already written: each block that holds one read, changed and written back."""
        assert self._fd is not None
        for lo, data in self._patches:
            hi = lo + len(data)
            start, stop = aligned_span(lo, len(data), self._align)
            block = mmap.mmap(-1, stop - start)
            try:
                if os.preadv(self._fd, [block], start) != stop - start:
                    raise OSError(errno.EIO, f"{self.name}: short read of blocks written before")
                block[lo - start:hi - start] = data
                _pwrite_all(self._fd, memoryview(block), start)
            finally:
                block.close()
        self._patches.clear()

    def flush(self) -> None:
        """Everything written reaches the file: the writes in flight done, the patches behind them applied, the
        partial last block written padded, the file cut to its size."""
        if self._fd is None:
            return
        self._device.drain()
        self._apply_patches()
        padded = -(-self._fill // self._align) * self._align
        if padded:
            self._stage[self._fill:padded] = bytes(padded - self._fill)
            _pwrite_all(self._fd, memoryview(self._stage)[:padded], self._base)
            os.ftruncate(self._fd, self._base + self._fill)

    def commit(self) -> None:
        """Everything written is on disk (fsync: the file's size and blocks, and the device's write cache)."""
        self.flush()
        os.fsync(self.fileno())

    def close(self) -> None:
        """Flush and close, as a buffered file does, without making durable (:meth:`commit` first for that); the
        writing thread stopped whatever happens."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            self._close_fd()

    def _close_fd(self) -> None:
        assert self._fd is not None
        try:
            self._device.close()
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


class _Writer:
    """The writes of a direct file, in order, on a thread of their own: a full staging buffer is handed over and comes
    back (for the next bytes) once written. A failure is raised in the caller at its next call."""

    def __init__(self, fd: int, buffers: list[mmap.mmap]) -> None:
        self._fd = fd
        self._buffers = buffers
        self._todo: queue.SimpleQueue[tuple[mmap.mmap, int, int] | None] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for b in buffers:
            self._free.put(b)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="preflight-direct-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            buf, nbytes, offset = item
            if self._error is None:
                try:
                    _pwrite_all(self._fd, memoryview(buf)[:nbytes], offset)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller
                    self._error = exc.with_traceback(None)  # (its frames would hold views of the buffer)
            self._free.put(buf)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, buf: mmap.mmap, nbytes: int, offset: int) -> None:
        self._check()
        self._todo.put((buf, nbytes, offset))

    def take(self) -> mmap.mmap:
        """A free staging buffer (waits for one to be written)."""
        while True:
            try:
                buf = self._free.get(timeout=_POLL)
                break
            except queue.Empty:
                self._check()
        self._check()
        return buf

    def drain(self) -> None:
        """Wait until everything handed over is written (raises its failure, if any)."""
        held = [self.take() for _ in range(len(self._buffers) - 1)]  # (the caller holds one)
        for b in held:
            self._free.put(b)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()
        for b in self._buffers:
            try:
                b.close()
            except BufferError:  # a view still held (a caller's traceback): unmapped when it goes
                pass



def drop_read_back(path: str) -> None:
    """``path``, a file just written and being read back (``--verify``), needs none of its cached pages again
    (``POSIX_FADV_DONTNEED``, best effort): the page cache keeps recycling the same few pages rather than taking fresh
    ones, which the kernel must zero and, in a VM, the host may have to fault in."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
