"""``megatron-preflight fingerprint CKPT [--iteration N] [--weights-only]``: layout-independent digests of every global
tensor, stored beside the checkpoint (``<root>/megatron_preflight_fingerprints/iter_NNNNNNN.json``)."""

from __future__ import annotations

import argparse


def _run(ns: argparse.Namespace) -> int:
    from megatron_preflight.prove import fingerprint  # reads tensors with torch: only when fingerprinting

    doc = fingerprint.fingerprint_checkpoint(ns.path, iteration=ns.iteration, trust=ns.trust_checkpoint,
                                             weights_only=ns.weights_only)
    path = fingerprint.store(ns.path, doc["iteration"], doc)
    print(f"{len(doc['tensors'])} tensors fingerprinted: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("fingerprint", help="store layout-independent digests of every global tensor beside the "
                                           "checkpoint (what --preflight verify compares a loaded run with)")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("path", help="the checkpoint root (a --save / --load dir)")
    p.add_argument("--iteration", help="iteration (default: the tracker's)")
    p.add_argument("--weights-only", action="store_true", help="the model only, not the optimizer state")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled types outside the allow-list")
