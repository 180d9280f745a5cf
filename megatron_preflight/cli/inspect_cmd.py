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
    content = None
    if ns.verify_content and layout.ok:
        from megatron_preflight.prove.content import check_content  # reads every tensor: only when asked

        content = check_content(ns.path, iteration=ns.iteration, trust=ns.trust_checkpoint)
    if ns.json:
        doc = layout.to_json()
        status = index.optimizer_status
        if status is not None:  # the same answer the text report and check give
            doc["optimizer"] = {"kind": status.kind, "reshardable": status.reshardable,
                                "in_memory": status.in_memory, "describe": status.describe()}
        if content is not None:
            doc["content"] = content.to_json()
        print(to_json_text(doc, len(layout.shards)))
    else:
        print(render_layout(index) + ("\n" + content.render() if content is not None else ""))
    if any(p.code == "usage" for p in layout.problems):
        return EXIT_USAGE
    return EXIT_OK if layout.ok and (content is None or content.ok) else EXIT_PROBLEMS


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: format, iteration, TP/PP/EP, shards, problems")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("path", help="the checkpoint root (the --load dir) or one iteration dir")
    p.add_argument("--iteration", help="iteration to inspect (default: the tracker's)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    add_shards_flag(p)
    p.add_argument("--verify-content", action="store_true",
                   help="read every tensor and compare it with the fingerprints stored beside the checkpoint (saved "
                        "by a job run with --preflight, or by `megatron-preflight fingerprint`); exit 1 naming each "
                        "tensor that differs, the shard file holding it and the likely cause")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled types outside the allow-list (runs code from the file: only for files you trust)")
