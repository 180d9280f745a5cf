"""``megatron-preflight check CKPT [--json] [--config F] -- <pretrain_gpt.py flags>``."""

from __future__ import annotations

import argparse
import json

from megatron_preflight.check.plan import Plan, Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli, from_yaml


def render_plan(plan: Plan) -> str:
    from megatron_preflight.cli.render import render_layout

    lines = [render_layout(plan.layout, max_shards=8), ""]
    if plan.findings:
        lines.append(f"{'severity':<8} {'field':<38} {'checkpoint':>14} {'run':>14}")
        for f in plan.findings:
            ck = "-" if f.checkpoint is None else str(f.checkpoint)
            run = "-" if f.runtime is None else str(f.runtime)
            lines.append(f"{f.severity.value:<8} {f.field:<38} {ck[:14]:>14} {run[:14]:>14}")
            lines.append(f"         {f.message}")
            if f.fix:
                lines.append(f"         fix: {f.fix}")
    else:
        lines.append("no differences: the run matches the checkpoint")
    lines.append("")
    lines.append(f"loader      {plan.loader.value if plan.loader else '-'}")
    lines.append(f"optimizer   {'load' if plan.load_optimizer else 'not loaded'};  "
                 f"rng {'load' if plan.load_rng else 'not loaded'}")
    n_fatal = len(plan.fatal)
    word = {Verdict.LOAD: "LOAD: the job may start; the checkpoint loads as is",
            Verdict.RESHARD: "RESHARD: the job may start with --preflight auto (in-memory reshard) or after an "
                             "offline `megatron-preflight reshard`",
            Verdict.FAIL: f"FAIL: the job must not start ({n_fatal} fatal finding{'s' if n_fatal != 1 else ''})"}
    lines.append(f"verdict     {word[plan.verdict]}   [{plan.seconds * 1000:.0f} ms]")
    return "\n".join(lines)


def _run(ns: argparse.Namespace) -> int:
    if ns.config:
        rt = from_yaml(ns.config, ns.megatron_args)
    else:
        rt = from_cli(ns.megatron_args)
    plan = make_plan(ns.path, rt, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint)
    if ns.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(render_plan(plan))
    return 1 if plan.verdict == Verdict.FAIL else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="compare a run's args with a checkpoint; verdict, loader, every finding",
                       description="Flags after `--` are the run's pretrain_gpt.py flags (unknown ones are ignored).")
    p.add_argument("path", help="the checkpoint root (the --load dir)")
    p.add_argument("--config", help="YAML file of Megatron arg names (flags after -- override it)")
    p.add_argument("--iteration", help="iteration to check (default: --ckpt-step, else the tracker's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled types outside the allow-list")
    p.set_defaults(func=_run)
