"""``megatron-preflight flags CKPT``: the ``pretrain_gpt.py`` model flags that build a checkpoint's model (a Hugging
Face model's from its config.json; a Megatron checkpoint's from its saved args), to copy into a launch script."""

from __future__ import annotations

import argparse
import json

from megatron_preflight.cli.common import EXIT_OK, EXIT_PROBLEMS
from megatron_preflight.errors import PreflightError
from megatron_preflight.layout.model import Format


def _run(ns: argparse.Namespace) -> int:
    # loaded when flags runs (the CLI's parser loads none of a subcommand's work)
    from megatron_preflight.check.hf_model import model_flags, tokenizer_flags
    from megatron_preflight.reshard import open_index

    layout = open_index(ns.path, trust_checkpoint=ns.trust_checkpoint, shards="sample").layout
    fatal = [p for p in layout.problems if p.code not in ("no_tracker", "bad_tracker")]
    if layout.saved_args is None or (layout.format == Format.HF and fatal):
        p = fatal[0] if fatal else None
        raise PreflightError(p.message if p else "the checkpoint carries no saved args to take the model flags from",
                             path=p.path if p else layout.path,
                             fix=(p.fix if p else "") or "run `megatron-preflight inspect` on it", code="checkpoint")
    flags = model_flags(layout.saved_args) + tokenizer_flags(layout)
    saved = layout.saved_args
    hybrid = getattr(saved, "hybrid_layer_pattern", None) or getattr(saved, "hybrid_override_pattern", None)
    script = "pretrain_hybrid.py" if hybrid else "pretrain_gpt.py"
    if ns.json:
        print(json.dumps({"path": layout.path, "format": layout.format.value if layout.format else None,
                          "script": script, "flags": flags}, indent=1))
        return EXIT_OK
    if layout.format == Format.HF:
        print(f"# {saved.hf_architecture}: run {script} with these flags and --load {layout.path} --preflight auto "
              "(weights only, iteration 0)")
    else:
        print(f"# run {script} with these flags")
    print(" \\\n".join(flags))
    return EXIT_OK if not fatal else EXIT_PROBLEMS


def add_parser(sub: argparse._SubParsersAction, *, arguments: bool = True) -> None:
    p = sub.add_parser("flags", help="the pretrain_gpt.py model flags that build a checkpoint's model (a Hugging "
                                     "Face model's from its config.json)")
    p.set_defaults(func=_run)
    if not arguments:  # another subcommand runs: the top-level help lists this one by name and help
        return
    p.add_argument("path", help="a Hugging Face model dir, or a Megatron checkpoint root")
    p.add_argument("--json", action="store_true", help="print a JSON object with the flags")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled types outside the allow-list (runs code from the file: only for files you trust)")
