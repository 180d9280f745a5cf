"""``megatron-preflight diff A B [--json] [--weights-only] [--atol X --rtol Y]``: exit 0 equal, 1 different."""

from __future__ import annotations

import argparse
import json


def _run(ns: argparse.Namespace) -> int:
    from megatron_preflight.prove.diff import diff_checkpoints  # reads tensors with torch: only when diffing

    report = diff_checkpoints(ns.a, ns.b, weights_only=ns.weights_only, atol=ns.atol, rtol=ns.rtol,
                              iteration_a=ns.iteration_a, iteration_b=ns.iteration_b, trust=ns.trust_checkpoint,
                              workers=ns.workers)
    print(json.dumps(report.to_json(), indent=1) if ns.json else report.render())
    return 0 if report.equal else 1


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("diff", help="compare two checkpoints by global tensor content (any layouts and formats)",
                       description="Weights and the optimizer state in model space (fp32 masters, moments, step), "
                                   "vocab padding rows excluded; exit 0 equal, 1 different.")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("a", help="a checkpoint root (a --save / --load dir)")
    p.add_argument("b", help="the checkpoint to compare it with")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--weights-only", action="store_true", help="compare the model only, not the optimizer state")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit for bit)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit for bit)")
    p.add_argument("--iteration-a", help="iteration of a (default: its tracker's)")
    p.add_argument("--iteration-b", help="iteration of b (default: its tracker's)")
    p.add_argument("--workers", type=int, default=2, help="tensor pairs compared at a time (threads; default 2)")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled types outside the allow-list")
