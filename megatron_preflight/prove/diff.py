"""Two checkpoints compared by global tensor content, whatever their layouts, formats and optimizer forms.

Each side is read as the resharder reads it and planned as the one rank of TP1·PP1·EP1 (the global tensors, the
optimizer state in model space: per parameter its fp32 master, ``exp_avg``, ``exp_avg_sq`` — the distributed
optimizer's buffers included — and the step), so a TP2 legacy checkpoint and a TP4·PP2 torch_dist one of the same
model compare tensor for tensor. The second side is named and laid out as the first (its layer spec bridged, its Adam
state put in the first's family) so a local-spec checkpoint and a TE-spec one compare too. Equal tensors — the
common case — are shown equal where their bytes lie (:mod:`.lockstep`: mapped windows, or row blocks read in
lockstep), or slice against slice of the mapped sources where a plan cannot be read so; a difference is measured from the two tensors built in
full, one pair in memory at a time. Vocab padding rows are not compared (Megatron pads to a multiple of the TP size:
the rows hold nothing); every real row is.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.dtypes import int_view, same_bits
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.model import Format
from megatron_preflight.parallel import tokenizer_ids
from megatron_preflight.prove import common_state
from megatron_preflight.prove.global_view import global_plan, global_resharder, named_tensors, value_of
from megatron_preflight.prove.lockstep import LockstepReader
from megatron_preflight.reshard.checkpoint_index import open_index
from megatron_preflight.reshard.plan.types import TensorPlan
from megatron_preflight.reshard.sources.files import SourceFiles
from megatron_preflight.reshard.sources.te_extra_state import holds_no_fp8

log = logging.getLogger(__name__)

# saved args that describe where and how a run ran, not the model or its training: not reported as differences
RUN_FIELDS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "context_parallel_size", "world_size", "data_parallel_size", "rank",
    "local_rank", "save", "load", "ckpt_format", "use_distributed_optimizer", "padded_vocab_size",
    "transformer_impl", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards", "no_save_optim",
    "pipeline_model_parallel_layout", "wandb_exp_name", "tensorboard_dir", "distributed_backend", "use_dist_ckpt",
    "auto_detect_ckpt_format", "inprocess_active_world_size", "dist_ckpt_optim_fully_reshardable",
})


@dataclass
class TensorDiff:
    """One global tensor of either checkpoint, compared."""

    name: str  # the parameter's key (optimizer state: ``key#exp_avg``, ``key#@master``)
    status: str  # equal | differs | missing_in_a | missing_in_b | shape | dtype
    shape: tuple[int, ...] | None = None
    other_shape: tuple[int, ...] | None = None
    dtype: str | None = None
    other_dtype: str | None = None
    differing: int = 0  # elements that differ (beyond the tolerances)
    max_abs: float = 0.0
    max_rel: float = 0.0
    first: tuple[int, ...] | None = None  # the index of the first differing element
    rows: int | None = None  # vocab rows compared (padding excluded), for the vocab tensors

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    args: list[tuple[str, Any, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: tuple[float | None, float | None] = (None, None)
    # the common state a resume reads that differs (iteration, the LR scheduler, the param groups' settings):
    # (what, a, b)
    common: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(t.status == "equal" for t in self.tensors) and self.steps[0] == self.steps[1] and not self.common

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal, "tensors": [t.to_json() for t in self.tensors],
                "optimizer_step": list(self.steps),
                "common": [{"field": f, "a": repr(x), "b": repr(y)} for f, x, y in self.common], "args": [{"field": f, "a": repr(x), "b": repr(y)}
                                                             for f, x, y in self.args], "notes": self.notes}

    def render(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        lines = [f"a: {self.a}", f"b: {self.b}",
                 "tensors: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
        if self.steps != (None, None):
            lines.append(f"optimizer step: a {self.steps[0]:g}, b {self.steps[1]:g}" if None not in self.steps
                         else f"optimizer step: a {self.steps[0]}, b {self.steps[1]}")
        bad = [t for t in self.tensors if t.status != "equal"]
        if bad:
            lines.append(f"{'tensor':<60} {'status':<12} {'differing':>10} {'max abs':>10} {'max rel':>10}  first")
            for t in bad:
                if t.status == "differs":
                    lines.append(f"{t.name:<60} {t.status:<12} {t.differing:>10} {t.max_abs:>10.3g} "
                                 f"{t.max_rel:>10.3g}  {list(t.first) if t.first is not None else ''}")
                else:
                    detail = {"shape": f"{t.shape} vs {t.other_shape}", "dtype": f"{t.dtype} vs {t.other_dtype}"}
                    lines.append(f"{t.name:<60} {t.status:<12} {detail.get(t.status, '')}")
        if self.common:
            lines.append(f"common state that differs ({len(self.common)}: a resume reads it):")
            lines += [f"  {f}: a {x!r}, b {y!r}" for f, x, y in self.common]
        if self.args:
            lines.append(f"saved args that differ ({len(self.args)}; layout and run-environment fields left out):")
            lines += [f"  {f}: a {x!r}, b {y!r}" for f, x, y in self.args[:40]]
        lines += [f"note: {n}" for n in self.notes]
        lines.append("EQUAL" if self.equal else "DIFFERENT")
        return "\n".join(lines)


def compare_tensors(name: str, x: Any, y: Any, atol: float, rtol: float, rows: int | None = None) -> TensorDiff:
    """One pair of values (tensors, or extra state), compared; ``rows``: only the first rows (vocab padding out)."""
    import torch  # deferred: diff reads tensors (its module is imported by the CLI only when it runs)

    if name.endswith("_extra_state") and holds_no_fp8(x) and holds_no_fp8(y):
        return TensorDiff(name, "equal")  # TE's no-FP8 values (an empty tensor, a pickled None, None) mean the same
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return TensorDiff(name, "equal" if _samevalue_of(x, y) else "differs")
    if rows is not None:
        x, y = x[:rows], y[:rows]
    d = TensorDiff(name, "equal", tuple(x.shape), tuple(y.shape), str(x.dtype).removeprefix("torch."),
                   str(y.dtype).removeprefix("torch."), rows=rows)
    if x.shape != y.shape:
        d.status = "shape"
        return d
    if x.dtype != y.dtype:
        d.status = "dtype"
        return d
    if x.numel() == 0:
        return d
    if not (atol or rtol) and torch.equal(_as_ints(x), _as_ints(y)):
        return d  # bit for bit: the common case, one pass over the bytes and no arithmetic
    if x.is_floating_point():
        xd, yd = x.double(), y.double()
        delta = (xd - yd).abs()
        both_nan = torch.isnan(xd) & torch.isnan(yd)
        delta = torch.where(both_nan, torch.zeros_like(delta), delta)
        delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)
        bad = delta > (atol + rtol * yd.abs()) if (atol or rtol) else ~_bitwise_equal(x, y)
        d.max_abs = float(delta.max())
        scale = yd.abs().max()
        d.max_rel = float(d.max_abs / scale) if float(scale) > 0 else (0.0 if d.max_abs == 0 else float("inf"))
    else:
        bad = x != y
        d.max_abs = float((x.long() - y.long()).abs().max()) if x.dtype != torch.bool else float(bad.any())
    d.differing = int(bad.sum())
    if d.differing:
        d.status = "differs"
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        d.first = tuple(int(i) for i in _unravel(flat, tuple(x.shape)))
    return d


def _regions(tp: TensorPlan, files: SourceFiles) -> tuple[int | None, list[tuple[int, int, Any]]] | None:
    """The planned tensor as the source views that tile it along one dim: (dim, [(start, end, view)]); None when
    its pieces are cut along more than one dim."""
    assert tp.shape is not None
    dims = {op.dst[0] for op in tp.ops if op.dst is not None}
    if len(dims) > 1:
        return None
    dim = dims.pop() if dims else None
    out = []
    for op in tp.ops:
        view = files.tensor(op.shard, op.ref)
        if op.src is not None:
            view = view.narrow(*op.src)
        start, length = (op.dst[1], op.dst[2]) if op.dst is not None else (0, tp.shape[dim] if dim is not None else 0)
        out.append((start, start + length, view))
    return dim, out


def bitwise_equal_in_place(tpa: Any, tpb: Any, fa: SourceFiles, fb: SourceFiles, rows: int | None) -> bool:
    """Whether two planned tensors are equal bit for bit, compared slice against slice straight from the sources'
    mapped bytes (nothing assembled: a global tensor is read once per side, as the floor is). False means
    "not shown equal here": the caller builds both and measures the difference."""

    if not (isinstance(tpa, TensorPlan) and isinstance(tpb, TensorPlan)) or tpa.shape is None or \
            tpa.shape != tpb.shape or tpa.dtype != tpb.dtype or not tpa.shape or not tpa.ops or not tpb.ops:
        return False
    ra, rb = _regions(tpa, fa), _regions(tpb, fb)
    if ra is None or rb is None or (ra[0] is not None and rb[0] is not None and ra[0] != rb[0]):
        return False
    dim = ra[0] if ra[0] is not None else (rb[0] if rb[0] is not None else 0)
    limit = rows if rows is not None and dim == 0 else tpa.shape[dim]

    def spans(side: tuple[int | None, list[tuple[int, int, Any]]]) -> list[tuple[int, int, Any]]:
        return side[1] if side[0] is not None else [(0, tpa.shape[dim], v) for _, _, v in side[1]]

    a_spans, b_spans = spans(ra), spans(rb)
    try:
        return _compare_spans(a_spans, b_spans, dim, limit, rows)
    finally:
        del ra, rb, a_spans, b_spans
        for tp, files in ((tpa, fa), (tpb, fb)):  # keep the resident set small, as build_tensor(release=True)
            for op in tp.ops:
                files.release(op.shard, op.ref)


def _compare_spans(a_spans: list, b_spans: list, dim: int, limit: int, rows: int | None) -> bool:
    covered = 0
    for sa, ea, va in a_spans:
        for sb, eb, vb in b_spans:
            lo, hi = max(sa, sb), min(ea, eb, limit)
            if lo >= hi:
                continue
            x, y = va.narrow(dim, lo - sa, hi - lo), vb.narrow(dim, lo - sb, hi - lo)
            if rows is not None and dim != 0:
                x, y = x.narrow(0, 0, rows), y.narrow(0, 0, rows)
            if not same_bits(x, y):
                return False
            covered += hi - lo
    return covered == limit


def _as_ints(x: Any) -> Any:
    """The tensor's bits as integers of its width (bool as uint8)."""
    return x.contiguous().view(int_view(x.dtype))


def _bitwise_equal(x: Any, y: Any) -> Any:
    """Element-wise equality of the bits (NaN payloads and -0.0 included): bit for bit, not numerically."""
    return _as_ints(x) == _as_ints(y)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return list(reversed(out))


def _samevalue_of(x: Any, y: Any) -> bool:
    import torch  # deferred: see compare_tensors

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
            x.shape == y.shape and bool(torch.equal(x, y))
    return x == y


def _args_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    if a is None or b is None:
        return []
    va, vb = vars(a), vars(b)
    out = []
    for name in sorted(set(va) | set(vb)):
        if name in RUN_FIELDS:
            continue
        x, y = va.get(name, "<absent>"), vb.get(name, "<absent>")
        if repr(x) != repr(y):
            out.append((name, x, y))
    return out


def _common_differences(ia: Any, ib: Any, with_optimizer: bool) -> list[tuple[str, Any, Any]]:
    """The iteration and (with the optimizer state) the LR scheduler's state, where they differ."""
    out: list[tuple[str, Any, Any]] = []
    if ia.layout.iteration != ib.layout.iteration:
        out.append(("iteration", ia.layout.iteration, ib.layout.iteration))
    if with_optimizer:
        sa, sb = common_state.scheduler(ia), common_state.scheduler(ib)
        if isinstance(sa, dict) and isinstance(sb, dict):
            out += [(f"opt_param_scheduler.{k}", sa.get(k), sb.get(k)) for k in sorted(set(sa) | set(sb))
                    if repr(sa.get(k)) != repr(sb.get(k))]
        elif (sa is None) != (sb is None):
            out.append(("opt_param_scheduler", "saved" if sa is not None else None, "saved" if sb is not None else None))
    return out


def _group_differences(pa: Any, pb: Any) -> list[tuple[str, Any, Any]]:
    """Each parameter's group settings (:data:`common_state.GROUP_SETTINGS`) on both sides: one line per setting and pair of
    values that differ, naming the first parameter where they do."""
    if pa is None or pb is None:
        return []
    found: dict[tuple[str, str, str], tuple[str, Any, Any]] = {}
    for gkey, sig in pa.membership.items():
        other = pb.membership.get(gkey)
        if other is None:
            continue
        x, y = pa.settings.get(sig, {}), pb.settings.get(other, {})
        for k in common_state.GROUP_SETTINGS:
            if repr(x.get(k)) != repr(y.get(k)):
                where = gkey.suffix if gkey.layer is None else f"layer {gkey.layer} {gkey.suffix}"
                found.setdefault((k, repr(x.get(k)), repr(y.get(k))), (where, x.get(k), y.get(k)))
    return [(f"param group {key[0]} (first at {where})", x, y) for key, (where, x, y) in sorted(found.items())]


def _absent_extra(name: str, na: dict[str, Any], nb: dict[str, Any]) -> bool:
    """An ``_extra_state`` that one side lacks and the other holds without FP8 metadata: nothing to compare (a legacy
    file keeps the output layer's None, torch_dist does not; Megatron-FSDP saves none, TE's attention's is rebuilt)."""
    if not name.endswith("_extra_state") or (name in na) == (name in nb):
        return False
    tp = na.get(name, nb.get(name))
    return isinstance(tp, TensorPlan) and ((tp.shape is None and holds_no_fp8(tp.value)) or tp.shape == (0,))


def _token_rows(index: Any, vocab: Any) -> int:
    """The rows of a checkpoint's embedding that are token ids: its real vocab, with the end-of-document id a
    NullTokenizer run adds (as the Hugging Face exporter keeps it: layout/hf/families.true_vocab), within its rows."""
    kind = getattr(index.layout.saved_args, "tokenizer_type", None)
    return min(tokenizer_ids(vocab.real, kind), vocab.source_padded)


def diff_checkpoints(a: str, b: str, *, weights_only: bool = False, atol: float = 0.0, rtol: float = 0.0,
                     iteration_a: Any = None, iteration_b: Any = None, trust: bool = False,
                     workers: int = 2) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (any layouts and formats the resharder reads) by global tensor content,
    ``workers`` tensor pairs at a time (threads: torch reads and compares without the GIL)."""
    import torch  # noqa: F401 - deferred: loaded before indexing, so the sources make tensors (TE extra state, dtypes)

    if atol < 0 or rtol < 0:
        raise PreflightError("--atol and --rtol must not be negative", fix="pass 0 or a positive tolerance",
                             code="usage")
    ia = open_index(a, iteration=iteration_a, trust_checkpoint=trust)
    ib = open_index(b, iteration=iteration_b, trust_checkpoint=trust)
    for index in (ia, ib):
        index.require_readable()
    report = DiffReport(ia.layout.iter_dir or a, ib.layout.iter_dir or b)
    keep = not weights_only
    ga, gb = global_resharder(ia, keep, None), global_resharder(ib, keep, ia)
    for side, r in (("a", ga), ("b", gb)):
        if keep and r.optimizer_problem is not None:
            report.notes.append(f"{side}: optimizer state not compared ({r.optimizer_problem.message})")
    with_optimizer = keep and ga.writes_optimizer and gb.writes_optimizer
    if keep and not with_optimizer and not report.notes:
        report.notes.append("optimizer state not compared: "
                            + ("neither has one" if not (ga.writes_optimizer or gb.writes_optimizer)
                               else f"only {'a' if ga.writes_optimizer else 'b'} has one"))
    pa, pb = global_plan(ga), global_plan(gb)
    rows = None
    if ga.vocab is not None and gb.vocab is not None:
        real_a, real_b = _token_rows(ia, ga.vocab), _token_rows(ib, gb.vocab)
        rows = min(real_a, real_b)
        if real_a != real_b:
            report.notes.append(f"the vocab sizes differ ({real_a} vs {real_b} real rows): the first "
                                f"{rows} rows compared")
        if max(ga.vocab.source_padded, gb.vocab.source_padded) > rows:
            report.notes.append(f"vocab padding rows (beyond the {rows} real rows) are not compared")
    na, nb = named_tensors(pa, with_optimizer), named_tensors(pb, with_optimizer)
    names = [n for n in list(na) + [n for n in nb if n not in na] if not _absent_extra(n, na, nb)]
    local = threading.local()
    opened: list[SourceFiles | LockstepReader] = []
    lock = threading.Lock()

    def files() -> tuple[SourceFiles, SourceFiles, LockstepReader]:
        if not hasattr(local, "files"):  # per thread: a pair of readers (their mapped files are not shared), buffers
            local.files = (SourceFiles(ga.layout.iter_dir or "", trust=trust, crc=False),  # a changed byte: a
                           SourceFiles(gb.layout.iter_dir or "", trust=trust, crc=False),  # difference it reports
                           LockstepReader())
            with lock:
                opened.extend(local.files)
        return local.files

    def one(name: str) -> TensorDiff:
        if name not in nb or name not in na:
            tp = na.get(name) or nb.get(name)
            return TensorDiff(name, "missing_in_b" if name in na else "missing_in_a", shape=getattr(tp, "shape", None))
        fa, fb, blocks = files()
        is_vocab = any(getattr(t, "pad_from", None) is not None for t in (na[name], nb[name]))
        limit = rows if is_vocab else None
        if not (atol or rtol):
            # the common case, equal bit for bit, shown the cheapest way that can read both plans: plain reads of
            # row blocks in lockstep, else slice against slice of the mapped sources; a difference is measured below
            same = blocks.equal(na[name], nb[name], fa, fb, limit)
            if same is None:
                same = bitwise_equal_in_place(na[name], nb[name], fa, fb, limit)
            if same:
                tp = na[name]
                return TensorDiff(name, "equal", shape=tp.shape, dtype=str(tp.dtype), rows=limit)
        return compare_tensors(name, value_of(na[name], fa), value_of(nb[name], fb), atol, rtol, limit)

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # torch reads and compares without the GIL
            report.tensors = list(pool.map(one, names))
    finally:
        for f in opened:
            f.close()
    if with_optimizer:
        report.steps = (ga.plain_step(), gb.plain_step())
        report.common += _group_differences(ga.choice.plain, gb.choice.plain)
    if Format.HF in (ia.layout.format, ib.layout.format):
        # an HF model carries a config.json, not Megatron's args or the state a resume reads: the weights are what
        # an export (or an import) must keep
        report.notes.append("a Hugging Face model: its weights compared (no Megatron args or resume state to compare)")
        return report
    report.common = _common_differences(ia, ib, with_optimizer) + report.common
    report.args = _args_differences(ia.view.saved_args, ib.view.saved_args)
    return report

