"""Which layout fits? The parallel layouts of N ranks for a checkpoint, from its metadata only.

:mod:`.profile` (the model's parameters by placement and split, read from one shard per stage) → :mod:`.space`
(every layout Megatron accepts for it on N ranks) → :mod:`.memory` (each rank's bytes: ``check``'s prediction) →
:mod:`.choose` (what loading takes there; the ranking rule) → :mod:`.flags` (each layout as the run's flags).
:func:`plan_layouts` ties them; ``megatron-preflight plan`` prints it and ``check`` names the nearest layouts that fit
when the run's does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight.check.runtime_args import RuntimeArgs, from_cli, from_mapping
from megatron_preflight.fit.choose import Candidate, evaluate, with_sizes
from megatron_preflight.fit.flags import LAYOUT_FIELDS, layout_argv
from megatron_preflight.fit.profile import ModelProfile, profile_of

__all__ = ["Candidate", "LayoutPlan", "plan_layouts", "run_args"]


@dataclass
class LayoutPlan:
    """The ranked layouts of ``world`` ranks for one checkpoint and run."""

    world: int
    gpus_per_node: int
    device_gib: float | None
    candidates: list[Candidate]
    profile: ModelProfile
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        shown = self.candidates if limit is None else self.candidates[:limit]
        return {"world_size": self.world, "gpus_per_node": self.gpus_per_node, "device_memory_gib": self.device_gib,
                "layouts": len(self.candidates), "fitting": sum(1 for c in self.candidates if c.fits is not False),
                "seconds": round(self.seconds, 4), "notes": self.notes, "candidates": [c.to_json() for c in shown]}


def run_args(saved_args: Any, argv: list[str]) -> RuntimeArgs:
    """The run to plan: its flags (``argv``), and for what they leave out the checkpoint's saved args (its model, its
    precision, its batch sizes) — never the saved layout sizes, which are what is planned."""
    given = from_cli(argv)
    values = {k: v for k, v in (vars(saved_args) if saved_args is not None else {}).items()
              if k not in LAYOUT_FIELDS}
    values.update({k: getattr(given, k) for k in given.given})
    rt = from_mapping(values)
    rt.given = set(given.given)
    return rt


def plan_layouts(index: Any, rt: RuntimeArgs, argv: list[str] | None, world: int, *, gpus_per_node: int = 8,
                 device_gib: float | None = None, flags_for: int | None = None) -> LayoutPlan:
    """Every layout of ``world`` ranks for the checkpoint ``index`` (a CheckpointIndex) and the run ``rt``, ranked;
    the first ``flags_for`` (None: all) with their flags (``argv``, the run's own flags, with the layout's sizes in
    place of its own)."""
    t0 = time.perf_counter()
    profile = profile_of(index)
    cands = evaluate(profile, index.view, index.layout, rt, world, gpus_per_node, device_gib)
    for c in cands[:flags_for]:
        c.flags = layout_argv(argv or [], with_sizes(rt, c.layout, world), moe=bool(profile.source.num_experts))
    plan = LayoutPlan(world, gpus_per_node, device_gib, cands, profile, time.perf_counter() - t0)
    if any(not c.vocab_exact for c in cands):
        plan.notes.append("the checkpoint does not record its true vocabulary size: at a TP that does not keep its "
                          "padding the embedding is counted padded again (an upper bound); pass the run's "
                          "--vocab-size after -- for the exact figure")
    return plan
