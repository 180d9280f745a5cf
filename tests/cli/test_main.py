"""The CLI entry point's exits."""

import subprocess
import sys

from tests.conftest import fixture_path


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`megatron-preflight inspect ... | head -0`: stdout closed before anything is written. The command ends as a Unix
    tool killed by SIGPIPE (141), with no error message about the pipe and no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "megatron_preflight", "inspect", fixture_path("moe_ep2_torch")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first write
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err
