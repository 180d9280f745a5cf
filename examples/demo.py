"""The main job on built-in examples: inspect real Megatron-LM checkpoints, check a run's args against them, plan the
layouts of 8 GPUs for one, and reshard one offline; then a Hugging Face model as a checkpoint: the flags that build
it, the check of a run with them, its layouts, an offline conversion to a Megatron checkpoint and the export back.
Run with ``./scripts/demo.sh``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "megatron-lm")
HF_LLAMA = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "hf", "llama")
CLI = [sys.executable, "-m", "megatron_preflight"]


def run(*args: str) -> int:
    print(f"\n$ megatron-preflight {' '.join(args)}", flush=True)
    return subprocess.run(CLI + list(args)).returncode


def main() -> int:
    failures = 0
    for name in ("pp2_torch", "moe_ep2_torch", "tp2_torch_dist"):
        failures += run("inspect", os.path.join(FIXTURES, name)) != 0
    steps = os.environ.get("DEMO_STEPS", "check,reshard,hf").split(",")
    tiny = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
            "--max-position-embeddings", "32", "--seq-length", "32", "--vocab-size", "100",
            "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local"]
    if "check" in steps:
        # Same layout: loads as is. Another layout: reshard. Another architecture: fail, every field listed.
        failures += run("check", os.path.join(FIXTURES, "moe_ep2_torch"), "--", *tiny, "--num-experts", "4",
                        "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--world-size", "2") != 0
        failures += run("check", os.path.join(FIXTURES, "pp2_torch"), "--", *tiny, "--world-size", "1") != 0
        rc = run("check", os.path.join(FIXTURES, "tp2_torch"), "--", *tiny[:2], "--hidden-size", "64",
                 *tiny[4:], "--tensor-model-parallel-size", "2", "--world-size", "2")
        failures += rc != 1
        # Which layouts of 8 GPUs hold the MoE example, ranked, with the run's flags at each (the top 3 checked).
        failures += run("plan", os.path.join(FIXTURES, "moe_ep2_torch"), "--world-size", "8", "--top", "5", "--",
                        *tiny, "--num-experts", "4", "--micro-batch-size", "1", "--global-batch-size", "16") != 0
    if "reshard" in steps:
        with tempfile.TemporaryDirectory() as tmp:
            dst = os.path.join(tmp, "tp1")
            # Weights and the Adam state (exp_avg, exp_avg_sq), every tensor checked against its source slices.
            failures += run("reshard", os.path.join(FIXTURES, "tp2_torch"), dst,
                            "--tensor-model-parallel-size", "1", "--verify") != 0
            failures += run("inspect", dst) != 0
    if "hf" in steps:
        failures += hf_path()
    print(f"\ndemo finished: {'OK' if not failures else f'{failures} step(s) did not behave as expected'}")
    return 1 if failures else 0


def hf_path() -> int:
    """A Hugging Face model (a tiny Llama, tests/fixtures/hf/llama) from its dir to a Megatron checkpoint and back."""
    failures = run("flags", HF_LLAMA) != 0
    done = subprocess.run(CLI + ["flags", HF_LLAMA, "--json"], capture_output=True, text=True)
    model = [w for flag in json.loads(done.stdout)["flags"] for w in shlex.split(flag)]
    run_flags = [*model, "--seq-length", "64", "--tensor-model-parallel-size", "2", "--world-size", "2"]
    # The job would start from it with: torchrun ... -m megatron_preflight.run pretrain_gpt.py <flags> --load DIR
    # --preflight auto (each rank builds its weights from the safetensors); check says so first.
    failures += run("check", HF_LLAMA, "--", *run_flags) != 0
    failures += run("plan", HF_LLAMA, "--world-size", "4", "--top", "3", "--", *model, "--seq-length", "64") != 0
    with tempfile.TemporaryDirectory() as tmp:
        megatron = os.path.join(tmp, "llama_tp2")
        failures += run("reshard", HF_LLAMA, megatron, "--tensor-model-parallel-size", "2", "--ckpt-format",
                        "torch_dist", "--no-progress") != 0
        back = os.path.join(tmp, "llama_hf")
        failures += run("reshard", megatron, back, "--ckpt-format", "hf", "--no-progress") != 0
        failures += run("diff", HF_LLAMA, back) != 0
    return failures


if __name__ == "__main__":
    sys.exit(main())
