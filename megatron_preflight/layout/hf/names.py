"""The file names of a Hugging Face model dir, and the test that a dir is one: what layout discovery asks of every
``--load`` dir, without loading the model's readers (its config and family tables load only for such a dir)."""

from __future__ import annotations

import os

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SAFETENSORS = ".safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt")


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` holds a Hugging Face model with safetensors weights (config.json beside them)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    return CONFIG in entries and (INDEX in entries or any(e.endswith(SAFETENSORS) for e in entries))
