"""The flags the hook adds to Megatron's argument parser."""

from __future__ import annotations

import argparse
import os

MODES = ("off", "check", "auto", "verify")


def add_preflight_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron-preflight", "checkpoint pre-flight check (megatron-preflight)")
    group.add_argument("--preflight", choices=MODES, default=os.environ.get("MEGATRON_PREFLIGHT", "off"),
                       help="off: Megatron as usual. check: compare the run with the checkpoint before the model is "
                            "built; any fatal finding stops every rank with one report. auto: also pick the loader "
                            "and reshard legacy checkpoints in memory. verify: auto, then prove after the load that every "
                            "rank holds the checkpoint's model (its stored fingerprints) before iteration 1.")
    group.add_argument("--preflight-report", default=os.environ.get("MEGATRON_PREFLIGHT_REPORT"),
                       help="write the plan (JSON) here, from rank 0")
    group.add_argument("--preflight-allow-missing-checkpoint", action="store_true",
                       help="--load points at no checkpoint and that is fine (start from scratch)")
    group.add_argument("--preflight-device-memory", type=float, default=None, metavar="GIB",
                       help="the device memory each rank may use, in GiB: a layout whose predicted parameters, "
                            "gradients, optimizer state and activations exceed it fails at start (default: the "
                            "device's own memory, when it is a CUDA device)")
    group.add_argument("--preflight-fingerprint-on-save", choices=("on", "off"),
                       default=os.environ.get("MEGATRON_PREFLIGHT_FINGERPRINT_ON_SAVE", "on"),
                       help="with --preflight other than off: after each checkpoint Megatron saves, every rank hashes "
                            "what it holds and rank 0 writes the checkpoint's fingerprints beside it (what a later "
                            "--preflight verify, inspect and reshard --verify prove a load or copy against)")
    group.add_argument("--preflight-trust-checkpoint", action="store_true",
                       help="allow pickled types outside the allow-list when reading checkpoint metadata")
    return parser
