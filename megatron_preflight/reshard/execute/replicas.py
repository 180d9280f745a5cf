"""Replicas must agree: the same source piece held by several shards (a layernorm on every TP rank, a dense weight on
every EP rank, the tied output layer on the last stage) is read from its main copy, and the others are compared with
it — sampled (a few elements at the start, middle and end) on every run, whole with ``--verify``. Diverged replicas
are a real failure mode; they are reported with the shards involved, never averaged or silently picked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.plan.types import RankPlan, TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.torch_file import TensorRef
from megatron_preflight.tree import iter_leaves

if TYPE_CHECKING:
    import torch

SAMPLE = 32  # elements compared at each of three places in the sampled check


class ReplicaMismatch(PreflightError):
    """Two shards hold different values for the same piece of a tensor."""


def planned(plan: RankPlan) -> Iterator[TensorPlan]:
    yield from plan.tensors
    for _, leaf in iter_leaves(plan.optimizer):
        if isinstance(leaf, TensorPlan):
            yield leaf


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def _sample(t: torch.Tensor) -> torch.Tensor:
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    if not t.is_contiguous() or t.numel() <= 3 * SAMPLE:
        return _bytes(t)
    flat, n = t.view(-1), t.numel()
    mid = n // 2
    return _bytes(torch.cat([flat[:SAMPLE], flat[mid:mid + SAMPLE], flat[n - SAMPLE:]]))


def expected_divergence(saved_args: Any) -> str | None:
    """Why this checkpoint's TP replicas differ by Megatron's own doing (not damage), from its saved args; None when
    no such cause is known."""
    tp = getattr(saved_args, "tensor_model_parallel_size", 1) or 1
    if getattr(saved_args, "multi_latent_attention", False) and tp > 1 and \
            not getattr(saved_args, "sequence_parallel", False):
        return (f"it is a multi-latent-attention model trained at TP{tp} without --sequence-parallel, where Megatron "
                "does not reduce the gradients of MLA's duplicated down projections over the TP group, so the "
                "parameters replicated over TP drift apart between TP ranks as it trains")
    return None


def check_replicas(plan: RankPlan, files: SourceFiles, *, full: bool = False, saved_args: Any = None) -> int:
    """Compare every replica of every source piece ``plan`` reads with its main copy (bit for bit), whole or
    sampled. Returns the number of replicas compared; raises :class:`ReplicaMismatch` on the first difference (with
    its cause when the checkpoint's ``saved_args`` explain it: :func:`expected_divergence`)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

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
                # replica's bytes are not used) unless the samples differ: then a damaged record is named as damage
                a, b = files.tensor(op.shard, op.ref, verify=full), files.tensor(shard, ref, verify=full)
                same = torch.equal(_bytes(a), _bytes(b)) if full else torch.equal(_sample(a), _sample(b))
                del a, b
                if full:
                    files.release_pages()
                compared += 1
                if not same:
                    files.tensor(op.shard, op.ref)  # raises CorruptFileError on a CRC mismatch
                    files.tensor(shard, ref)
                    raise _mismatch(tp.key, op.shard, shard, full, files.iter_dir, expected_divergence(saved_args))
    return compared


def _mismatch(key: str, main: str, other: str, full: bool, where: str, cause: str | None) -> ReplicaMismatch:
    what = (f"the replicas of {key} disagree: {main} and {other} hold different values for the same piece"
            f"{'' if full else ' (sampled check)'}")
    if cause is not None:
        return ReplicaMismatch(
            f"{what}; {cause}. A reshard must take one copy, and it does not pick one for you", path=where,
            fix="load it at its own layout with --ckpt-convert-format torch_dist --ckpt-convert-save DIR (a torch_dist "
                "save keeps TP rank 0's copies), then resume from DIR at the new layout; train MLA at TP > 1 with "
                "--sequence-parallel", code="replicas")
    return ReplicaMismatch(f"{what}; one of those ranks diverged", path=where,
                           fix="find which copy is right (compare with an earlier iteration) and restore the iteration "
                               "dir from a good copy, or load an earlier iteration with --ckpt-step", code="replicas")


def _ident(ref: TensorRef) -> tuple:
    return (ref.storage.key, ref.offset, tuple(ref.shape), tuple(ref.stride))
