"""The one parallel-layout type: TP, PP, EP, ETP, VPP, CP, rank order, uneven first/last stages and the embedding /
loss counted in the pipeline split — built from Megatron args in exactly one function, :func:`from_args`.

The layout reader (a checkpoint's saved args), the check (the run's flags), the resharder's target and the hook (the
live ``args``) all build their layout here, so the same flags always mean the same layout. The layer-to-stage split,
the expert placement, ETP defaulting and vocab padding live here once. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from megatron_preflight.errors import PreflightError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"  # --use-tp-pp-dp-mapping


class LayoutError(PreflightError):
    """A parallel layout that cannot hold the model (layers, experts, virtual stages)."""

    def __init__(self, message: str, fix: str = "", field: str = "", path: str | None = None) -> None:
        super().__init__(message, path=path, fix=fix or None, code="layout")
        self.field = field


VOCAB_DIVISOR = 128  # Megatron's default --make-vocab-size-divisible-by


def pad_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab: the true vocab rounded up to a multiple of ``make_vocab_size_divisible_by × TP``."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m


def tokenizer_ids(vocab_size: int, tokenizer_type: str | None, *, null_adds_eod: bool = True) -> int:
    """The token ids of a tokenizer built from ``--vocab-size``: Megatron's NullTokenizer adds an end-of-document id up
    to megatron-core 0.17 (from 0.18 its last id is the end of document); a tokenizer with files has its own size,
    which ``--vocab-size`` then names. ``null_adds_eod``: the release's behaviour (True where it is not known: the row
    that may be a token is counted, never dropped)."""
    return vocab_size + (1 if tokenizer_type == "NullTokenizer" and null_adds_eod else 0)


def divisor_keeping(vocab: int, padded: int, tp: int) -> int | None:
    """A ``--make-vocab-size-divisible-by`` under which ``vocab`` pads to ``padded`` at ``tp``: the smallest power of
    two that does (as Megatron's default, 128, is), else the smallest number; None when none does (``padded`` is not a
    multiple of ``tp``)."""
    if tp < 1 or padded % tp:
        return None
    per_rank = padded // tp
    small = [d for d in range(1, int(per_rank ** 0.5) + 1) if per_rank % d == 0]
    for d in sorted({*small, *(per_rank // d for d in small)}, key=lambda d: (d & (d - 1) != 0, d)):
        if pad_vocab(vocab, d, tp) == padded:
            return d
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """How one model is laid out over ranks. ``etp`` None follows TP (Megatron's default); ``vpp`` is None or ≥ 2."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    cp: int = 1
    order: str = DEFAULT_ORDER
    num_layers: int | None = None
    num_experts: int | None = None
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    embedding_in_split: bool = False  # --account-for-embedding-in-pipeline-split
    loss_in_split: bool = False  # --account-for-loss-in-pipeline-split
    pipeline_layout: str | None = None  # --pipeline-model-parallel-layout (not modelled: only recorded)
    hybrid_pattern: str | None = None  # HybridModel's --hybrid-layer-pattern: its `|` segments place the layers
    observed: tuple[tuple[int, ...], ...] | None = None  # [chunk][stage] layer counts read from a checkpoint

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            _positive(name, getattr(self, name))
        if self.etp is not None:
            _positive("etp", self.etp)
        if self.vpp is not None:
            _positive("vpp", self.vpp)
            if self.vpp == 1:
                object.__setattr__(self, "vpp", None)
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 0):
            raise LayoutError(f"the number of layers must be a non-negative integer, got {self.num_layers!r}",
                              field="num_layers")

    # -- sizes ---------------------------------------------------------------------------------------------------
    @property
    def etp_eff(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def min_world(self) -> int:
        """The smallest world size valid for both rank grids (dense TP·CP·DP·PP, expert ETP·EP·EDP·PP)."""
        return math.lcm(self.tp * self.cp, self.etp_eff * self.ep) * self.pp

    def world_problem(self, world: int) -> LayoutError | None:
        """Why ``world`` ranks cannot hold this layout (Megatron's ``initialize_model_parallel`` raises), or None."""
        dense, expert = self.tp * self.pp * self.cp, self.etp_eff * self.ep * self.pp
        for size, what, fix in ((dense, "TP·PP·CP", "change the number of GPUs or the parallel sizes"),
                                (expert, "ETP·EP·PP", "change the number of GPUs, EP or ETP")):
            if world % size:
                return LayoutError(f"world size {world} is not divisible by {what} = {size} ({self.describe()})",
                                   field="world_size", fix=fix)
        return None

    def sizes(self) -> dict[str, int | None]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp_eff, "vpp": self.vpp, "cp": self.cp}

    def describe(self) -> str:
        text = f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.etp_eff}"
        return text + (f" VPP{self.vpp}" if self.vpp else "")

    # -- layers over stages and virtual chunks -------------------------------------------------------------------
    def _layers(self) -> int:
        if self.num_layers is None:
            raise LayoutError("the number of layers is not known", fix="pass --num-layers", field="num_layers")
        return self.num_layers

    def _stage_counts(self) -> list[int]:
        """Layers per pipeline stage (all chunks): an even split, uneven first/last stages, or the embedding / loss
        counted as a layer of the first / last stage."""
        n, pp, first, last = self._layers(), self.pp, self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            extra = int(self.embedding_in_split) + int(self.loss_in_split)
            total = n + extra
            if total % pp:
                what = "layers" if not extra else "layers (with the embedding/loss counted as layers)"
                raise LayoutError(f"{total} {what} are not divisible by PP{pp}", field="pipeline_model_parallel_size",
                                  fix="choose a PP size that divides --num-layers, or set "
                                      "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
            counts = [total // pp] * pp
            counts[0] -= int(self.embedding_in_split)
            counts[-1] -= int(self.loss_in_split)
            if min(counts) < 0:
                raise LayoutError(f"PP{pp} leaves a stage with no room for the embedding/loss",
                                  field="pipeline_model_parallel_size", fix="use a smaller PP size")
            return counts
        middle = pp - (first is not None) - (last is not None)
        rest = n - (first or 0) - (last or 0)
        if middle < 0 or rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise LayoutError(f"uneven stages (first={first}, last={last}) do not split {n} layers over PP{pp}",
                              field="decoder_first_pipeline_num_layers",
                              fix="fix --decoder-first/last-pipeline-num-layers")
        counts = [rest // middle if middle else 0] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def chunk_layer_counts(self) -> list[list[int]]:
        """Layers in each (virtual chunk, stage), ``[chunk][stage]``: as read from a checkpoint when known, else by
        Megatron's rules. Raises :class:`LayoutError` when the layout cannot hold the model."""
        if self.observed is not None:
            return [list(row) for row in self.observed]
        v = self.chunks
        if self.pipeline_layout:  # --pipeline-model-parallel-layout places each segment's decoder layers
            segments = placement({"pipeline_model_parallel_layout": self.pipeline_layout})
            if not isinstance(segments, tuple) or len(segments) != self.pp * v:
                raise LayoutError(f"the pipeline layout {self.pipeline_layout!r} does not have PP{self.pp} x "
                                  f"VPP{v} = {self.pp * v} segments megatron-preflight can read",
                                  field="pipeline_model_parallel_layout",
                                  fix="give one '|'-separated segment per pipeline stage (a virtual pipeline through "
                                      "the layout is not modelled yet)")
            counts = [n for n, _ in segments]
            if self.num_layers is not None and sum(counts) != self.num_layers:
                raise LayoutError(f"the pipeline layout {self.pipeline_layout!r} places {sum(counts)} decoder layers, "
                                  f"the model has {self.num_layers}", field="pipeline_model_parallel_layout",
                                  fix="give the layout one 't' per decoder layer")
            return [[counts[c * self.pp + p] for p in range(self.pp)] for c in range(v)]
        pipes = hybrid_segments(self.hybrid_pattern)
        if pipes is not None:
            if len(pipes) != self.pp * v:
                raise LayoutError(f"the hybrid layer pattern {self.hybrid_pattern!r} has {len(pipes)} pipeline "
                                  f"segments, not PP{self.pp} x VPP{v} = {self.pp * v}",
                                  field="hybrid_layer_pattern",
                                  fix="give --hybrid-layer-pattern one '|'-separated segment per pipeline stage "
                                      "(times the virtual stages), or drop the '|' to let Megatron split evenly")
            return [[pipes[c * self.pp + p] for p in range(self.pp)] for c in range(v)]
        if v > 1 and (self.embedding_in_split or self.loss_in_split):
            total = self._layers() + int(self.embedding_in_split) + int(self.loss_in_split)
            if total % (self.pp * v):
                raise LayoutError(f"{total} layers (with the embedding/loss counted as layers) do not split over "
                                  f"PP{self.pp} x VPP{v}", field="virtual_pipeline_model_parallel_size",
                                  fix="change --num-layers-per-virtual-pipeline-stage")
            counts = [[total // (self.pp * v)] * self.pp for _ in range(v)]
            counts[0][0] -= int(self.embedding_in_split)
            counts[-1][-1] -= int(self.loss_in_split)
            return counts
        stages = self._stage_counts()
        for p, c in enumerate(stages):
            if c % v:
                raise LayoutError(f"stage {p} has {c} layers, not divisible into {v} virtual stages",
                                  field="virtual_pipeline_model_parallel_size",
                                  fix="change --num-layers-per-virtual-pipeline-stage")
        return [[c // v for c in stages] for _ in range(v)]

    @cached_property
    def _layer_table(self) -> dict[int, tuple[int, int, int]]:
        table: dict[int, tuple[int, int, int]] = {}
        g = 0
        for chunk, row in enumerate(self.chunk_layer_counts()):  # Megatron numbers layers chunk-major
            for p, c in enumerate(row):
                for local in range(c):
                    table[g] = (p, chunk, local)
                    g += 1
        return table

    @cached_property
    def _layer_index(self) -> dict[tuple[int, int, int], int]:
        return {v: k for k, v in self._layer_table.items()}

    def place_layer(self, global_layer: int) -> tuple[int, int, int]:
        """(pp stage, virtual chunk, local index) of a global layer."""
        try:
            return self._layer_table[global_layer]
        except KeyError:
            raise LayoutError(f"layer {global_layer} does not exist in a {self.num_layers}-layer model") from None

    def global_layer(self, stage: int, chunk: int, local: int) -> int:
        try:
            return self._layer_index[(stage, chunk, local)]
        except KeyError:
            raise LayoutError(f"local layer {local} of stage {stage} chunk {chunk} does not exist in a "
                              f"{self.num_layers}-layer PP{self.pp} VPP{self.vpp} layout") from None

    # -- experts -------------------------------------------------------------------------------------------------
    def experts_per_rank(self) -> int:
        if not self.num_experts:
            return 0
        if self.num_experts % self.ep:
            sizes = ", ".join(str(d) for d in range(1, self.num_experts + 1) if self.num_experts % d == 0)
            raise LayoutError(f"{self.num_experts} experts are not divisible by EP{self.ep}",
                              field="expert_model_parallel_size",
                              fix=f"choose an EP size that divides the {self.num_experts} experts: {sizes}")
        return self.num_experts // self.ep

    def place_expert(self, global_expert: int) -> tuple[int, int]:
        """(ep rank, local index) of a global expert."""
        n = self.experts_per_rank()
        return global_expert // n, global_expert % n

    def global_expert(self, ep_rank: int, local: int) -> int:
        return ep_rank * self.experts_per_rank() + local

    def experts_are_expert_parallel(self) -> bool:
        """Whether expert weights use the expert grid (their own optimizer part, their own DP group)."""
        return self.ep > 1 or self.etp_eff != self.tp

    def vpp_args(self) -> dict[str, int | None]:
        """The Megatron args that make :func:`derive_vpp` give this VPP: layers per virtual stage (counting the
        embedding / loss when accounted in the split), or virtual stages per rank with uneven first/last stages."""
        if not self.vpp:
            return {"num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None}
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            return {"num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": self.vpp}
        total = self._layers() + int(self.embedding_in_split) + int(self.loss_in_split)
        return {"num_layers_per_virtual_pipeline_stage": total // (self.pp * self.vpp),
                "num_virtual_stages_per_pipeline_rank": None}

    def to_args(self) -> dict[str, Any]:
        """The Megatron args that make :func:`from_args` build this layout (the inverse of the one builder): sizes,
        the virtual pipeline flags, the stage split, the model's layer and expert counts, the rank order."""
        out: dict[str, Any] = {
            "tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
            "expert_model_parallel_size": self.ep, "expert_tensor_parallel_size": self.etp_eff,
            "context_parallel_size": self.cp, "virtual_pipeline_model_parallel_size": self.vpp,
            "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
            "decoder_first_pipeline_num_layers": self.first_stage_layers,
            "decoder_last_pipeline_num_layers": self.last_stage_layers,
            "account_for_embedding_in_pipeline_split": self.embedding_in_split,
            "account_for_loss_in_pipeline_split": self.loss_in_split,
            "num_layers": self.num_layers, "num_experts": self.num_experts,
            "use_tp_pp_dp_mapping": self.order == TP_PP_DP_ORDER,
            "pipeline_model_parallel_layout": self.pipeline_layout,
        }
        if self.hybrid_pattern is not None:
            out["hybrid_layer_pattern"] = self.hybrid_pattern
        if self.vpp and self.hybrid_pattern is None and (
                self.num_layers is not None or self.first_stage_layers is not None
                or self.last_stage_layers is not None):
            out.update(self.vpp_args())
        return out

    def validate(self) -> None:
        """Raise :class:`LayoutError` when the layout cannot hold the model (layers and experts, when known)."""
        if self.num_layers is not None:
            self.chunk_layer_counts()
        if self.num_experts:
            self.experts_per_rank()


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def fit_problems(layout: ParallelLayout, model: Any, *, training: bool = True) -> list[LayoutError]:
    """Whether ``layout`` can hold the model ``model`` describes (Megatron args: a Namespace, RuntimeArgs or
    mapping): heads, query groups and the ffn split over TP, experts over EP, the expert ffn over ETP (and, for a run
    that trains, MoE biases only at ETP 1, and not at EP 1 on the local spec of a release that adds them in place). Each problem names its field and the sizes that work. The check asks it
    of the run's layout, the resharder of its target."""
    out: list[LayoutError] = []
    tp, ep, etp = layout.tp, layout.ep, layout.etp_eff
    heads = _int(model, "num_attention_heads")
    groups = _int(model, "num_query_groups") if _get(model, "group_query_attention") else None
    ffn = _int(model, "ffn_hidden_size")
    experts = _int(model, "num_experts")
    if heads and heads % tp:
        out.append(LayoutError(f"{heads} attention heads are not divisible by TP{tp}", field="tensor_model_parallel_size",
                               fix=f"choose a TP size that divides the {heads} heads: {divisors(heads)}"))
    if groups and groups % tp:
        out.append(LayoutError(f"{groups} query groups are not divisible by TP{tp}", field="tensor_model_parallel_size",
                               fix=f"choose a TP size that divides the {groups} query groups: {divisors(groups)}"))
    if ffn and ffn % tp:
        out.append(LayoutError(f"ffn hidden size {ffn} is not divisible by TP{tp}", field="tensor_model_parallel_size",
                               fix=f"choose a TP size that divides {ffn}"))
    out += _hybrid_fit(model, tp)
    if experts:
        if experts % ep:
            out.append(LayoutError(f"{experts} experts are not divisible by EP{ep}", field="expert_model_parallel_size",
                                   fix=f"choose an EP size that divides the {experts} experts: {divisors(experts)}"))
        bias = _get(model, "add_bias_linear")
        if training and etp > 1 and (bias is None or bool(bias)):
            out.append(LayoutError("MoE biases are only supported with expert-tensor-parallel size 1",
                                   field="expert_tensor_parallel_size",
                                   fix="add --disable-bias-linear or set --expert-tensor-parallel-size 1"))
        if training and ep == 1 and etp == 1 and (bias is None or bool(bias)) \
                and _get(model, "transformer_impl") == "local" and _get(model, "expert_bias_in_place"):
            out.append(LayoutError(
                "MoE biases with the local spec's experts at EP 1: Megatron-LM (0.15 on) adds each expert's output "
                "bias in place on its row-parallel linear's output, which at EP 1 and ETP 1 is a reduction's view of "
                "its input; autograd refuses that at the first training step ('Output 0 of "
                "_ReduceFromModelParallelRegion is a view and is being modified inplace')",
                field="expert_model_parallel_size",
                fix="add --transformer-impl transformer_engine --moe-grouped-gemm (or run at an expert-parallel size "
                    "of 2 or more)"))
        moe_ffn = _int(model, "moe_ffn_hidden_size") or ffn
        if moe_ffn and moe_ffn % etp:
            out.append(LayoutError(f"expert ffn size {moe_ffn} is not divisible by ETP{etp}",
                                   field="expert_tensor_parallel_size", fix="choose an ETP size that divides it"))
    return out


def _hybrid_fit(model: Any, tp: int) -> list[LayoutError]:
    """HybridModel's Mamba-2 heads and groups (``M``) and gated delta net key / value heads (``G``) over TP: Megatron
    asserts each divides."""
    pattern = hybrid_pattern(model)
    if pattern is None:
        return []
    layers = pattern.replace(PIPE, "")
    sizes: list[tuple[str, int | None]] = []
    if "M" in layers:
        heads = _int(model, "mamba_num_heads")
        if heads is None:
            hidden, expand, head_dim = _int(model, "hidden_size"), _int(model, "mamba_expand", 2), \
                _int(model, "mamba_head_dim", 64)
            heads = hidden * expand // head_dim if hidden and expand and head_dim else None
        sizes += [("Mamba heads", heads), ("Mamba groups", _int(model, "mamba_num_groups", 8))]
    if "G" in layers:
        sizes += [("gated delta net key heads", _int(model, "linear_num_key_heads")),
                  ("gated delta net value heads", _int(model, "linear_num_value_heads"))]
    return [LayoutError(f"{n} {what} are not divisible by TP{tp}", field="tensor_model_parallel_size",
                        fix=f"choose a TP size that divides the {n} {what}: {divisors(n)}")
            for what, n in sizes if n and n % tp]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PreflightError(f"the {name.upper()} size must be a positive integer, got {value!r}",
                             fix=f"pass an integer >= 1 for the {name.upper()} size", code="usage")


def _get(args: Any, name: str) -> Any:
    if args is None:
        return None
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def _int(args: Any, name: str, default: int | None = None) -> int | None:
    value = _get(args, name)
    if value is None:
        return default
    if isinstance(value, bool):
        raise PreflightError(f"argument {name} must be an integer, got {value!r}", code="usage",
                             fix=f"pass an integer for --{name.replace('_', '-')}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PreflightError(f"argument {name} must be an integer, got {value!r}", code="usage",
                             fix=f"pass an integer for --{name.replace('_', '-')}") from None


def gated_mlp(args: Any) -> bool:
    """Whether the model's MLPs are gated linear units (fc1 is ``[gate; up]``, each half split over TP): SwiGLU
    (``--swiglu``) or GPT-OSS's quick GEGLU (``--quick-geglu``), Megatron's ``gated_linear_unit``."""
    return bool(_get(args, "swiglu") or _get(args, "quick_geglu"))


MTP_SEPARATOR, PIPE = "/", "|"


def hybrid_pattern(args: Any) -> str | None:
    """HybridModel's layer pattern (``--hybrid-layer-pattern``; ``--hybrid-override-pattern`` before it), None for a
    GPT model."""
    value = _get(args, "hybrid_layer_pattern") or _get(args, "hybrid_override_pattern")
    return str(value) if value else None


def hybrid_main(pattern: str) -> str:
    """The decoder part of a hybrid pattern (before the first ``/``: what follows are MTP depths)."""
    return pattern.split(MTP_SEPARATOR, 1)[0]


def hybrid_segments(pattern: str | None) -> tuple[int, ...] | None:
    """The layer count of each ``|``-separated pipeline segment of a hybrid pattern; None without ``|`` (Megatron
    then splits the layers evenly, or by the first/last stage flags) or for a GPT model."""
    if not pattern or PIPE not in hybrid_main(pattern):
        return None
    return tuple(len(s) for s in hybrid_main(pattern).split(PIPE))


def hybrid_layers(pattern: str) -> str:
    """The decoder's layer symbols, one per layer, in order (``|`` removed)."""
    return hybrid_main(pattern).replace(PIPE, "")


def repipe(source: str, given: str | None, pp: int, vpp: int | None, *, keep: bool) -> str:
    """The hybrid pattern of a target layout: ``given`` (the run's ``--hybrid-layer-pattern``) when there is one, which
    must hold the same layers and MTP depths; else the source's when the pipeline is kept (``keep``); else the
    source's layers cut evenly into PP x VPP ``|`` segments (none at PP1 without VPP)."""
    mtp = source[len(hybrid_main(source)):]
    if given is not None:
        if hybrid_layers(given) != hybrid_layers(source) or given[len(hybrid_main(given)):] != mtp:
            raise PreflightError(
                f"the hybrid layer pattern {given!r} is another model than the checkpoint's {source!r} (not the same "
                "layers in the same order with the same MTP depths): no relayout turns one into the other",
                fix=f"set --hybrid-layer-pattern '{source}'; the checkpoint's layers (only the '|' pipeline cuts "
                    "may move)", code="layout")
        return given
    if keep:
        return source
    layers, chunks = hybrid_layers(source), pp * (vpp or 1)
    if chunks == 1:
        return layers + mtp
    if len(layers) % chunks:
        raise LayoutError(f"the hybrid pattern's {len(layers)} layers do not split evenly into PP{pp} x VPP{vpp or 1}"
                          " pipeline segments", field="hybrid_layer_pattern",
                          fix="give the target's --hybrid-layer-pattern with its '|' cuts (after `--`)")
    n = len(layers) // chunks
    return PIPE.join(layers[i:i + n] for i in range(0, len(layers), n)) + mtp


def expand_pipeline_layout(text: str | None) -> str | None:
    """``--pipeline-model-parallel-layout`` with its repeats written out and blanks dropped (``"E(t|)*2L"`` ->
    ``"Et|t|L"``), so two spellings of one placement compare equal; None for None. A malformed string is returned as
    written (compared as text: Megatron reports it)."""
    if text is None:
        return None
    s = "".join(str(text).split())

    def group(i: int) -> tuple[str, int]:
        out = ""
        while i < len(s) and s[i] != ")":
            if s[i] == "(":
                atom, i = group(i + 1)
                i += 1  # the ")"
            else:
                atom, i = s[i], i + 1
            j = i
            if j < len(s) and s[j] == "*":
                j += 1
                while j < len(s) and s[j].isdigit():
                    j += 1
                if j == i + 1:
                    raise ValueError("a '*' without a count")
                atom, i = atom * int(s[i + 1:j]), j
            out += atom
        return out, i

    try:
        expanded, end = group(0)
    except (ValueError, IndexError):
        return s
    return expanded if end == len(s) else s


def flexible_target(text: str, pp: int) -> str:
    """A ``--pipeline-model-parallel-layout`` the resharder writes: PP x VPP segments (virtual chunk-major, as Megatron
    reads them), the embedding (``E``) only in the first, the loss (``L``) and MTP layers (``m``) only in the last,
    decoder layers (``t``) anywhere. Raises :class:`LayoutError` (a usage error naming the layout) otherwise."""
    expanded = expand_pipeline_layout(text) or ""
    segments = expanded.split("|")
    bad = ""
    if "(" in expanded or "*" in expanded or set(expanded) - set("EtmL|"):
        bad = "it uses a form megatron-preflight cannot read"
    elif len(segments) % pp:
        bad = f"it has {len(segments)} segments, not a multiple of PP{pp}"
    elif any("E" in seg for seg in segments[1:]) or any(c in seg for seg in segments[:-1] for c in "Lm") or \
            segments[0].count("E") > 1 or segments[-1].count("L") > 1:
        bad = "the embedding must sit in the first segment only, the loss and MTP layers in the last only"
    if bad:
        raise LayoutError(f"the pipeline layout {text!r} cannot be a reshard target: {bad}",
                          field="pipeline_model_parallel_layout",
                          fix="give one '|'-separated segment per pipeline stage ('E' first, 'L' last, a 't' per "
                              "decoder layer), or place the layers with the even split")
    return text


def placement(args: Any) -> tuple[tuple[int, str], ...] | str | None:
    """Where a run (or a checkpoint's saved args) puts its layers: per pipeline segment (virtual chunk-major, as the
    layout string lists them) its decoder layer count and its other pieces (``E`` embedding, ``L`` loss, ``m`` MTP),
    from ``--pipeline-model-parallel-layout`` or else Megatron's split rules, so that a layout string that spells the
    even split equals no string. A layout string this cannot read is returned as text; None when the split rules
    cannot place the model (a finding of its own)."""
    text = _get(args, "pipeline_model_parallel_layout")
    if text:
        expanded = expand_pipeline_layout(text) or ""
        if "(" in expanded or "*" in expanded:
            return expanded
        return tuple((seg.count("t"), "".join(sorted(c for c in seg if c != "t"))) for seg in expanded.split("|"))
    try:
        layout = from_args(args, pipeline_model_parallel_layout=None)
        counts = layout.chunk_layer_counts()
    except (LayoutError, TypeError, ValueError):
        return None
    segments = [[counts[c][p], ""] for c in range(len(counts)) for p in range(layout.pp)]
    segments[0][1] += "E"
    segments[-1][1] += "L" + "m" * (_int(args, "mtp_num_layers") or 0)
    return tuple((n, "".join(sorted(m))) for n, m in segments)


def derive_vpp(args: Any) -> int | None:
    """The virtual pipeline size Megatron derives (``validate_args``): from ``--num-layers-per-virtual-pipeline-stage``
    (layers per stage counting the embedding / loss when they are accounted in the split), from
    ``--num-virtual-stages-per-pipeline-rank``, else the value already in the args (saved args carry it)."""
    pp = _int(args, "pipeline_model_parallel_size", 1) or 1
    if pp < 1:
        return None  # ParallelLayout refuses the size itself
    pattern = hybrid_pattern(args)
    if pattern is not None:  # HybridModel: one virtual stage per PP segments of the pattern
        pipes = hybrid_segments(pattern)
        return len(pipes) // pp if pipes and len(pipes) > pp and len(pipes) % pp == 0 else None
    per_chunk = _int(args, "num_layers_per_virtual_pipeline_stage")
    stages = _int(args, "num_virtual_stages_per_pipeline_rank")
    layout = _get(args, "pipeline_model_parallel_layout")
    vpp: int | None
    if layout:  # as validate_args: the layout's segments over the pipeline stages
        count = len((expand_pipeline_layout(layout) or "").split("|"))
        if count % pp:
            raise LayoutError(f"the pipeline layout {layout!r} has {count} segments, not a multiple of PP{pp} "
                              "(Megatron asserts)", field="pipeline_model_parallel_layout",
                              fix="give PP x VPP '|'-separated segments")
        vpp = count // pp
    elif stages is not None:
        vpp = stages
    elif per_chunk is not None:
        if _get(args, "decoder_first_pipeline_num_layers") is not None or \
                _get(args, "decoder_last_pipeline_num_layers") is not None:
            raise LayoutError("--num-layers-per-virtual-pipeline-stage cannot be combined with uneven first/last "
                              "pipeline stages (Megatron asserts)", field="num_layers_per_virtual_pipeline_stage",
                              fix="use --num-virtual-stages-per-pipeline-rank instead")
        n = _int(args, "num_layers")
        if n is None or per_chunk < 1:
            raise LayoutError("--num-layers-per-virtual-pipeline-stage needs --num-layers and a value >= 1",
                              field="num_layers_per_virtual_pipeline_stage", fix="pass --num-layers")
        n += bool(_get(args, "account_for_embedding_in_pipeline_split"))
        n += bool(_get(args, "account_for_loss_in_pipeline_split"))
        if n % pp or (n // pp) % per_chunk:
            raise LayoutError(f"{n // pp if n % pp == 0 else n / pp:g} layers per pipeline stage are not divisible by "
                              f"--num-layers-per-virtual-pipeline-stage {per_chunk}",
                              field="virtual_pipeline_model_parallel_size",
                              fix="choose a divisor of the layers per pipeline stage")
        vpp = (n // pp) // per_chunk
    else:
        vpp = _int(args, "virtual_pipeline_model_parallel_size")
    return vpp if vpp and vpp > 1 else None


# Every size flag a run can give, with its letter: each must be a positive integer when given.
SIZE_ARGS = {
    "tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP", "expert_model_parallel_size": "EP",
    "expert_tensor_parallel_size": "ETP", "context_parallel_size": "CP",
    "virtual_pipeline_model_parallel_size": "VPP", "num_layers_per_virtual_pipeline_stage": "VPP",
    "num_virtual_stages_per_pipeline_rank": "VPP", "world_size": "world",
}


def validate_sizes(args: Any) -> None:
    """Raise a usage error naming the flag when a size in ``args`` (Megatron names) is not a positive integer: where
    sizes enter (the run's flags, YAML, the live args, a reshard target), before anything divides by them."""
    for name, letter in SIZE_ARGS.items():
        value = _int(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise PreflightError(f"the {letter} size must be a positive integer, got {value} ({flag})",
                                 fix=f"pass an integer >= 1 to {flag} (or leave it out)", code="usage")


def from_args(args: Any, **override: Any) -> ParallelLayout:
    """THE builder: the layout a Megatron run with ``args`` uses. ``args`` is a Megatron ``Namespace``, a mapping of
    Megatron arg names, or anything with those attributes (saved args, ``RuntimeArgs``). ``override`` replaces the
    named args (Megatron names) before anything is derived."""
    if override:
        base = dict(vars(args)) if hasattr(args, "__dict__") and not isinstance(args, Mapping) else dict(args or {})
        base.update(override)
        args = base
    validate_sizes(args)
    pp = _int(args, "pipeline_model_parallel_size", 1)
    experts = _int(args, "num_experts")
    pattern = hybrid_pattern(args)
    num_layers = _int(args, "num_layers") if pattern is None else len(hybrid_layers(pattern))  # as validate_args
    return ParallelLayout(
        tp=_int(args, "tensor_model_parallel_size", 1),
        pp=pp,
        ep=_int(args, "expert_model_parallel_size", 1),
        etp=_int(args, "expert_tensor_parallel_size"),
        vpp=derive_vpp(args),
        cp=_int(args, "context_parallel_size", 1),
        order=TP_PP_DP_ORDER if _get(args, "use_tp_pp_dp_mapping") else DEFAULT_ORDER,
        num_layers=num_layers,
        num_experts=experts or None,
        first_stage_layers=_int(args, "decoder_first_pipeline_num_layers"),
        last_stage_layers=_int(args, "decoder_last_pipeline_num_layers"),
        embedding_in_split=bool(_get(args, "account_for_embedding_in_pipeline_split")),
        loss_in_split=bool(_get(args, "account_for_loss_in_pipeline_split")),
        pipeline_layout=_get(args, "pipeline_model_parallel_layout"),
        hybrid_pattern=pattern,
    )


def gtp_sizes(args: Any, tp: int, etp: int) -> tuple[int, int]:
    """(GTP, expert GTP): the weight-shard counts over TP (``--tensor-parallel-num-weight-shards`` / TP; 1 without)."""
    get = args.get if isinstance(args, dict) else (lambda k: getattr(args, k, None))
    shards, expert = get("tensor_parallel_num_weight_shards"), get("expert_tensor_parallel_num_weight_shards")
    return (int(shards) // tp if isinstance(shards, int) and shards > tp else 1,
            int(expert) // etp if isinstance(expert, int) and expert > etp else 1)
