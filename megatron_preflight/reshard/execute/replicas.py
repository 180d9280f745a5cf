"""Replicas must agree: the same source piece held by several shards (a layernorm on every TP rank, a dense weight on
every EP rank, the tied output layer on the last stage) is read from its main copy, and the others are compared with
it — sampled (a few elements at the start, middle and end) on every run, whole with ``--verify``. Diverged replicas
are a real failure mode; they are reported with the shards involved, never averaged or silently picked — except the
tensors Megatron itself lets drift (reshard/plan/drift.py): TP rank 0's copy, as Megatron's torch_dist save keeps it,
said with the drift measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.arrays import float_values
from megatron_preflight.reshard.plan.drift import drift_cause, key_of
from megatron_preflight.reshard.plan.types import RankPlan, planned
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.torch_file import TensorRef

if TYPE_CHECKING:
    import torch

SAMPLE = 32  # elements compared at each of three places in the sampled check


class ReplicaMismatch(PreflightError):
    """Two shards hold different values for the same piece of a tensor."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def _sample_values(t: torch.Tensor) -> torch.Tensor:
    """A few elements at the start, middle and end (the whole tensor when it is small or not contiguous)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    if not t.is_contiguous() or t.numel() <= 3 * SAMPLE:
        return t
    flat, n = t.view(-1), t.numel()
    mid = n // 2
    return torch.cat([flat[:SAMPLE], flat[mid:mid + SAMPLE], flat[n - SAMPLE:]])


@dataclass
class Drifted:
    """Replicas Megatron lets drift (reshard/plan/drift.py) that were found to differ: TP rank 0's copy is used."""

    tensors: dict[str, float] = field(default_factory=dict)  # tensor -> the largest difference measured
    causes: set[str] = field(default_factory=set)

    def add(self, key: str, diff: float, cause: str) -> None:
        self.tensors[key] = max(diff, self.tensors.get(key, 0.0))
        self.causes.add(cause)

    def render(self) -> str:
        """One info line (empty when nothing drifted)."""
        if not self.tensors:
            return ""
        worst = max(self.tensors.items(), key=lambda kv: kv[1])
        return (f"{len(self.tensors)} tensor(s) whose TP copies Megatron lets drift differ "
                f"({'; '.join(sorted(self.causes))}); up to {worst[1]:.3g} ({worst[0]}); TP rank 0's copy is used, "
                "as Megatron's torch_dist save does")


def check_replicas(plan: RankPlan, files: SourceFiles, *, full: bool = False, saved_args: Any = None,
                   drifted: Drifted | None = None) -> int:
    """Compare every replica of every source piece ``plan`` reads with its main copy (bit for bit), whole or
    sampled. Returns the number of replicas compared; raises :class:`ReplicaMismatch` on the first difference, except
    for a tensor Megatron lets drift in this checkpoint (``saved_args``: :func:`drift_cause`), whose difference is
    measured into ``drifted`` (the main copy, TP rank 0's, is the one used)."""
    seen: set[tuple] = set()
    compared = 0
    for tp in planned(plan):
        for op in tp.ops:
            for shard, ref in op.replicas:
                key = (op.shard, _ident(op.ref), shard, _ident(ref))
                if key in seen:
                    continue
                seen.add(key)
                # sampled: no CRC-32 is taken for a few elements (the main copy's is taken when its data is read; a
                # replica's bytes are not used) unless the samples differ: then a damaged record is named as damage.
                # Equal samples read as bytes (no tensor made) settle it; anything else is looked at as tensors.
                if not full and getattr(ref, "dtype", None) == getattr(op.ref, "dtype", ()):
                    sample = files.sample_bytes(op.shard, op.ref, SAMPLE)
                    if sample is not None and sample == files.sample_bytes(shard, ref, SAMPLE):
                        compared += 1
                        continue
                legacy = type(op.ref) is TensorRef and type(ref) is TensorRef  # (read as bytes: no torch)
                same, diff = (_compare_bytes if legacy else _compare_tensors)(files, op.shard, op.ref, shard, ref,
                                                                               full)
                if full:
                    files.release_pages()
                compared += 1
                if not same:
                    read = files.array if legacy else files.tensor
                    read(op.shard, op.ref)  # raises CorruptFileError on a CRC mismatch
                    read(shard, ref)
                    cause = drift_cause(key_of(tp), saved_args)
                    if cause is None:
                        raise _mismatch(tp.key, op.shard, shard, full, files.iter_dir)
                    if drifted is not None:
                        drifted.add(key_of(tp), diff, cause)
    return compared


def _compare_tensors(files: SourceFiles, main: str, main_ref: Any, shard: str, ref: Any, full: bool
                     ) -> tuple[bool, float]:
    """(whether the two pieces hold the same bits, whole or sampled; their largest difference when they do not)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    a, b = files.tensor(main, main_ref, verify=full), files.tensor(shard, ref, verify=full)
    pick = (lambda t: t) if full else _sample_values
    same = torch.equal(_bytes(pick(a)), _bytes(pick(b)))
    return same, 0.0 if same else _largest_difference(pick(a), pick(b))


def _compare_bytes(files: SourceFiles, main: str, main_ref: TensorRef, shard: str, ref: TensorRef, full: bool
                   ) -> tuple[bool, float]:
    """:func:`_compare_tensors` of two legacy pieces, as numpy arrays of their bytes (the difference in fp32, as
    there)."""
    import numpy as np  # deferred: numpy only where arrays are made

    a, b = files.array(main, main_ref, verify=full), files.array(shard, ref, verify=full)
    if not full:
        a, b = _sample_array(a), _sample_array(b)
    if a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and np.array_equal(a.view(b.dtype), b):
        return True, 0.0
    va, vb = float_values(a, main_ref.dtype), float_values(b, ref.dtype)
    if va is None or vb is None or va.shape != vb.shape:
        return False, float("nan")
    with np.errstate(invalid="ignore", over="ignore"):
        return False, float(np.abs(va.astype(np.float32) - vb.astype(np.float32)).max()) if va.size else 0.0


def _sample_array(a: Any) -> Any:
    """:func:`_sample_values` of a numpy array."""
    import numpy as np  # deferred, as above

    if not a.flags.c_contiguous or a.size <= 3 * SAMPLE:
        return a
    flat, n = a.reshape(-1), a.size
    mid = n // 2
    return np.concatenate([flat[:SAMPLE], flat[mid:mid + SAMPLE], flat[n - SAMPLE:]])


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if not (a.is_floating_point() and b.is_floating_point()):
        return float("nan")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _mismatch(key: str, main: str, other: str, full: bool, where: str) -> ReplicaMismatch:
    what = (f"the replicas of {key} disagree: {main} and {other} hold different values for the same piece"
            f"{'' if full else ' (sampled check)'}")
    return ReplicaMismatch(f"{what}; one of those ranks diverged (Megatron keeps this tensor's copies equal)",
                           path=where,
                           fix="find which copy is right (compare with an earlier iteration) and restore the iteration "
                               "dir from a good copy, or load an earlier iteration with --ckpt-step", code="replicas")


def _ident(ref: TensorRef) -> tuple:
    return (ref.storage.key, ref.offset, tuple(ref.shape), tuple(ref.stride))
