"""The write-behind thread: runs in order, hands a failure to the caller, stops without running the rest, and leaves
no thread behind."""

from __future__ import annotations

import threading

import pytest

from megatron_preflight.reshard.targets.write_behind import WriteBehind


def test_runs_in_order_off_the_callers_thread():
    seen: list[tuple[int, str]] = []
    with WriteBehind(depth=2) as behind:
        for i in range(50):
            behind.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"preflight-write-behind"}
    assert not any(t.name == "preflight-write-behind" for t in threading.enumerate())


def test_a_failure_reaches_the_caller_and_stops_the_rest():
    seen: list[int] = []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with WriteBehind(depth=1) as behind:
            behind.submit(seen.append, 1)
            behind.submit(fail)
            for i in range(2, 100):
                behind.submit(seen.append, i)
    assert seen[0] == 1 and len(seen) < 99  # raised at a later submit or at the drain, the rest not run
    assert not any(t.name == "preflight-write-behind" for t in threading.enumerate())


def test_a_failure_in_the_caller_drops_what_is_queued():
    seen: list[int] = []
    gate = threading.Event()
    opener = threading.Timer(0.3, gate.set)  # the thread is busy with the first item until after the failure
    with pytest.raises(RuntimeError, match="build failed"):
        with WriteBehind(depth=4) as behind:
            behind.submit(gate.wait)
            for i in range(3):
                behind.submit(seen.append, i)
            opener.start()
            raise RuntimeError("build failed")
    opener.join()
    assert seen == []
    assert not any(t.name == "preflight-write-behind" for t in threading.enumerate())
