"""``megatron-preflight plan CKPT --world-size N [--gpus-per-node G] [--device-memory GIB] [--json] [-- <run flags>]``."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from megatron_preflight.cli.common import add_shards_flag, to_json_text
from megatron_preflight.errors import PreflightError
from megatron_preflight.units import human_bytes


def _release(rt: Any) -> None:
    """What the megatron-core installed here does differently (as ``check`` judges it: the layouts agree)."""
    from megatron_preflight.check import releases  # (a small table)

    version = releases.installed_version()
    if version is not None:
        releases.apply(rt, releases.facts(version))


def _check_top(plan: Any, index: Any, count: int) -> None:
    """The full check of the top layouts' flags, as the run would be checked at job start: verdict, loader, and the
    in-memory reshard's cost."""
    from megatron_preflight.check.plan import plan_from_layout  # the check's modules load when it runs
    from megatron_preflight.check.runtime_args import from_cli  # (likewise)

    for c in plan.candidates[:count]:
        rt = from_cli([*c.flags, "--world-size", str(plan.world)])
        _release(rt)
        p = plan_from_layout(index, rt)
        first = p.fatal[0] if p.fatal else None
        c.checked = {"verdict": p.verdict.value, "loader": p.loader.value if p.loader else None,
                     "cost": p.cost.render() if p.cost is not None else None,
                     "fatal": f"{first.field}: {first.message}" if first else None}


def render(plan: Any, path: str, limit: int, *, node_assumed: bool = False) -> str:
    lay = plan.profile.source
    saved = f"TP{lay.tp} PP{lay.pp}" + (f" EP{lay.ep} ETP{lay.etp_eff}" if lay.num_experts else "") + \
        (f" VPP{lay.vpp}" if lay.vpp else "")
    fitting = sum(1 for c in plan.candidates if c.fits is not False)
    device = f"{plan.device_gib:g} GiB per GPU (fits: its largest rank within 90 %)" if plan.device_gib else \
        "no --device-memory given: every layout counts as fitting"
    lines = [f"checkpoint  {path} (saved at {saved}; {plan.profile.num_layers} layers"
             f"{f', {lay.num_experts} experts' if lay.num_experts else ''})",
             f"world       {plan.world} ranks; TP kept inside a node of {plan.gpus_per_node} GPUs"
             f"{' (assumed: --gpus-per-node sets it)' if node_assumed else ''}; {device}",
             f"layouts     {len(plan.candidates)} that Megatron accepts, {fitting} fit; ranked: fits, then less "
             "resharding, then smaller TP, CP, PP, EP, then less memory (docs/commands/plan.md)",
             ""]
    head = f"{'#':>3}  {'layout':<28} {'params':>10} {'grads':>10} {'optimizer':>10} {'activ.~':>10} {'total':>10}  " \
           f"{'fits':<4}  load"
    lines.append(head)
    unestimated = False
    for i, c in enumerate(plan.candidates[:limit], 1):
        m = c.worst
        acts = human_bytes(m.activations) if m.activations else "-"
        unestimated = unestimated or not m.activations
        fits = "-" if c.fits is None else ("yes" if c.fits else "no")
        load = c.load.value
        if c.checked:
            load += f"; check: {c.checked['verdict']}"
        lines.append(f"{i:>3}  {c.describe():<28} {human_bytes(m.params):>10} {human_bytes(m.grads):>10} "
                     f"{human_bytes(m.optimizer):>10} {acts:>10} {human_bytes(m.total):>10}  "
                     f"{fits:<4}  {load}")
    if not plan.candidates:
        lines.append("     (none: no layout of this world size holds the model; see the rules in docs/commands/plan.md)")
    lines += ["", "memory: the largest rank's bytes (parameters, gradients and optimizer state exact; activations an "
              "estimate, see check/memory.py)" + ("; activations '-': not estimated without the sequence length "
                                                  "(give the run's --seq-length and --micro-batch-size after --)"
                                                  if unestimated else ""),
              "", "flags (the run's flags at each layout):"]
    for i, c in enumerate(plan.candidates[:limit], 1):
        lines.append(f"{i:>3}  {shlex.join(c.flags)}")
        if c.checked and c.checked.get("fatal"):
            lines.append(f"     check: fail ({c.checked['fatal']})")
        elif c.checked and c.checked.get("cost"):
            lines.append(f"     {c.checked['cost']}")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"planned in {plan.seconds:.2f} s")
    return "\n".join(lines)


def _run(ns: argparse.Namespace) -> int:
    from megatron_preflight.fit import plan_layouts, run_args  # the planner's modules load when it runs
    from megatron_preflight.reshard import open_index  # (likewise)

    node_assumed = ns.gpus_per_node is None
    gpus_per_node = min(8, ns.world_size) if node_assumed else ns.gpus_per_node
    if ns.world_size < 1 or gpus_per_node < 1:
        raise PreflightError("--world-size and --gpus-per-node must be positive", fix="pass e.g. --world-size 64",
                             code="usage")
    if ns.device_memory is not None and not ns.device_memory > 0:  # (NaN too)
        raise PreflightError(f"--device-memory must be a positive number of GiB, got {ns.device_memory:g}",
                             fix="pass each GPU's memory, e.g. --device-memory 80", code="usage")
    index = open_index(ns.path, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                       shards="all" if ns.all_shards else "auto")
    layout = index.layout
    if layout.format is None:
        raise PreflightError(f"{ns.path} is not a Megatron checkpoint", path=ns.path,
                             fix="pass the --load dir of a Megatron-LM run (`megatron-preflight inspect` says what "
                                 "it holds)", code="usage")
    index.raise_problems()  # (a checkpoint that loads at no layout: nothing to plan)
    rt = run_args(layout.saved_args, ns.megatron_args)
    _release(rt)
    plan = plan_layouts(index, rt, ns.megatron_args, ns.world_size, gpus_per_node=gpus_per_node,
                        device_gib=ns.device_memory, flags_for=None if ns.all else ns.top)
    if ns.megatron_args and ns.check_top:
        _check_top(plan, index, ns.check_top)
    elif not ns.megatron_args:
        plan.notes.append("no run flags given: the model, precision and batch sizes are the checkpoint's saved args, "
                          "and each layout's flags are only its layout flags (give the run's flags after -- to have "
                          "the top layouts checked as the run)")
    if ns.json:
        print(to_json_text(plan.to_json(None if ns.all else ns.top), 0))
    else:
        print(render(plan, ns.path, len(plan.candidates) if ns.all else ns.top, node_assumed=node_assumed))
    return 0 if any(c.fits is not False for c in plan.candidates) else 1


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("plan", help="the parallel layouts of N GPUs that hold the checkpoint's model, ranked, with flags",
                       description="Flags after `--` are the run's pretrain_gpt.py flags (what they leave out: the "
                                   "checkpoint's saved args).")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("path", help="the checkpoint root (the --load dir)")
    p.add_argument("--world-size", type=int, required=True, help="the number of GPUs (ranks) of the run")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node: TP stays inside one (default: 8, or the world size when smaller)")
    p.add_argument("--device-memory", type=float, metavar="GIB", help="each GPU's memory in GiB (fit: within 90 %%)")
    p.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    p.add_argument("--all", action="store_true", help="show every layout")
    p.add_argument("--check-top", type=int, default=3, metavar="K",
                   help="run the full check of the top K layouts' flags (default 3; 0: none; needs the run's flags)")
    p.add_argument("--iteration", help="iteration to plan from (default: the tracker's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled types outside the allow-list")
    add_shards_flag(p)
