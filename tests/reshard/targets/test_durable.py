"""Durable writes: the writeback a writer starts while it still writes (sync_file_range), and what it leaves to the
final fsync."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_preflight import libc
from megatron_preflight.reshard.targets import durable
from megatron_preflight.reshard.targets.durable import Writeback


def test_writeback_hands_each_whole_window_to_the_disk_and_waits_for_the_oldest(tmp_path, monkeypatch):
    """Each whole window written is started once, in order; past ``lag`` windows in flight the writer waits for the
    oldest; a partial window is left to the fsync; the bytes are the bytes written."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(durable.libc, "sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)) or True)
    path = tmp_path / "f"
    with open(path, "wb") as fh:
        wb = Writeback(fh, window=1000, lag=2)
        for i in range(9):
            fh.write(bytes([i]) * 700)
            wb.advance()
    assert path.read_bytes() == b"".join(bytes([i]) * 700 for i in range(9))
    started = [(off, n) for off, n, flags in calls if flags == libc.SYNC_FILE_RANGE_WRITE]
    waited = [off for off, n, flags in calls if flags != libc.SYNC_FILE_RANGE_WRITE]
    assert started == [(k * 1000, 1000) for k in range(6)]  # 6,300 bytes: six whole windows
    assert waited == [0, 1000, 2000, 3000]  # each time more than two windows were in flight
    assert all(flags == (libc.SYNC_FILE_RANGE_WAIT_BEFORE | libc.SYNC_FILE_RANGE_WRITE |
                         libc.SYNC_FILE_RANGE_WAIT_AFTER) for _, _, flags in calls if flags != libc.SYNC_FILE_RANGE_WRITE)


def test_writeback_stops_asking_where_the_call_fails(tmp_path, monkeypatch):
    """A file system (or platform) without sync_file_range: asked once, then left to the fsync."""
    calls = []
    monkeypatch.setattr(durable.libc, "sync_file_range", lambda *a: calls.append(a) and False)
    with open(tmp_path / "f", "wb") as fh:
        wb = Writeback(fh, window=10)
        for _ in range(5):
            fh.write(b"x" * 25)
            wb.advance()
    assert len(calls) == 1 and not wb.works


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_sync_file_range_is_reached_on_linux(tmp_path):
    """The real call (no stand-in): a written range is handed to the disk and waited for."""
    with open(tmp_path / "f", "wb") as fh:
        fh.write(b"y" * 8192)
        fh.flush()
        assert libc.sync_file_range(fh.fileno(), 0, 8192, libc.SYNC_FILE_RANGE_WRITE) is True
        assert libc.sync_file_range(fh.fileno(), 0, 8192, 7) is True
        assert libc.sync_file_range(fh.fileno(), 0, 0, 2) is False  # nothing asked for an empty range
    assert os.path.getsize(tmp_path / "f") == 8192
