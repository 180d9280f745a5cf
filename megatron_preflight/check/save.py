"""The first save, decided at job start: Megatron writes its first checkpoint hours in, and an unwritable ``--save``
or a filesystem without room for it fails then (losing the work since the last good checkpoint).

The size of the next checkpoint is estimated as the size of the one being loaded (the same model and the same
state: bytes on disk of its iteration dir, metadata only; an over-estimate with ``--no-save-optim``). Free space is asked of the filesystem once, in :func:`free_bytes` (one place, so a
test can stand in for a small filesystem).
"""

from __future__ import annotations

import os
import shutil

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Layout
from megatron_preflight.units import human_bytes

FATAL, INFO = Severity.FATAL, Severity.INFO


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


def checkpoint_bytes(layout: Layout) -> int:
    """Bytes on disk of the checkpoint's iteration dir (file sizes only)."""
    total = 0
    for root, _dirs, files in os.walk(layout.iter_dir or ""):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def _existing(path: str) -> str:
    """The nearest existing directory at or above ``path`` (where Megatron's makedirs starts)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def save_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """``--save`` is (or can be made) a writable directory with room for one more checkpoint."""
    if not rt.save:
        return []
    path = rt.save
    if os.path.exists(path) and not os.path.isdir(path):
        return [Finding("save", None, path, FATAL, f"--save {path} is a file, not a directory: the first save fails "
                        "(hours in)", "point --save at a directory")]
    probe = _existing(path)
    if not os.path.isdir(probe):
        return [Finding("save", None, path, FATAL, f"--save {path} cannot be created: {probe} is not a directory",
                        "point --save at a directory")]
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    if read_only or not os.access(probe, os.W_OK | os.X_OK):
        what = "is on a read-only filesystem" if read_only else "is not writable by this user"
        return [Finding("save", None, path, FATAL,
                        f"--save {path}: {probe} {what}; Megatron would fail at the first save, after training up "
                        "to --save-interval", "point --save at a writable directory (or fix its permissions)")]
    need = checkpoint_bytes(layout) if layout.iter_dir and layout.format is not None else 0
    if not need:
        return []
    free = free_bytes(probe)
    if free < need:
        return [Finding("save", human_bytes(need), f"{human_bytes(free)} free", FATAL,
                        f"--save {path}: the next checkpoint needs about {human_bytes(need)} (the size of the one loaded: "
                        f"the same model and state), and its filesystem has {human_bytes(free)} free: the first save "
                        "would fail, hours in", "free space there or point --save at a larger filesystem")]
    if free < 2 * need:
        return [Finding("save", human_bytes(need), f"{human_bytes(free)} free", INFO,
                        f"warning: --save {path} has room for one more checkpoint ({human_bytes(need)} each, "
                        f"{human_bytes(free)} free) but not two", "free space before the second save")]
    return []
