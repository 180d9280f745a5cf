"""When the run's layout does not fit (memory, world size, divisibility), the layouts of its world size nearest to it
that do: named in ``check``'s finding with their flags. Advice only: nothing changes the run's layout."""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from typing import Any

from megatron_preflight.check import advice
from megatron_preflight.check.findings import Finding, first_layout_problem
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.fit import space
from megatron_preflight.fit.choose import describe, distance, evaluate, nearest, with_sizes
from megatron_preflight.fit.profile import profile_of
from megatron_preflight.parallel import ParallelLayout, hybrid_pattern
from megatron_preflight.units import human_bytes

log = logging.getLogger(__name__)
GPUS_PER_NODE = 8  # TP stays inside a node of this many GPUs (the plan command takes the real number)



def _run_layout(rt: RuntimeArgs) -> ParallelLayout:
    return ParallelLayout(tp=rt.tp, pp=rt.pp, ep=rt.ep, etp=rt.expert_tensor_parallel_size, cp=rt.cp,
                          vpp=rt.vpp if rt.vpp and rt.vpp > 1 else None)


def nearest_text(index: Any, rt: RuntimeArgs, count: int = 3) -> str | None:
    """The sentence naming the ``count`` fitting layouts of the run's world size nearest to its layout, or None (no
    world size given, or none fits)."""
    world = rt.world_size
    if not world or index.layout.format is None:
        return None
    try:
        profile = profile_of(index)
        cands = evaluate(profile, index.view, index.layout, rt, world, GPUS_PER_NODE, rt.preflight_device_memory)
    except Exception as exc:  # noqa: BLE001 - advice: it never blocks or changes a verdict
        log.debug("nearest layouts not computed: %s", exc)
        return None
    picks = nearest(cands, _run_layout(rt), count)
    if not picks:
        if not cands:
            return None
        least = min(cands, key=lambda c: c.worst.total)
        return (f"no layout of {world} GPUs fits the device: the one with the least memory per rank, "
                f"{least.describe()}, needs {human_bytes(least.worst.total)} on its largest rank; more GPUs")
    parts = [f"{c.describe()} ({c.load.value}; largest rank {human_bytes(c.worst.total)}): "
             f"{shlex.join(advice.size_flags(with_sizes(rt, c.layout, world)))}" for c in picks]
    memory = " that fit the device" if rt.preflight_device_memory else ""
    root = index.layout.root or index.layout.path
    command = shlex.join(["megatron-preflight", "plan", root, "--world-size", str(world)])
    return (f"the layouts of {world} GPUs{memory} nearest to the run's, each as the layout flags that replace the "
            f"run's ({command} lists and ranks every one): " + "; ".join(parts))


def annotate(findings: list[Finding], index: Any, rt: RuntimeArgs) -> None:
    """Add the nearest fitting layouts to the fix of the first fatal layout finding (see
    :func:`~megatron_preflight.check.findings.first_layout_problem`)."""
    first = first_layout_problem(findings)
    if first is None:
        return
    text = nearest_text(index, rt)
    if text:
        first.fix = f"{first.fix.rstrip('. ')}; or {text}" if first.fix else text


@dataclass(frozen=True)
class _ArgsShape:
    """What :func:`~megatron_preflight.fit.space.layouts` asks of a model, from the run's args alone (no checkpoint
    read): its layer and expert counts and hybrid pattern; the TP splits are the heads, query groups and ffn, which
    :func:`~megatron_preflight.parallel.fit_problems` checks from the same args."""

    source: ParallelLayout
    num_layers: int

    def tp_gcd(self) -> int:
        return 0

    def etp_gcd(self) -> int:
        return 0


def layouts_by_args(rt: RuntimeArgs, world: int, gpus_per_node: int = GPUS_PER_NODE) -> list[ParallelLayout]:
    """Every layout of ``world`` ranks the run's model (its args: heads, groups, ffn, layers, experts, sequence,
    batch) can have, by Megatron's rules (fit/space.py), nearest to the run's first: the fewest sizes changed, then
    the smallest changes. No checkpoint is read and no memory is predicted (``megatron-preflight plan`` does both)."""
    if not world or not rt.num_layers:
        return []
    shape = _ArgsShape(ParallelLayout(num_experts=rt.num_experts or None, hybrid_pattern=hybrid_pattern(rt)),
                       rt.num_layers)
    run = _run_layout(rt)
    found = [lay for lay in space.layouts(shape, rt, world, gpus_per_node)  # type: ignore[arg-type]
             if space.batch_ok(rt, lay, world)]
    return sorted(found, key=lambda a: (*distance(a, run), a.tp, a.cp, a.pp, a.ep))


def nearest_by_args_text(rt: RuntimeArgs, checkpoint: str | None, count: int = 3) -> str | None:
    """The sentence naming the ``count`` layouts of the run's world size nearest to its layout that its model can
    have (:func:`layouts_by_args`), each as the flags that replace the run's; None when none can."""
    world = rt.world_size
    picks = layouts_by_args(rt, world or 0)[:count]
    if not picks:
        return None
    parts = [f"{describe(lay, world)}: {shlex.join(advice.size_flags(with_sizes(rt, lay, world)))}" for lay in picks]
    where = (f" ({shlex.join(['megatron-preflight', 'plan', checkpoint, '--world-size', str(world)])} ranks every "
             "one by memory and by how the checkpoint loads)") if checkpoint else ""
    return f"the layouts of {world} GPUs nearest to the run's that its model can have{where}: " + "; ".join(parts)
