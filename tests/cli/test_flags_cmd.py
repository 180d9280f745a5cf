"""``megatron-preflight flags``: the model flags of an HF model (and of a Megatron checkpoint's saved args); an HF
model Megatron cannot express is one paragraph and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import fixture_path

hf_models = pytest.importorskip("tests.helpers.hf_models")
pytest.importorskip("transformers")


def flags(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_preflight", "flags", *argv], capture_output=True, text=True,
                          timeout=120)


def test_an_hf_models_flags_as_a_launch_script_holds_them(tmp_path):
    path = hf_models.write("qwen3_moe", str(tmp_path / "m"))
    done = flags(path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# Qwen3MoeForCausalLM") and f"--load {path} --preflight auto" in lines[0]
    body = [line.rstrip(" \\") for line in lines[1:]]
    for expected in ("--num-layers 2", "--qk-layernorm", "--num-experts 4", "--moe-ffn-hidden-size 48",
                     "--norm-epsilon 1e-06", "--disable-bias-linear", "--swiglu", "--normalization RMSNorm"):
        assert expected in body
    doc = json.loads(flags(path, "--json").stdout)
    assert doc["format"] == "hf" and doc["flags"] == body


def test_a_megatron_checkpoints_saved_model_flags():
    done = flags(fixture_path("bf16_gqa_tp2_torch"))
    assert done.returncode == 0 and "--bf16" in done.stdout and "--num-query-groups 2" in done.stdout


def test_an_unsupported_model_is_one_paragraph(tmp_path):
    path = hf_models.write("llama", str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as fh:
        raw = json.load(fh)
    raw["architectures"] = ["PhiForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(raw, fh)
    done = flags(path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "PhiForCausalLM" in done.stderr and "LlamaForCausalLM" in done.stderr
