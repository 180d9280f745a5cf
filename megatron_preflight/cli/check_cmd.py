"""``megatron-preflight check CKPT [--json] [--config F] -- <pretrain_gpt.py flags>``."""

from __future__ import annotations

import argparse

from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.report import render_plan
from megatron_preflight.check.runtime_args import from_cli, from_yaml
from megatron_preflight.cli.common import add_shards_flag, to_json_text


def _run(ns: argparse.Namespace) -> int:
    if ns.config:
        rt = from_yaml(ns.config, ns.megatron_args)
    else:
        rt = from_cli(ns.megatron_args)
    plan = make_plan(ns.path, rt, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                     shards="all" if ns.all_shards else "auto")
    if ns.json:
        print(to_json_text(plan.to_json(), len(plan.layout.shards)))
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
    add_shards_flag(p)
    p.set_defaults(func=_run)
