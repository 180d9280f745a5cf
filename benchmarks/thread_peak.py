"""Peak threads per process while a command runs (Linux /proc), as a table: the suite's thread budget (256 per
process) measured, e.g. ``python benchmarks/thread_peak.py ./scripts/test.sh``.

Every process started under the command is sampled every 0.3 s; the table lists the processes with the most threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    proc = subprocess.Popen(argv)
    peak: dict[int, tuple[int, str]] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            try:
                n = len(os.listdir(f"/proc/{pid}/task"))
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:90]
            except OSError:
                continue
            if n > peak.get(pid, (0, ""))[0]:
                peak[pid] = (n, cmd)
        time.sleep(0.3)
    print(f"{'threads':>7}  {'pid':>7}  command")
    for pid, (n, cmd) in sorted(peak.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"{n:>7}  {pid:>7}  {cmd}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
