"""The layouts of N ranks for a checkpoint, each with its per-rank memory and what loading the checkpoint there takes,
ranked by one rule:

1. it fits the device with a margin (the largest rank at most :data:`MARGIN` of ``--device-memory``; without a
   device size every layout counts as fitting);
2. less resharding: Megatron loads the checkpoint as saved (the same TP, PP, EP, ETP, VPP and stage placement: only
   DP or CP change) < Megatron's dist loader reshards it (torch_dist, its optimizer state in a form Megatron reads at
   another layout) < megatron-preflight reshards it at load (``--preflight auto``);
3. less model-parallel communication: smaller TP (all-reduces every layer), then CP, then PP (bubbles), then EP and
   ETP (all-to-all);
4. less memory on the largest rank.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.check.memory import GIB, RankMemory
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.errors import PreflightError
from megatron_preflight.fit import space
from megatron_preflight.fit.memory import stage_memory, vocab_rows
from megatron_preflight.fit.profile import ModelProfile
from megatron_preflight.layout.model import Format, Layout
from megatron_preflight.parallel import ParallelLayout

MARGIN = 0.9  # a layout fits when its largest rank needs at most this share of the device


class Load(str, enum.Enum):
    """How the checkpoint loads at a layout (in rule 2's order)."""

    AS_SAVED = "as saved"
    MEGATRON_RESHARDS = "Megatron reshards"
    PREFLIGHT_RESHARDS = "preflight reshards"


LOAD_ORDER = {Load.AS_SAVED: 0, Load.MEGATRON_RESHARDS: 1, Load.PREFLIGHT_RESHARDS: 2}


@dataclass
class Candidate:
    """One layout of the world, evaluated."""

    layout: ParallelLayout
    world: int
    worst: RankMemory  # the rank that needs the most memory
    load: Load
    vocab_exact: bool = True
    fits: bool | None = None  # None: no device size given
    checked: dict[str, Any] | None = None  # the full check of this layout's flags (verdict, loader, cost), when run
    flags: list[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return self.world // (self.layout.tp * self.layout.pp * self.layout.cp)

    def key(self) -> tuple:
        lay = self.layout
        return (self.fits is False, LOAD_ORDER[self.load], lay.tp, lay.cp, lay.pp, lay.ep, lay.etp_eff,
                lay.vpp is not None, self.worst.total)

    def describe(self) -> str:
        return describe(self.layout, self.world)

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.etp_eff,
                "dp": self.dp, "decoder_first_pipeline_num_layers": lay.first_stage_layers,
                "decoder_last_pipeline_num_layers": lay.last_stage_layers, "load": self.load.value,
                "fits": self.fits, "memory": self.worst.to_json(), "vocab_exact": self.vocab_exact,
                "flags": self.flags, "check": self.checked}


def load_of(layout: Layout, saved: ParallelLayout, cand: ParallelLayout, *, load_optimizer: bool,
            fsdp_run: bool = False, same_vocab: bool = True) -> Load:
    """How the checkpoint loads at ``cand`` (rule 2 of the module doc): as saved when every weight sits where it was
    saved, else by format and optimizer form. Megatron-FSDP loads its fsdp_dtensor at any TP/EP/DP, but only at the
    saved vocab padding (``same_vocab``: check/compare.py)."""
    same = (saved.tp, saved.pp, saved.ep if saved.num_experts else 1, saved.etp_eff if saved.num_experts else 1) == \
        (cand.tp, cand.pp, cand.ep, cand.etp_eff if cand.num_experts else 1) and saved.vpp == cand.vpp
    if same:
        try:
            same = saved.chunk_layer_counts() == cand.chunk_layer_counts()
        except PreflightError:  # a placement that cannot be compared is a move
            same = False
    fmt = layout.format
    if fmt == Format.HF:
        return Load.PREFLIGHT_RESHARDS  # Megatron reads no Hugging Face model at any layout
    if fmt == Format.FSDP_DTENSOR:
        if fsdp_run and same_vocab:
            return Load.AS_SAVED if same else Load.MEGATRON_RESHARDS
        return Load.PREFLIGHT_RESHARDS  # a 3D-parallel run reads it through the resharder only
    if same:
        return Load.AS_SAVED
    if fmt == Format.TORCH_DIST and not (load_optimizer and layout.dist_optimizer_sharding == "dp_reshardable"):
        return Load.MEGATRON_RESHARDS
    return Load.PREFLIGHT_RESHARDS


def evaluate(profile: ModelProfile, view: Layout, layout: Layout, rt: RuntimeArgs, world: int, gpus_per_node: int,
             device_gib: float | None) -> list[Candidate]:
    """Every layout of ``world`` ranks (:func:`space.layouts`), evaluated and ranked (see the module doc)."""
    out = []
    rows_cache: dict[int, tuple[int, bool]] = {}
    load_optimizer = not rt.no_load_optim
    for lay in space.layouts(profile, rt, world, gpus_per_node):
        if not space.batch_ok(rt, lay, world):
            continue
        if lay.tp not in rows_cache:
            rows_cache[lay.tp] = vocab_rows(profile, view, lay, rt)
        rows, exact = rows_cache[lay.tp]
        stages = stage_memory(profile, lay, rt, world, rows)
        worst = max(stages, key=lambda m: m.total)
        fits = None if device_gib is None else worst.total <= MARGIN * device_gib * GIB
        load = load_of(layout, profile.source, lay, load_optimizer=load_optimizer, fsdp_run=rt.use_megatron_fsdp,
                       same_vocab=not profile.padded_vocab or rows == profile.padded_vocab)
        out.append(Candidate(lay, world, worst, load, exact, fits))
    out.sort(key=Candidate.key)
    return out


def describe(lay: ParallelLayout, world: int) -> str:
    """``TP2 CP1 PP4 [VPP2] [EP8 ETP1] DP16``: a layout of ``world`` ranks as the reports name it."""
    text = f"TP{lay.tp} CP{lay.cp} PP{lay.pp}"
    if lay.vpp:
        text += f" VPP{lay.vpp}"
    if lay.num_experts:
        text += f" EP{lay.ep} ETP{lay.etp_eff}"
    return text + f" DP{world // (lay.tp * lay.pp * lay.cp)}"


def distance(a: ParallelLayout, run: ParallelLayout) -> tuple[int, float]:
    """How far layout ``a`` is from the run's: the sizes changed, then the changes' factors summed."""
    pairs = [(a.tp, run.tp), (a.pp, run.pp), (a.cp, run.cp), (a.ep, run.ep), (a.etp_eff, run.etp_eff),
             (a.vpp or 1, run.vpp or 1)]
    return sum(1 for x, y in pairs if x != y), sum(max(x, y) / min(x, y) for x, y in pairs if x != y)


def nearest(cands: Iterable[Candidate], run: ParallelLayout, count: int = 3) -> list[Candidate]:
    """The fitting layouts closest to the run's: fewest sizes changed, then the smallest changes (by factor)."""
    fitting = [c for c in cands if c.fits is not False]
    return sorted(fitting, key=lambda c: (*distance(c.layout, run), c.key()))[:count]


def with_sizes(rt: RuntimeArgs, lay: ParallelLayout, world: int) -> RuntimeArgs:
    """The run's args at layout ``lay`` on ``world`` ranks."""
    per_virtual = None
    if lay.vpp:
        per_virtual = rt.num_layers_per_virtual_pipeline_stage
    return dataclasses.replace(
        rt, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp if lay.num_experts else None,
        context_parallel_size=lay.cp, virtual_pipeline_model_parallel_size=lay.vpp,
        num_layers_per_virtual_pipeline_stage=per_virtual, num_virtual_stages_per_pipeline_rank=None,
        decoder_first_pipeline_num_layers=lay.first_stage_layers,
        decoder_last_pipeline_num_layers=lay.last_stage_layers,
        account_for_embedding_in_pipeline_split=lay.embedding_in_split,
        account_for_loss_in_pipeline_split=lay.loss_in_split, pipeline_model_parallel_layout=None,
        hybrid_layer_pattern=lay.hybrid_pattern if lay.hybrid_pattern is not None else rt.hybrid_layer_pattern,
        world_size=world, padded_vocab_size=None, given=set(rt.given) | {"world_size"}).derive()
