"""``megatron-preflight inspect CKPT [--json] [--all-shards]``."""

from __future__ import annotations

import argparse

from megatron_preflight.cli.common import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, add_shards_flag, to_json_text


def _run(ns: argparse.Namespace) -> int:
    # loaded when inspect runs
    from megatron_preflight.check.report import render_layout
    from megatron_preflight.reshard import open_index

    index = open_index(ns.path, iteration=ns.iteration, trust_checkpoint=ns.trust_checkpoint,
                       shards="all" if ns.all_shards else "auto")
    layout = index.layout
    if ns.json:
        print(to_json_text(layout.to_json(), len(layout.shards)))
    else:
        print(render_layout(index))
    if any(p.code == "usage" for p in layout.problems):
        return EXIT_USAGE
    return EXIT_OK if layout.ok else EXIT_PROBLEMS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: format, iteration, TP/PP/EP, shards, problems")
    p.add_argument("path", help="the checkpoint root (the --load dir) or one iteration dir")
    p.add_argument("--iteration", help="iteration to inspect (default: the tracker's)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    add_shards_flag(p)
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled types outside the allow-list (runs code from the file: only for files you trust)")
    p.set_defaults(func=_run)
