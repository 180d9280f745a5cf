"""Recognise directories that are not Megatron checkpoints, to say what they look like instead."""

from __future__ import annotations

import os


def looks_like(path: str) -> str:
    """A short description of what a non-Megatron directory appears to be."""
    try:
        entries = os.listdir(path)
    except OSError as exc:
        return f"an unreadable directory ({exc.strerror})"
    if not entries:
        return "an empty directory"
    names = set(entries)
    if "config.json" in names and any(
        e.endswith(".safetensors") or e.startswith("pytorch_model") or e.endswith(".safetensors.index.json")
        for e in entries
    ):
        return "a Hugging Face model directory (config.json + safetensors/pytorch_model weights)"
    if any(e.startswith("global_step") for e in entries) or "latest" in names and any(
        os.path.isdir(os.path.join(path, e)) and e.startswith("global_step") for e in entries
    ):
        return "a DeepSpeed checkpoint (global_step* dirs)"
    if any(e.startswith("zero_pp_rank_") or e.endswith("_model_states.pt") for e in entries):
        return "a DeepSpeed checkpoint step dir (zero_pp_rank_* / *_model_states.pt files)"
    if any(e.endswith(".safetensors") for e in entries):
        return "a directory of safetensors files (not a Megatron layout)"
    if "config.json" in names:
        return "a Hugging Face config directory without weights"
    if any(e.endswith((".pt", ".pth", ".bin", ".ckpt")) for e in entries):
        return "a directory of loose torch files (no Megatron tracker, iter_* or mp_rank_* dirs)"
    return "a directory without a Megatron tracker, iter_* dirs or mp_rank_* shard dirs"
