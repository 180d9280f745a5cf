"""Is a checkpoint still what was saved? Its content against the fingerprints stored beside it (written by the job at
save, ``--preflight-fingerprint-on-save``, or by ``megatron-preflight fingerprint``): what ``inspect
--verify-content`` and ``reshard --verify`` run before anything is written.

Every global tensor is read once and hashed (prove/fingerprint.py); each one that differs is located: the stored
file keeps a digest per saved slice of a split tensor, so the slice that differs names its shard; a replicated
tensor's copies are hashed one by one, so a copy that disagrees names its shard. The likely cause is said from the
pattern: many tensors of one shard (a shard spliced in from another run), one tensor (bit rot where no CRC guards
the bytes, or an edit), a record whose CRC-32 fails (bit rot in a legacy file), every tensor (the fingerprints of
another run), other names or shapes (the fingerprints of another model).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import CorruptFileError, PreflightError
from megatron_preflight.prove import common_state, fingerprint
from megatron_preflight.prove.global_view import global_resharder
from megatron_preflight.prove.stored import path_for
from megatron_preflight.reshard.checkpoint_index import open_index
from megatron_preflight.reshard.plan.drift import drift_cause, key_of
from megatron_preflight.reshard.plan.types import CopyOp, TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.targets import assets

log = logging.getLogger(__name__)

_SHOWN = 20  # findings listed one by one; the rest counted


@dataclass
class Finding:
    """One tensor whose content is not what its fingerprint says (or that one side lacks)."""

    tensor: str
    problem: str
    shards: tuple[str, ...] = ()  # the shards holding the slice that differs (all holders when it cannot be told)
    located: bool = False  # the shards are the differing slice's own (not every holder of the tensor)

    def render(self) -> str:
        where = ""
        if self.shards:
            where = (f" (in {', '.join(self.shards)})" if self.located else
                     f" (held by {', '.join(self.shards)}; which slice differs cannot be told from the stored file)")
        return f"{self.tensor}: {self.problem}{where}"


@dataclass
class ContentReport:
    """The outcome of :func:`check_content`."""

    root: str
    iteration: Any
    fingerprints: str | None  # the stored file compared with (None: there is none)
    checked: int = 0
    findings: list[Finding] = field(default_factory=list)
    cause: str = ""
    seconds: float = 0.0
    integrity: str = ""  # Megatron's integrity.json checked: what it found ("" when the dir has none)

    @property
    def ok(self) -> bool:
        return not self.findings

    def render(self) -> str:
        lines = self._render()
        return f"integrity   {self.integrity}\n{lines}" if self.integrity else lines

    def _render(self) -> str:
        if self.fingerprints is None and self.findings:
            return "CONTENT     " + "; ".join(f.render() for f in self.findings[:_SHOWN])
        if self.fingerprints is None:
            return (f"content     not verified: no fingerprints stored for iteration {self.iteration} (a job run with "
                    f"--preflight stores them at save; `megatron-preflight fingerprint {self.root} --iteration "
                    f"{self.iteration}` stores them now)")
        if self.ok:
            return (f"content     OK: all {self.checked} tensors equal the fingerprints in {self.fingerprints} "
                    f"({self.seconds:.2f} s)")
        lines = [f"CONTENT     {len(self.findings)} of {self.checked} tensors differ from the fingerprints in "
                 f"{self.fingerprints}: {self.cause}"]
        lines += [f"  {f.render()}" for f in self.findings[:_SHOWN]]
        if len(self.findings) > _SHOWN:
            lines.append(f"  ... and {len(self.findings) - _SHOWN} more")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"fingerprints": self.fingerprints, "checked": self.checked, "ok": self.ok, "cause": self.cause,
                "integrity": self.integrity,
                "findings": [{"tensor": f.tensor, "problem": f.problem, "shards": list(f.shards),
                              "located": f.located} for f in self.findings]}

    def error(self) -> PreflightError:
        """The report as the one error a command stops with."""
        first = "; ".join(f.render() for f in self.findings[:3])
        more = f"; and {len(self.findings) - 3} more" if len(self.findings) > 3 else ""
        return PreflightError(f"the checkpoint's content is not what its fingerprints say ({self.cause}): {first}{more}",
                              path=self.root, code="content",
                              fix="restore the named shard files from a good copy of the checkpoint (or the whole "
                                  "checkpoint); `megatron-preflight inspect --verify-content` lists every finding; "
                                  "nothing was written")


def check_content(root: str, *, iteration: Any = None, trust: bool = False, part: tuple[int, int] = (0, 1),
                  names: set[str] | None = None) -> ContentReport:
    """Compare the checkpoint at ``root`` with its stored fingerprints (``part`` = (k, n): only every n-th tensor
    from the k-th, so n processes share the reading; ``names``: only these tensors). Raises
    :class:`PreflightError` for a fingerprint file that cannot be used; findings are in the report."""
    started = time.perf_counter()
    index = open_index(root, iteration=iteration, trust_checkpoint=trust)
    layout = index.layout
    base = layout.root or root
    stored = fingerprint.load(base, layout.iteration) if layout.iteration is not None else None
    report = ContentReport(base, layout.iteration, None)
    manifest = assets.integrity_problems(layout.iter_dir) if layout.iter_dir else None
    if manifest is not None:  # Megatron's own SHA-256 manifest (--verify-integrity), whatever the fingerprints
        report.integrity = ("OK: every file matches its SHA-256 in integrity.json" if not manifest else
                            f"{len(manifest)} file(s) differ from integrity.json")
        report.findings += [Finding(p.split(":", 1)[0], p.split(": ", 1)[1]) for p in manifest]
    if stored is None:  # (nothing to hash: torch never loaded, as in the legacy reshard this may precede)
        return report
    if not dtypes.torch_loaded():
        import torch  # noqa: F401 - deferred: loaded before indexing, so the sources make tensors (TE extra state, dtypes)

        index = open_index(root, iteration=iteration, trust_checkpoint=trust)  # (again: its values as tensors)
    report.fingerprints = path_for(base, layout.iteration)
    index.require_readable()
    want: dict[str, Any] = stored["tensors"]
    with_optimizer = any("#" in k for k in want)
    g = global_resharder(index, with_optimizer, None)
    mine = {n for i, n in enumerate(sorted(want)) if i % part[1] == part[0] and (names is None or n in names)}
    seen: set[str] = set()
    files = SourceFiles(g.layout.iter_dir or "", trust=trust, crc=True)
    try:
        for name, finding in _compare(g, files, want, stored.get("boxes", {}), mine, names is not None):
            seen.add(name)
            report.checked += 1
            if finding is not None:
                report.findings.append(finding)
    finally:
        files.close()
    report.findings += [Finding(name, "in the fingerprints but not in the checkpoint") for name in sorted(mine - seen)]
    if part[0] == 0 and names is None and isinstance(stored.get("common"), dict) and g.writes_optimizer:
        report.findings += _common_findings(stored["common"], common_state.document(index, g.choice.plain))
    report.cause = _cause(report.findings, report.checked, _held(g))
    report.seconds = time.perf_counter() - started
    return report


def _compare(g: Any, files: SourceFiles, want: dict[str, Any], stored_boxes: dict[str, Any], mine: set[str],
             only: bool) -> Iterator[tuple[str, Finding | None]]:
    """(name, finding or None) for each of the checkpoint's tensors among ``mine`` and (unless ``only``) each it has
    that the fingerprints do not."""
    for name, tp in fingerprint.planned(g).items():
        entry = want.get(name)
        if name not in mine and (entry is not None or only):
            continue  # another process's share (or a tensor not asked about)
        try:
            p = fingerprint.fingerprint_of(g, name, tp, files)
        except CorruptFileError as exc:  # a record's CRC-32 failed (legacy file): bit rot in the bytes of this tensor
            yield name, Finding(name, f"a record of its file fails its CRC-32 ({exc.message.split(' (')[0]})",
                                (exc.path or "",), True)
            continue
        if p is None:
            continue
        if entry is None:
            yield name, Finding(name, "in the checkpoint but not in its fingerprints (fingerprints of another model, "
                                      "or of a checkpoint without this state?)")
        elif (entry["shape"], entry["dtype"]) != (p.entry["shape"], p.entry["dtype"]):
            yield name, Finding(name, f"{p.entry['dtype']} {p.entry['shape']} here, {entry['dtype']} "
                                      f"{entry['shape']} in the fingerprints")
        elif entry["digest"] != p.entry["digest"]:
            yield name, _locate(p, stored_boxes.get(name), entry["digest"], files)
        elif drift_cause(key_of(tp), g.layout.saved_args) is not None:
            yield name, None  # its copies may differ by Megatron's design: the saved value is TP rank 0's (drift.py)
        else:  # the copies read equal the saved value: every other copy of a replicated slice must too
            odd = _odd_copies(p, _ops(p), _slices(p, entry["digest"]), files)
            yield name, Finding(name, "its copy is not the saved value (the other copies are)", tuple(sorted(odd)),
                                True) if odd else None


def _common_findings(stored: dict[str, Any], now: dict[str, Any]) -> list[Finding]:
    """The common state a resume reads (the LR scheduler, the param groups' settings) against its fingerprints."""
    out = []
    for key, what in (("opt_param_scheduler", "the LR scheduler's state"),
                      ("param_groups", "the param groups' settings (lr, weight decay, betas, eps, multipliers)")):
        if key in stored and stored[key] != now.get(key):
            out.append(Finding(key, f"{what} differs from its fingerprints: saved {stored[key]!r}, now "
                                    f"{now.get(key)!r}"))
    return out


def _locate(p: fingerprint.Printed, stored: list[list[Any]] | None, digest: str, files: SourceFiles) -> Finding:
    """A differing tensor: the shard of the slice that differs, when the stored slices or the copies tell it."""
    then = {tuple(o): d for o, d, _ in stored or []}
    if then and p.boxes:
        now = {o: (f"{d:016x}", op) for o, d, _, op in p.boxes}
        if set(then) == set(now):
            bad = [op for o, (d, op) in now.items() if then[o] != d]
            where: set[str] = set()
            for op in bad:  # a replicated slice: its copy that is not the saved one
                where |= _odd_copies(p, [op], then, files) or {_where(op.shard, op.ref)}
            return Finding(p.name, f"{len(bad)} of its {len(now)} saved slices differ", tuple(sorted(where)), True)
    ops = _ops(p)
    if len(ops) == 1 and ops[0].dst is None:
        then = {(0,) * len(p.entry["shape"]): digest}  # one slice: the whole tensor
    odd = _odd_copies(p, ops, then, files)
    if odd:
        return Finding(p.name, "its copies on several shards disagree: the named one is not the saved value",
                       tuple(sorted(odd)), True)
    holders = sorted({_where(op.shard, op.ref) for op in ops} | {_where(s, r) for op in ops for s, r in op.replicas})
    return Finding(p.name, "its values differ from its fingerprint", tuple(holders), len(holders) == 1)


def _ops(p: fingerprint.Printed) -> list[CopyOp]:
    """The copies that read the tensor, one per slice."""
    return [op for _, _, _, op in p.boxes] or (list(p.plan.ops) if isinstance(p.plan, TensorPlan) else [])


def _slices(p: fingerprint.Printed, digest: str) -> dict[tuple[int, ...], str]:
    """Each read slice's digest, by its offsets (a tensor read whole: its digest)."""
    if p.boxes:
        return {o: f"{d:016x}" for o, d, _, _ in p.boxes}
    return {(0,) * len(p.entry["shape"]): digest}


def _odd_copies(p: fingerprint.Printed, ops: list[CopyOp], expected: dict[tuple[int, ...], str],
                files: SourceFiles) -> set[str]:
    """The shards whose copy of a replicated slice is not the saved one: unlike the slice's stored digest when
    ``expected`` has it, else unlike the majority of the copies."""
    import torch  # noqa: F401 - deferred: copies are read as tensors

    odd: set[str] = set()
    shape = tuple(p.entry["shape"])
    for op in ops:
        if not op.replicas:
            continue
        offsets, dim, length = (0,) * len(shape), None, None
        if op.dst is not None:
            dim, start, length = op.dst
            length = min(length, shape[0] - start) if dim == 0 else length
            offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        digests = {}
        for shard, ref in ((op.shard, op.ref), *op.replicas):
            t = files.tensor(shard, ref)
            t = t.narrow(*op.src) if op.src is not None else t
            t = t.narrow(dim, 0, length) if dim is not None else t
            digests[_where(shard, ref)] = f"{fingerprint.digest_box(t.to(dtypes.to_torch(p.plan.dtype)), shape, offsets):016x}"
        want = expected.get(offsets)
        if want is None:
            want, n = Counter(digests.values()).most_common(1)[0]
            if n == 1:
                want = None  # no majority: every copy is suspect
        odd |= {w for w, d in digests.items() if want is None or d != want}
    return odd


def _where(shard: str, ref: Any) -> str:
    """A slice's place for a person: its file, from the iteration dir (the shard when the file is not known)."""
    file = getattr(ref, "file", "") or ""
    if not file:
        return shard
    parts = os.path.normpath(file).split(os.sep)
    return os.path.join(*parts[-2:]) if len(parts) >= 2 else file


def _held(g: Any) -> Counter:
    """How many of the checkpoint's tensors each shard file holds a slice or a copy of (metadata only)."""
    held: Counter = Counter()
    for tp in fingerprint.planned(g).values():
        if isinstance(tp, TensorPlan):
            held.update({_where(s, r) for op in tp.ops for s, r in ((op.shard, op.ref), *op.replicas)})
    return held


def _cause(findings: list[Finding], checked: int, held: Counter) -> str:
    """The likely cause of the findings, from their pattern."""
    if not findings:
        return ""
    if any(f.problem.startswith("a record") for f in findings):
        return "bit rot or a damaged copy: a file's bytes no longer match the CRC-32 saved with them"
    if any("not in" in f.problem or " here, " in f.problem for f in findings):
        return "the fingerprints are of another model, or of another form of this checkpoint"
    differing = [f for f in findings if f.problem]
    located = Counter(s for f in differing if f.located for s in f.shards)
    if checked > 4 and len(differing) >= 0.9 * checked and len(located) != 1:
        return "every tensor differs: the fingerprints are of another run (or the checkpoint was replaced)"
    if len(differing) > 1 and len(located) == 1:
        (shard, _), = located.items()
        n = sum(1 for f in differing if shard in f.shards)  # located there, or held there among others
        if n == len(differing) and n >= held.get(shard, 0) / 2:
            return (f"{n} of the {held.get(shard, n)} tensors of {shard} differ, and nothing else: that file was "
                    "likely spliced in from another run (or restored from another copy)")
        return (f"{n} tensors of {shard} changed after the save, and nothing else: an edit of that file (a script or "
                "converter that rewrote it), or bit rot where no CRC guards the bytes")
    if len(differing) == 1:
        return ("one tensor changed after the save: bit rot where no CRC guards the bytes (torch_dist), or an edit "
                "(a script or converter that rewrote it)")
    return "several tensors changed after the save: a bad copy, bit rot, or an edit"
