"""Writes done in one background thread, in order, while the caller builds the next piece.

A streamed shard alternates between building a piece of a tensor (reading the source into a buffer, the CRC-32s of
what was read and of the output record) and writing it (the copy into the page cache, waits on writeback). Both
release the GIL, so a second thread that writes while the first builds overlaps them. At most ``depth`` pieces wait
(memory: ``depth`` pieces of ``stream_save.CHUNK_BYTES``). A failure in the thread is raised in the caller at its next call; a failure in the
caller stops the thread without writing what is still queued.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_POLL = 0.5  # seconds: a blocked caller wakes this often, so a Ctrl-C reaches it


class WriteBehind:
    def __init__(self, depth: int = 2) -> None:
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preflight-write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None and not self._stop.is_set():
                    fn, args = item
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
                self._error = e
            finally:
                self._queue.task_done()

    def check(self) -> None:
        """Raise the thread's failure, if it had one."""
        if self._error is not None:
            raise self._error

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after what was submitted before (``args`` must not change until it has run)."""
        self.check()
        while True:
            try:
                self._queue.put((fn, args), timeout=_POLL)
                return
            except queue.Full:
                self.check()

    def drain(self) -> None:
        """Wait until everything submitted has run; raise the thread's failure, if any."""
        done = threading.Event()
        self.submit(done.set)
        while not done.wait(_POLL):
            self.check()
            if not self._thread.is_alive():
                break
        self.check()

    def close(self) -> None:
        """Stop the thread (what is still queued is not run) and wait for it."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=_POLL)
                break
            except queue.Full:
                continue
        self._thread.join()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        try:
            if exc_type is None:
                self.drain()
        finally:
            self.close()
