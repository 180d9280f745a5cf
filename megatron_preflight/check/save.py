"""The first save, decided at job start: Megatron writes its first checkpoint hours in, and an unwritable ``--save``
or a filesystem without room for it fails then (losing the work since the last good checkpoint).

The size of the next checkpoint is estimated as the size of the one being loaded (the same model and the same
state: bytes on disk of its iteration dir, metadata only; an over-estimate with ``--no-save-optim``). Free space is asked of the filesystem once, in :func:`free_bytes` (one place, so a
test can stand in for a small filesystem). Also checked: the non-persistent checkpoint dirs are writable, and the
async / non-persistent save settings are ones ``save_checkpoint`` accepts (it raises NotImplementedError otherwise,
at the first save).
"""

from __future__ import annotations

import os

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Layout
from megatron_preflight.units import human_bytes

FATAL, INFO = Severity.FATAL, Severity.INFO


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem holding ``path`` (``shutil.disk_usage``'s ``free``, without importing
    shutil and its compression modules on a verdict's path)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


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


def nearest_existing(path: str) -> str:
    """The nearest existing directory at or above ``path`` (where Megatron's makedirs starts)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def _writable(flag: str, path: str) -> Finding | None:
    """``path`` is (or can be made) a directory this user can write."""
    if os.path.exists(path) and not os.path.isdir(path):
        return Finding("save", None, path, FATAL, f"{flag} {path} is a file, not a directory: the first save fails "
                       "(hours in)", f"point {flag} at a directory")
    probe = nearest_existing(path)
    if not os.path.isdir(probe):
        return Finding("save", None, path, FATAL, f"{flag} {path} cannot be created: {probe} is not a directory",
                       f"point {flag} at a directory")
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    if read_only or not os.access(probe, os.W_OK | os.X_OK):
        what = "is on a read-only filesystem" if read_only else "is not writable by this user"
        return Finding("save", None, path, FATAL,
                       f"{flag} {path}: {probe} {what}; Megatron would fail at the first save, after training up "
                       "to the save interval", f"point {flag} at a writable directory (or fix its permissions)")
    return None


def _settings(rt: RuntimeArgs) -> list[Finding]:
    """The async and non-persistent save settings, which Megatron checks only inside save_checkpoint."""
    out = []
    if rt.async_save and rt.ckpt_format not in ("torch_dist", "torch_dcp", "fsdp_dtensor"):
        legacy = rt.ckpt_format == "torch"
        out.append(Finding("async_save", None, rt.ckpt_format, FATAL,
                           f"--async-save with --ckpt-format {rt.ckpt_format}: Megatron raises NotImplementedError "
                           + ("('Async checkpoint save not implemented for legacy checkpoints')" if legacy else
                              f"('Async checkpoint save not implemented for {rt.ckpt_format} distributed checkpoint "
                              "format')") + " at the first save, hours in",
                           "drop --async-save, or save with --ckpt-format torch_dist"))
    elif rt.async_save and not rt.use_persistent_ckpt_worker and "use_persistent_ckpt_worker" in rt.given:
        out.append(Finding("async_save", True, False, INFO,
                           "--async-save without --use-persistent-ckpt-worker: Megatron turns async saving off "
                           "(a warning on rank 0); every save blocks training", "add --use-persistent-ckpt-worker"))
    if rt.non_persistent_save_interval and not rt.non_persistent_ckpt_type:
        out.append(Finding("non_persistent_ckpt_type", None, None, FATAL,
                           f"--non-persistent-save-interval {rt.non_persistent_save_interval} without "
                           "--non-persistent-ckpt-type: Megatron raises NotImplementedError ('Please use local or "
                           "global non-persistent checkpoints (got: None)') at the first non-persistent save",
                           "add --non-persistent-ckpt-type global (or local with --non-persistent-local-ckpt-dir)"))
    return out


def save_dirs(rt: RuntimeArgs) -> list[tuple[str, str]]:
    """(flag, directory) for every place the run will write checkpoints."""
    if not rt.save:
        return []
    out = [("--save", rt.save)]
    if rt.non_persistent_save_interval and rt.non_persistent_ckpt_type == "global":
        out.append(("--non-persistent-global-ckpt-dir", rt.non_persistent_global_ckpt_dir
                    or os.path.join(rt.save, "non_persistent")))
    if rt.non_persistent_save_interval and rt.non_persistent_ckpt_type == "local" and rt.non_persistent_local_ckpt_dir:
        out.append(("--non-persistent-local-ckpt-dir", rt.non_persistent_local_ckpt_dir))
    return out


def save_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """``--save`` (and the non-persistent checkpoint dirs) writable, with room for one more checkpoint; the async and
    non-persistent settings consistent."""
    if not rt.save:
        return []
    out = _settings(rt)
    unwritable = [f for flag, path in save_dirs(rt) if (f := _writable(flag, path)) is not None]
    if unwritable:
        return out + unwritable
    path = rt.save
    probe = nearest_existing(path)
    need = checkpoint_bytes(layout) if layout.iter_dir and layout.format is not None else 0
    if not need:
        return out
    free = free_bytes(probe)
    if free < need:
        return out + [Finding("save", human_bytes(need), f"{human_bytes(free)} free", FATAL,
                      f"--save {path}: the next checkpoint needs about {human_bytes(need)} (the size of the one "
                      f"loaded: the same model and state), and its filesystem has {human_bytes(free)} free: the "
                      "first save would fail, hours in", "free space there or point --save at a larger filesystem")]
    if free < 2 * need:
        return out + [Finding("save", human_bytes(need), f"{human_bytes(free)} free", INFO,
                      f"warning: --save {path} has room for one more checkpoint ({human_bytes(need)} each, "
                      f"{human_bytes(free)} free) but not two", "free space before the second save")]
    return out
