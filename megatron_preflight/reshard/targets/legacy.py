"""The legacy (``--ckpt-format torch``) target: one ``model_optim_rng.pt`` (and ``distrib_optim.pt``) per shard dir,
streamed tensor by tensor, and its verify (every written tensor re-read against its source slices).
"""

from __future__ import annotations

import io
import logging
import math
import os
from typing import Any

from megatron_preflight import dtypes
from megatron_preflight.errors import PreflightError
from megatron_preflight.held_tensor import HeldTensor
from megatron_preflight.layout import naming
from megatron_preflight.reshard.arrays import BYTES, TORCH
from megatron_preflight.reshard.execute.executor import build_rows
from megatron_preflight.reshard.execute.replicas import Drifted, check_replicas
from megatron_preflight.reshard.optimizer.plain import iter_plans
from megatron_preflight.reshard.plan.types import RankPlan, TensorPlan, flat_parts
from megatron_preflight.reshard.resharder import Resharder
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.targets import durable
from megatron_preflight.reshard.targets.output_file import drop_read_back
from megatron_preflight.reshard.targets.read_back import ReadBack
from megatron_preflight.reshard.targets.stream_save import bytes_only, save_streaming, save_tree
from megatron_preflight.reshard.targets.unit import MegatronDirs, ShardResult, Tapping
from megatron_preflight.torch_file import TensorRef, TorchFile

log = logging.getLogger(__name__)


def write_shard(r: Resharder, name: str, iter_out: str, verify: bool, tapping: Tapping | None = None
                ) -> ShardResult:
    """Write the shard dir ``name`` of ``r``'s target into ``iter_out`` (and verify it; every tensor written shown to
    ``tapping``'s tap)."""
    coords = naming.shard_writers(r.tgt)[name]
    plan = r.plan_for_coords(coords, name)
    tap = tapping.open(r, coords) if tapping is not None else None
    files = SourceFiles(r.layout.iter_dir or "", trust=r.trust, )
    try:
        out_dir = os.path.join(iter_out, name)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, naming.MODEL_FILENAME)
        drifted = Drifted()
        replicas = check_replicas(plan, files, full=verify, saved_args=r.layout.saved_args, drifted=drifted)
        save_streaming(r.header(files), plan, files, path, tap)
        checked = verify_shard(plan, path, files) if verify else 0
        written = os.path.getsize(path)
        if plan.dist_optimizer is not None:
            dist_path = os.path.join(out_dir, naming.DISTRIB_OPTIM_FILENAME)
            save_tree(plan.dist_optimizer, files, dist_path, tap)
            checked += verify_dist_optimizer(plan, dist_path, files) if verify else 0
            written += os.path.getsize(dist_path)
        durable.fsync_dir(out_dir)
        return ShardResult(files.bytes_read, written, checked, replicas, tap.result() if tap is not None else None,
                           drifted)
    finally:
        files.close()


def verify_shard(plan: RankPlan, path: str, files: SourceFiles) -> int:
    """Re-read a written shard and check every planned slice (model and optimizer state) against its source slice,
    bit for bit (each record's CRC-32 checked as it is read). Returns the number of tensors checked; raises on any difference."""
    checked = since = 0
    with TorchFile(path) as out:
        meta = out.load_metadata()
        planned = [((tp.chunk, tp.key), tp) for tp in plan.tensors]
        planned += [(("optimizer", *p), tp) for p, tp in iter_plans(plan.optimizer)]
        pairs = [(tp, _written(meta, where)) for where, tp in planned]
        order = [w for tp, w in pairs if tp.shape is not None and isinstance(w, TensorRef) and bytes_only(tp)]
        with ReadBack(out, path, order) as back:
            for tp, written in pairs:
                _verify_tensor(tp, written, out, files, path, back)
                checked += tp.shape is not None
                if tp.shape is not None:
                    since += math.prod(tp.shape) * tp.dtype.itemsize
                if since >= _RELEASE_BYTES:  # the written file's pages read back, dropped: the resident set stays
                    out.release_pages()  # small
                    drop_read_back(path)
                    since = 0
    return checked


def _written(meta: Any, where: tuple[Any, ...]) -> Any:
    """The entry of a written file's object tree at ``where`` ("<missing>" where there is none)."""
    written: Any = meta
    for part in where:
        try:
            written = written[part]
        except (KeyError, IndexError, TypeError):
            return "<missing>"
    return written


_RELEASE_BYTES = 256 * 2**20  # bytes read back between two releases of the written file's mapped pages


def verify_dist_optimizer(plan: RankPlan, path: str, files: SourceFiles) -> int:
    """Re-read a written distrib_optim.pt: every parameter's state at its offset equals its source slices, and the
    alignment padding between them is zero. Returns the number of world tensors checked."""
    checked = 0
    with TorchFile(path) as out:
        meta = out.load_metadata()
        parts = [(fp, _written(meta, where)) for where, fp in flat_parts(plan.dist_optimizer)]
        order = [w for fp, w in parts if isinstance(w, TensorRef) and bytes_only(fp)]
        with ReadBack(out, path, order) as back:
            for fp, written in parts:
                if not isinstance(written, TensorRef) or tuple(written.shape) != (fp.numel,):
                    raise PreflightError(f"verify: {fp.key} is missing or has the wrong size", path=path, code="verify")
                kit = BYTES if bytes_only(fp) else TORCH
                flat = kit.written(back, written)
                covered = kit.flags(fp.numel)
                for start, tp in fp.parts:
                    assert tp.shape is not None
                    want = build_rows(tp, files, 0, tp.shape[0] if tp.shape else 1, kit=kit).reshape(-1)
                    if dtypes.name_of(tp.dtype) != dtypes.name_of(fp.dtype):
                        want = kit.converted(want, tp.dtype, fp.dtype)
                    n = kit.nbytes(want) // fp.dtype.itemsize
                    if not kit.same_bits(want, flat[start:start + n]):
                        raise PreflightError(f"verify: {tp.key} in {fp.key} does not match its source slices", path=path,
                                             code="verify")
                    covered[start:start + n] = True
                if kit.any_set(flat[~covered]):
                    raise PreflightError(f"verify: the padding of {fp.key} is not zero", path=path, code="verify")
                del flat
                out.release_pages()  # (a world tensor read back: its pages dropped)
                drop_read_back(path)
                checked += 1
    return checked


def _same_value(written: Any, want: Any, out: TorchFile) -> bool:
    """Equality of a carried value as written and as read from the source (TE's extra state: a BytesIO compares by
    content, a uint8 tensor by dtype, shape and bytes)."""
    if isinstance(written, io.BytesIO) and isinstance(want, io.BytesIO):
        return written.getvalue() == want.getvalue()
    if isinstance(written, TensorRef) and isinstance(want, HeldTensor):
        got = out.array(written)
        return dtypes.name_of(written.dtype) == dtypes.name_of(want.dtype) and \
            tuple(got.shape) == tuple(want.shape) and got.tobytes() == want.data
    if isinstance(written, TensorRef) and dtypes.is_tensor(want):
        import torch  # deferred, as above

        got = out.tensor(written)
        return got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape) and torch.equal(got, want)
    return bool(written == want)


def _verify_tensor(tp: TensorPlan, written: Any, out: TorchFile, files: SourceFiles, path: str,
                   back: ReadBack) -> None:
    if tp.shape is None:
        if not _same_value(written, tp.value, out):
            raise PreflightError(f"verify: {tp.key} differs from its source value", path=path, code="verify")
        return
    if not isinstance(written, TensorRef) or tuple(written.shape) != tuple(tp.shape):
        raise PreflightError(f"verify: {tp.key} is missing or has the wrong shape", path=path, code="verify")
    kit = BYTES if bytes_only(tp) else TORCH  # (legacy pieces: compared as bytes, no torch)
    dst = kit.written(back, written)
    for op in tp.ops:  # (bit for bit, in place: no copy of either side)
        src = kit.source(files, op.shard, op.ref)
        s = src if op.src is None else kit.narrow(src, *op.src)
        d = dst if op.dst is None else kit.narrow(dst, *op.dst)
        if not kit.same_bits(s, d):
            raise PreflightError(f"verify: {tp.key} does not match its source slice in {op.shard}", path=path,
                                 code="verify")
        del s, src
        files.release(op.shard, op.ref)  # (the source's mapped pages: the resident set stays near one tensor)
    dim = next((op.dst[0] for op in tp.ops if op.dst is not None), 0)
    for start, length in tp.zero_fill:
        if kit.any_set(kit.narrow(dst, dim, start, length)):
            raise PreflightError(f"verify: padding rows {start}:{start + length} of {tp.key} are not zero", path=path,
                                 code="verify")


class LegacyTarget(MegatronDirs):
    """``--ckpt-format torch``: one unit per shard dir of the target layout, written in parallel (workers, ranks)."""

    def units(self, r: Resharder) -> list[str]:
        return list(naming.shard_writers(r.tgt))

    def weights(self, r: Resharder) -> dict[str, int]:
        return {name: plan.nbytes for name, plan in r.shard_plans().items()}

    def least_bytes(self, r: Resharder) -> int | None:
        return sum(self.weights(r).values())

    def write(self, r: Resharder, unit: str, iter_out: str, verify: bool, tapping: Tapping | None = None
              ) -> ShardResult:
        return write_shard(r, unit, iter_out, verify, tapping)
