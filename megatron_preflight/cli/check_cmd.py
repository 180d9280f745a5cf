"""``megatron-preflight check CKPT [--json] [--config F] -- <pretrain_gpt.py flags>``."""

from __future__ import annotations

import argparse

from megatron_preflight.cli.common import add_shards_flag, to_json_text


def _run(ns: argparse.Namespace) -> int:
    # the check's modules load when it runs (the CLI's parser loads no subcommand's work)
    from megatron_preflight.check import releases
    from megatron_preflight.check.findings import Finding, Severity, first_layout_problem
    from megatron_preflight.check.plan import Verdict, make_plan
    from megatron_preflight.check.report import render_plan
    from megatron_preflight.check.runtime_args import from_cli, from_yaml

    if ns.config:
        rt = from_yaml(ns.config, ns.megatron_args)
    else:
        rt = from_cli(ns.megatron_args)
    version, source = (releases.parse_version(ns.megatron_version), "--megatron-version") if ns.megatron_version \
        else (releases.installed_version(), "the megatron-core installed here")
    if version is not None:
        releases.apply(rt, releases.facts(version))
    plan = make_plan(ns.path, rt, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                     shards="all" if ns.all_shards else "auto")
    if first_layout_problem(plan.findings):
        from megatron_preflight.fit.nearest import annotate  # the planner: only for a layout that cannot run

        annotate(plan.findings, plan.index, rt)  # a layout that cannot run: the nearest ones that can
    plan.findings.append(Finding(
        "megatron_version", None, f"{version[0]}.{version[1]} ({source})" if version else "unknown", Severity.INFO,
        "judged for what that release of megatron-core loads (optimizer forms, param-group pairing, MTP and expert "
        "naming)" if version else "no megatron-core here: what differs between releases is said as info",
        "" if ns.megatron_version else "--megatron-version MAJOR.MINOR to judge for the release that will load it"))
    if ns.json:
        print(to_json_text(plan.to_json(), len(plan.layout.shards)))
    else:
        print(render_plan(plan))
    return 1 if plan.verdict == Verdict.FAIL else 0


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("check", help="compare a run's args with a checkpoint; verdict, loader, every finding",
                       description="Flags after `--` are the run's pretrain_gpt.py flags (unknown ones are ignored).")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("path", help="the checkpoint root (the --load dir)")
    p.add_argument("--config", help="YAML file of Megatron arg names (flags after -- override it)")
    p.add_argument("--iteration", help="iteration to check (default: --ckpt-step, else the tracker's)")
    p.add_argument("--megatron-version", metavar="X.Y",
                   help="the megatron-core release that will load the checkpoint (default: the one installed here)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled types outside the allow-list")
    add_shards_flag(p)
