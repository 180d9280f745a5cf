"""The CLI run in this process, as a user runs it (test-only): a fresh interpreter per call would cost torch's import."""

from __future__ import annotations

import contextlib
import io


def run(*args: str) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``megatron-preflight ARGS``."""
    from megatron_preflight.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue() + err.getvalue()
