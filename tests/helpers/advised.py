"""Following the tool's advice word for word: the offline reshard commands a ``check`` prints, run as printed with
only the ``NEW_DIR`` placeholder substituted."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from megatron_preflight.check import advice

COMMAND = re.compile(r"megatron-preflight reshard .*?(?=, then )")


def commands_in(fixes: list[str]) -> list[str]:
    """Every offline reshard command named in ``fixes``, each once, in order."""
    found: list[str] = []
    for fix in fixes:
        for cmd in COMMAND.findall(fix):
            if cmd not in found:
                found.append(cmd)
    return found


def advised(src: str, flags: list[str], *options: str) -> tuple[str, list[str]]:
    """(the verdict, the reshard commands) of ``megatron-preflight check SRC --json [options] -- <flags>``, run as a
    user runs it (its own process, WORLD_SIZE unset)."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "check", src, "--json", *options, "--", *flags],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode in (0, 1), done.stderr
    plan = json.loads(done.stdout)
    return plan["verdict"], commands_in([f["fix"] for f in plan["findings"]])


def follow(cmd: str, new_dir: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` through a shell exactly as printed, ``NEW_DIR`` replaced by ``new_dir`` (this Python's console
    script standing for ``megatron-preflight``)."""
    exe = os.path.join(os.path.dirname(sys.executable), "megatron-preflight")
    assert cmd.startswith("megatron-preflight ")
    line = shlex.quote(exe) + cmd[len("megatron-preflight"):]
    line = line.replace(f" {advice.PLACEHOLDER} ", f" {shlex.quote(new_dir)} ", 1)
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=600)


def follow_advice(src: str, run_flags: list[str], new_dir: str, *options: str,
                  verdict: str = "reshard") -> subprocess.CompletedProcess:
    """The whole literal path: ``check`` of the run says ``verdict`` (reshard; or fail, where only the offline
    conversion serves the run) with one command, that command run as printed writes ``new_dir``, and ``check`` of
    ``new_dir`` with the same run flags says load. Returns the command's run."""
    said, commands = advised(src, run_flags, *options)
    assert said == verdict and len(commands) == 1, (said, commands)
    done = follow(commands[0], new_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert advised(new_dir, run_flags, *options) == ("load", [])
    return done
