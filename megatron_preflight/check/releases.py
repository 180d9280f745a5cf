"""What a Megatron-LM release does differently with a checkpoint: one table, for judging a checkpoint against the
release that will load it when that release is not running here (``megatron-preflight check --megatron-version``, or the
megatron-core installed beside the CLI). In a job the hook asks the running megatron.core itself
(:mod:`megatron_preflight.hook.runtime`); this table holds what those same questions answered in each release
(``core_r0.13.0`` … ``core_r0.19.0`` and main ``d98e8a64``, megatron-core 0.20.0, asked through the hook's own functions).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import pad_vocab

# the per-group settings by which megatron-core pairs saved optimizer param groups with the run's (its
# ``param_group_identifier_keys``): the groups' structure up to 0.18; 0.19 adds every ParamGroupOverride field
STRUCTURE_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
OVERRIDE_KEYS = ("end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult", "lr_mult", "is_expert_parallel",
                 "is_decoupled_lr")
OLDEST = (0, 13)


@dataclass(frozen=True)
class ReleaseFacts:
    version: tuple[int, int]
    loads_flattened_range: bool  # the distributed optimizer's fully_sharded_model_space form (refused from 0.16)
    mtp_layer_name: str  # an MTP layer's transformer layer: transformer_layer up to 0.16, mtp_model_layer from 0.17
    param_group_keys: tuple[str, ...]
    local_grouped_mlp: bool  # the local spec with --moe-grouped-gemm builds the legacy GroupedMLP (up to 0.16)
    mamba_conv_name: str = "conv1d_weight"  # a Mamba mixer's conv in legacy files: conv1d.weight up to 0.18
    # an MTP layer's transformer layer among an fsdp_dtensor file's model tensors: the module's name up to 0.19,
    # transformer_layer again from 0.20 (main's fsdp_dtensor save maps it back, as torch_dist does)
    fsdp_mtp_layer_name: str = "transformer_layer"
    # Megatron's NullTokenizer: --vocab-size ids and an end-of-document one up to 0.17; from 0.18 its last id is the
    # end of document (megatron/core/tokenizers/text/libraries/null_tokenizer.py)
    null_tokenizer_adds_eod: bool = True
    # the local spec's sequential experts add their output bias in place (megatron/core/transformer/mlp.py, from 0.15):
    # at EP 1 and ETP 1 that is on a reduction's view of its input, which autograd refuses at the first training step
    expert_bias_in_place: bool = True


def parse_version(text: str) -> tuple[int, int]:
    """``0.16``, ``0.16.1``, ``core_r0.16.0`` or ``0.20.0rc1`` -> (0, 16)."""
    m = re.search(r"(\d+)\.(\d+)", text or "")
    if not m:
        raise PreflightError(f"cannot read a megatron-core version from {text!r}", code="usage",
                             fix="pass --megatron-version MAJOR.MINOR, e.g. --megatron-version 0.16")
    return int(m.group(1)), int(m.group(2))


def facts(version: tuple[int, int]) -> ReleaseFacts:
    """What release ``version`` does (a release older than 0.13 is judged as 0.13, the oldest checked)."""
    v = max(version, OLDEST)
    return ReleaseFacts(version=version, loads_flattened_range=v < (0, 16),
                        mtp_layer_name="transformer_layer" if v < (0, 17) else "mtp_model_layer",
                        param_group_keys=STRUCTURE_KEYS if v < (0, 19) else OVERRIDE_KEYS,
                        local_grouped_mlp=v < (0, 17),
                        mamba_conv_name="conv1d.weight" if v < (0, 19) else "conv1d_weight",
                        fsdp_mtp_layer_name="mtp_model_layer" if (0, 17) <= v < (0, 20) else "transformer_layer",
                        null_tokenizer_adds_eod=v < (0, 18), expert_bias_in_place=v >= (0, 15))


_DIST_INFO = re.compile(r"megatron[_.-]core-(\d+\.\d+[^-]*)\.dist-info$", re.IGNORECASE)
_PACKAGE_INFO = re.compile(r"^(MAJOR|MINOR)\s*=\s*(\d+)", re.MULTILINE)


def installed_version() -> tuple[int, int] | None:
    """The megatron-core this process would import, found on ``sys.path`` without importing anything (not even
    importlib.metadata: a verdict stays fast): its ``megatron/core/package_info.py`` (a Megatron-LM checkout on the
    path comes first, as Python would import it), else an installed distribution's ``.dist-info`` name."""
    for entry in sys.path:
        path = os.path.join(entry or ".", "megatron", "core", "package_info.py")
        try:
            with open(path, encoding="utf-8") as fh:
                found = dict(_PACKAGE_INFO.findall(fh.read()))
        except OSError:
            continue
        if "MAJOR" in found and "MINOR" in found:
            return int(found["MAJOR"]), int(found["MINOR"])
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            m = _DIST_INFO.match(name)
            if m:
                try:
                    return parse_version(m.group(1))
                except PreflightError:
                    continue
    return None


def apply(rt, release: ReleaseFacts) -> None:
    """Fill the run's unknown release signals (``None``) with ``release``'s."""
    if rt.loads_flattened_range is None:
        rt.loads_flattened_range = release.loads_flattened_range
    if rt.mtp_layer_name is None and rt.mtp_num_layers:
        rt.mtp_layer_name = release.mtp_layer_name
    if rt.param_group_keys is None:
        rt.param_group_keys = release.param_group_keys
    if rt.fsdp_mtp_layer_name is None and rt.mtp_num_layers and rt.use_megatron_fsdp:
        rt.fsdp_mtp_layer_name = release.fsdp_mtp_layer_name
    if rt.mamba_conv_name is None and rt.hybrid_layer_pattern:
        rt.mamba_conv_name = release.mamba_conv_name
    if rt.null_tokenizer_adds_eod is None:
        rt.null_tokenizer_adds_eod = release.null_tokenizer_adds_eod
        if "padded_vocab_size" not in rt.given and rt.vocab_size:  # (derived before the release was known)
            rt.padded_vocab_size = pad_vocab(rt.tokenizer_ids(), rt.make_vocab_size_divisible_by, rt.tp)
    if rt.expert_bias_in_place is None:
        rt.expert_bias_in_place = release.expert_bias_in_place
    if rt.builds_grouped_mlp is None:
        rt.builds_grouped_mlp = bool(rt.moe_grouped_gemm and rt.transformer_impl == "local"
                                     and release.local_grouped_mlp)
