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
    assert lines[0].startswith("# Qwen3MoeForCausalLM: run pretrain_gpt.py") and \
        f"--load {path} --preflight auto" in lines[0]
    body = [line.rstrip(" \\") for line in lines[1:]]
    for expected in ("--num-layers 2", "--qk-layernorm", "--num-experts 4", "--moe-ffn-hidden-size 48",
                     "--norm-epsilon 1e-06", "--disable-bias-linear", "--swiglu", "--normalization RMSNorm"):
        assert expected in body
    doc = json.loads(flags(path, "--json").stdout)
    assert doc["format"] == "hf" and doc["flags"] == body and doc["script"] == "pretrain_gpt.py"


def test_a_megatron_checkpoints_saved_model_flags():
    done = flags(fixture_path("bf16_gqa_tp2_torch"))
    assert done.returncode == 0 and "--bf16" in done.stdout and "--num-query-groups 2" in done.stdout
    assert done.stdout.startswith("# run pretrain_gpt.py")


def test_a_hybrid_checkpoint_names_its_script_and_prints_only_what_its_model_has():
    doc = json.loads(flags(fixture_path("hyb_tp2_torch"), "--json").stdout)
    assert doc["script"] == "pretrain_hybrid.py"
    assert "--hybrid-layer-pattern MG*-E/*-" in doc["flags"] and "--linear-num-value-heads 4" in doc["flags"]
    assert not any(f.startswith(("--kv-lora-rank", "--rotary-base", "--mscale")) for f in doc["flags"])
    plain = json.loads(flags(fixture_path("bf16_gqa_tp2_torch"), "--json").stdout)["flags"]
    assert not any(f.startswith(("--spec", "--mamba", "--linear-", "--kv-lora-rank")) for f in plain)


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


def _check(path: str, run_flags: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_preflight", "check", path, "--", *run_flags],
                          capture_output=True, text=True, timeout=120)


def _printed(path: str) -> list[str]:
    return [w for line in flags(path).stdout.splitlines()[1:] for w in line.rstrip(" \\").split(" ", 1)]


def test_the_tokenizer_flags_printed_pass_check(tmp_path):
    """Without tokenizer files: NullTokenizer with the vocab size that gives the model's rows (its EOD id counted);
    with them: the model's own tokenizer. Either way `check` passes the printed flags as printed."""
    path = hf_models.write("llama", str(tmp_path / "m"))
    printed = _printed(path)
    assert printed[-4:] == ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]  # 128 rows
    done = _check(path, [*printed, "--seq-length", "16"])
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    printed = _printed(path)
    assert printed[-4:] == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path]


def test_a_tokenizer_too_big_for_the_model_is_answered_with_the_flags_that_work(tmp_path):
    path = hf_models.write("llama", str(tmp_path / "m"))
    model = [w for w in _printed(path) if w not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "127")]
    done = _check(path, [*model, "--seq-length", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
    assert done.returncode == 1
    assert "129 token ids" in done.stdout and "--tokenizer-type NullTokenizer --vocab-size 127" in done.stdout, \
        done.stdout
    assert "HuggingFaceTokenizer" not in done.stdout  # never a tokenizer dir without tokenizer files


def test_a_tokenizer_dir_without_tokenizer_files_is_caught(tmp_path):
    path = hf_models.write("llama", str(tmp_path / "m"))
    model = [w for w in _printed(path) if w not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "127")]
    done = _check(path, [*model, "--seq-length", "16", "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", path])
    assert done.returncode == 1 and "holds no tokenizer files" in done.stdout, done.stdout


@pytest.mark.parametrize("version, ids", [("0.17", 129), ("0.20", None)])
def test_null_tokenizer_ids_follow_the_release(tmp_path, version, ids):
    """NullTokenizer adds an end-of-document id up to megatron-core 0.17; from 0.18 its last id is the EOD (its
    --vocab-size ids, megatron/core/tokenizers/text/libraries/null_tokenizer.py): --vocab-size 128 on a 128-row model
    is too many ids for one release and exactly right for the other."""
    path = hf_models.write("llama", str(tmp_path / "m"))
    model = [w for w in _printed(path) if w not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "127")]
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "check", path, "--megatron-version", version,
                           "--", *model, "--seq-length", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                           "128"], capture_output=True, text=True, timeout=120)
    if ids is None:
        assert done.returncode == 0, done.stdout
    else:
        assert done.returncode == 1 and f"{ids} token ids" in done.stdout, done.stdout
