"""A written shard read back for ``--verify``, from the device.

A shard written direct (:mod:`.output_file`) is not in the page cache; read back through a mapping it would come
from the device a readahead window at a time, into fresh page-cache pages, which the kernel must make (and, in a VM,
the host may have to fault in) — slower than writing it was. Where the file system takes direct I/O, each tensor's
storage record is read with ``O_DIRECT`` into one reused, aligned buffer instead: no page-cache page is made, and what
is compared is what the device holds. Its CRC-32 is checked against the zip directory as it is read. Elsewhere the
file's own mapped reads serve (:class:`~megatron_preflight.torch_file.TorchFile`).
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from megatron_preflight.crc import crc32
from megatron_preflight.errors import CorruptFileError
from megatron_preflight.reshard.targets.output_file import aligned_span, enable_direct
from megatron_preflight.torch_file import TensorRef, TorchFile, strided_array


class ReadBack:
    """``array`` / ``tensor`` of a written :class:`TorchFile` (``out``), as a kit's ``written`` asks them: arrays read
    direct where the file system allows, tensors from ``out``. Given the ``order`` in which arrays will be asked, each
    next record is read (and its CRC-32 taken) on a thread of its own while the caller compares the one before: two
    buffers take turns, so an array stays valid until the next-but-one read."""

    def __init__(self, out: TorchFile, path: str, order: list[TensorRef] | None = None) -> None:
        self.out, self.path = out, path
        self._fd: int | None = None
        self._align = 0
        self._bufs: list[mmap.mmap | None] = [None, None]
        self._slot = 0  # the buffer of the array last handed out
        self._after = {id(ref): i + 1 for i, ref in enumerate(order or [])}
        self._order = list(order or [])
        self._pending: tuple[TensorRef, Future[tuple[int, int]]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        align = enable_direct(fd)
        if align is None:
            os.close(fd)
            return
        self._fd, self._align = fd, align
        # both buffers as big as the biggest record asked (made once: a buffer grown record by record would fault in
        # fresh pages again and again)
        self._size = max((self._extent(ref) for ref in self._order), default=0)
        if self._order:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight-read-back")

    @property
    def direct(self) -> bool:
        return self._fd is not None

    def tensor(self, ref: TensorRef) -> Any:
        return self.out.tensor(ref)

    def array(self, ref: TensorRef) -> Any:
        if self._fd is None or ref.numel == 0:
            return self.out.array(ref)
        slot = 1 - self._slot
        pending, self._pending = self._pending, None
        try:
            if pending is not None and pending[0] is ref:
                start, nbytes = pending[1].result()
            else:
                if pending is not None:  # (another record than the one read ahead: its buffer is needed)
                    pending[1].exception()
                start, nbytes = self._read(ref, slot)
        except _Refused:
            self.close()
            return self.out.array(ref)
        self._slot = slot
        nxt = self._after.get(id(ref))
        if self._pool is not None and nxt is not None and nxt < len(self._order):
            ahead = self._order[nxt]
            self._pending = (ahead, self._pool.submit(self._read, ahead, 1 - slot))
        return strided_array(self._bufs[slot], start, nbytes, ref)

    def _read(self, ref: TensorRef, slot: int) -> tuple[int, int]:
        """Record ``ref`` into buffer ``slot``, its CRC-32 checked: (where it starts there, its bytes)."""
        assert self._fd is not None
        offset, nbytes = self.out.record_extent(ref.storage.key)
        lo, hi = aligned_span(offset, nbytes, self._align)
        buf = self._bufs[slot]
        if buf is None or len(buf) < hi - lo:  # (a smaller one goes with the last array viewing it)
            buf = self._bufs[slot] = mmap.mmap(-1, max(hi - lo, self._size, 1 << 20))
        view = memoryview(buf)
        try:
            done, want = 0, offset + nbytes - lo
            while done < want:
                try:
                    got = os.preadv(self._fd, [view[done:hi - lo]], lo + done)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise _Refused from None
                    raise
                if got <= 0:
                    raise CorruptFileError(f"storage record data/{ref.storage.key} ends early (the file is shorter "
                                           "than its zip directory says)", path=self.path, code="corrupt_file",
                                           fix="write the shard again")
                done += got
            self.out.check_record(ref.storage.key, crc32(view[offset - lo:offset - lo + nbytes]))
        finally:
            view.release()
        return offset - lo, nbytes

    def _extent(self, ref: TensorRef) -> int:
        """The aligned bytes that hold ``ref``'s record."""
        lo, hi = aligned_span(*self.out.record_extent(ref.storage.key), self._align)
        return hi - lo

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].exception()  # (finished before its buffer and file go)
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._bufs = [None, None]  # (each goes with the last array viewing it)

    def __enter__(self) -> ReadBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Refused(Exception):
    """The file system took the O_DIRECT flag but refuses direct reads: the mapped reads serve."""
