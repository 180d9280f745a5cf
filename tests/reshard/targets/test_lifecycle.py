"""A killed reshard leaves nothing behind: its workers die with it, a later run removes its partial output, and two
runs never write one destination at once."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.reshard.targets import destination
from tests.conftest import fixture_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# The real writer with 2 worker processes; each worker sleeps before writing its shard (tests.helpers.slow_shard).
CHILD = r"""
import sys
from megatron_preflight.reshard.targets import offline as writer
from megatron_preflight.reshard import TargetLayout
from tests.helpers import slow_shard
writer._write_shard = slow_shard.write_shard
writer.write_resharded(sys.argv[1], sys.argv[2], TargetLayout(tp=2, pp=2), workers=2)
"""


def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def alive(pids):
    return [p for p in pids if destination.alive(p) and not _zombie(p)]


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("after", [0.5, 3.0])
def test_kill_9_of_the_main_process_takes_every_worker_with_it(tmp_path, after):
    env = dict(os.environ, PYTHONPATH=ROOT)
    main = subprocess.Popen([sys.executable, "-c", CHILD, fixture_path("tp2_torch"), str(tmp_path / "out")], env=env,
                            start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(workers) < 2:  # the pool's workers (and the resource tracker)
            time.sleep(0.2)
            workers = children(main.pid)
        assert len(workers) >= 2, "the worker processes never started"
        time.sleep(after)
        workers = children(main.pid)
        os.kill(main.pid, signal.SIGKILL)
        main.wait()
        deadline = time.time() + 20  # (a loaded 2-core box: the lifeline thread polls every fraction of a second)
        while time.time() < deadline and alive(workers):
            time.sleep(0.1)
        assert alive(workers) == [], f"survived the main process by 20 s: {alive(workers)}"
    finally:  # whatever the outcome, nothing of this test outlives it
        for p in set(children(main.pid)) | set(workers):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    assert not (tmp_path / "out").exists()
    stale = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert stale == [f".out.tmp-{main.pid}"]  # the partial output it left ...
    s = write_resharded(fixture_path("tp2_torch"), str(tmp_path / "out"), TargetLayout(tp=2, pp=2))
    assert s.stale_removed == [str(tmp_path / f".out.tmp-{main.pid}")]  # ... is found and removed by the next run
    assert "partial output of an earlier run that died" in s.render()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".out")] == []


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_dirs_removed_or_kept_on_request(tmp_path):
    dead = dead_pid()
    for n in ("a", "b"):
        os.makedirs(tmp_path / f".{n}.tmp-{dead}" / "iter_0000002")
    os.makedirs(tmp_path / ".a.tmp-1")  # pid 1 is alive: another live run's, never touched
    s = write_resharded(fixture_path("tp2_torch"), str(tmp_path / "a"), TargetLayout(tp=1))
    assert s.stale_removed == [str(tmp_path / f".a.tmp-{dead}")] and s.stale_kept == [str(tmp_path / ".a.tmp-1")]
    assert (tmp_path / f".b.tmp-{dead}").exists()  # another destination's: not this run's business
    s = write_resharded(fixture_path("tp2_torch"), str(tmp_path / "b"), TargetLayout(tp=1), keep_stale=True)
    assert s.stale_kept == [str(tmp_path / f".b.tmp-{dead}")] and (tmp_path / f".b.tmp-{dead}").exists()
    assert "left " in s.render()


def test_two_writers_of_one_destination_fail_cleanly(tmp_path):
    dst = str(tmp_path / "out")
    held = destination.claim(dst)
    try:
        with pytest.raises(PreflightError, match=rf"another megatron-preflight reshard \(pid {os.getpid()}\)"):
            write_resharded(fixture_path("tp2_torch"), dst, TargetLayout(tp=1))
        assert not os.path.exists(dst)
    finally:
        held.release()
    write_resharded(fixture_path("tp2_torch"), dst, TargetLayout(tp=1))  # free again: the next run proceeds
    assert os.path.exists(os.path.join(dst, "latest_checkpointed_iteration.txt"))
    assert not os.path.exists(destination.lock_path(dst))


def test_destination_reached_through_a_symlink_into_the_source_is_refused(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_path("tp2_torch"), src)
    os.symlink(src, tmp_path / "link")
    with pytest.raises(PreflightError, match="inside the source"):
        write_resharded(str(src), str(tmp_path / "link" / "new"), TargetLayout(tp=1))
    assert not (src / "new").exists()


# The CLI with the slow stand-in: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM (to
# the main process, as a scheduler does) while the workers are busy.
CLI_CHILD = r"""
import signal, sys
# as a terminal's shell starts it: Ctrl-C at its default (a suite run as a background job of a non-interactive shell
# inherits SIGINT ignored, as POSIX says, and so would this child: it then never hears the Ctrl-C this test sends)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from megatron_preflight.reshard.targets import offline as writer
from megatron_preflight.cli.main import main
from tests.helpers import slow_shard
writer._write_shard = slow_shard.write_shard
sys.exit(main(["reshard", sys.argv[1], sys.argv[2], "--tp", "2", "--pp", "2", "--workers", "2", "--no-progress"]))
"""


@pytest.mark.parametrize("sig,rc,says", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_and_sigterm_end_with_one_line_and_no_output(tmp_path, sig, rc, says):
    env = dict(os.environ, PYTHONPATH=ROOT)
    main = subprocess.Popen([sys.executable, "-c", CLI_CHILD, fixture_path("tp2_torch"), str(tmp_path / "out")],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(workers) < 2:
            time.sleep(0.2)
            workers = children(main.pid)
        assert len(workers) >= 2
        time.sleep(1.0)
        if sig == signal.SIGINT:
            os.killpg(main.pid, sig)  # the terminal's Ctrl-C reaches every process of the group
        else:
            os.kill(main.pid, sig)
        out, err = main.communicate(timeout=60)
    finally:
        for p in set(workers) | set(children(main.pid)):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    assert main.returncode == rc, err
    assert says in err and "Traceback" not in err and err.strip().count("\n") == 0, err
    assert [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp")] == [] and not (tmp_path / "out").exists()
    deadline = time.time() + 5
    while time.time() < deadline and alive(workers):
        time.sleep(0.1)
    assert alive(workers) == []
