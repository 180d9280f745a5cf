"""The tokenizer's files, checked at job start by --tokenizer-type."""

import pytest

from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.tokenizer import tokenizer_findings


def findings(*flags):
    return tokenizer_findings(from_cli(list(flags)))


def test_gpt2_bpe_needs_both_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("{}")
    merges.write_text("")
    assert findings("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file",
                    str(merges)) == []
    f, = findings("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab))
    assert f.severity.value == "fatal" and "--merge-file" in f.message
    f, = findings("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "nope.json"),
                  "--merge-file", str(merges))
    assert "does not exist" in f.message and "nope.json" in f.message


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                  "TikTokenizer"])
def test_model_file_tokenizers(tmp_path, kind):
    model = tmp_path / "tok.model"
    model.write_bytes(b"x")
    assert findings("--tokenizer-type", kind, "--tokenizer-model", str(model)) == []
    f, = findings("--tokenizer-type", kind, "--tokenizer-model", str(tmp_path))
    assert "is not a file" in f.message
    f, = findings("--tokenizer-type", kind)
    assert "needs --tokenizer-model" in f.message


def test_huggingface_paths_and_hub_names(tmp_path, monkeypatch):
    f, = findings("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path))
    assert f.severity.value == "fatal" and "holds no tokenizer files" in f.message  # (an empty dir: AutoTokenizer fails)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert findings("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)) == []
    f, = findings("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "missing"))
    assert f.severity.value == "fatal"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert findings("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-3-8B") == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    f, = findings("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-3-8B")
    assert f.severity.value == "info" and "HF_HUB_OFFLINE" in f.message


def test_null_tokenizer_needs_a_vocab_size():
    assert findings("--tokenizer-type", "NullTokenizer", "--vocab-size", "100") == []
    f, = findings("--tokenizer-type", "NullTokenizer")
    assert "--vocab-size" in f.message
