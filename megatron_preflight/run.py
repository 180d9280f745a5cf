"""Launcher that needs no edit of the training script:

    torchrun --nproc-per-node 8 -m megatron_preflight.run pretrain_gpt.py <args> --preflight auto
    python -m megatron_preflight.run pretrain_gpt.py <args>

It installs the hook, then runs the script as ``__main__`` (its directory first on ``sys.path``, as Python does).
"""

from __future__ import annotations

import os
import runpy
import sys

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook.install import install


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"megatron-preflight: {script}: no such training script. Fix: pass the path of pretrain_gpt.py "
              "(or your own training script) first.", file=sys.stderr)
        sys.exit(2)
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, script_dir)
    sys.argv = [script] + argv[1:]
    try:
        install()
    except PreflightError as exc:
        print(f"megatron-preflight: {exc}", file=sys.stderr)
        sys.exit(1)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
