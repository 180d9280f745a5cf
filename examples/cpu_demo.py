"""End-to-end CPU demo with megatron-core only (no Megatron-LM, no GPU): a real GPT model at TP2 writes a legacy
checkpoint; a run at TP1 is checked (the one-screen report), each rank's state dict is built in memory by the
resharder, loaded strictly into a real TP1 model, and the logits are compared with the TP2 model's.

Run: .venv/bin/python examples/cpu_demo.py   (about a minute on 2 cores; uses the test helpers that make
megatron-core run on CPU under gloo)
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from megatron_preflight.check.plan import make_plan
    from megatron_preflight.check.report import render_plan
    from megatron_preflight.check.runtime_args import from_cli
    from tests.helpers.mcore_models import Layout, ModelSpec
    from tests.helpers.pool import Pool

    spec = ModelSpec(query_groups=2, swiglu=True, bias=False)  # GQA + SwiGLU: the split rules that bite
    pool = Pool(world=2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            legacy, dist = os.path.join(tmp, "legacy"), os.path.join(tmp, "dist")
            logits_tp2 = pool.run("tests.helpers.tasks:write_both", spec=asdict(spec), layout=asdict(Layout(tp=2)),
                                  legacy_root=legacy, dist_root=dist)[0]
            print(f"wrote a TP2 legacy checkpoint to {legacy}\n")
            flags = ("--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
                     "--group-query-attention --num-query-groups 2 --swiglu --disable-bias-linear "
                     "--max-position-embeddings 16 --vocab-size 100 --make-vocab-size-divisible-by 16 "
                     "--transformer-impl local --tensor-model-parallel-size 1 --no-load-optim --world-size 2").split()
            print(render_plan(make_plan(legacy, from_cli(flags))), "\n")
            out = pool.run("tests.helpers.tasks:reshard_and_compare", spec=asdict(spec), layout=asdict(Layout(tp=1)),
                           legacy_root=legacy, dist_root=dist)
            diff = (out[0]["logits"] - logits_tp2).abs().max().item()
            ref = out[0]["max_tensor_diff"]
            print(f"TP1 model loaded (strict) from the in-memory reshard: max |logits(TP1) - logits(TP2)| = {diff:.2e}; "
                  f"max tensor difference to megatron-core's own torch_dist reshard = {ref:.1e}")
            return 0 if diff <= 1e-5 and ref == 0.0 else 1
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(main())
