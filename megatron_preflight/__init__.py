"""megatron-preflight: know what a Megatron checkpoint is, and whether a run can load it, before the job starts.

Importing the package loads nothing but its errors: the hook, the check and the resharder load on first use (the
launcher imports the package before a job whose --preflight may be off)."""

import importlib

from megatron_preflight import reshard  # a lazy package: its modules load on first use
from megatron_preflight.errors import PreflightError

__version__ = "0.1.0"

__all__ = ["PreflightError", "__version__", "inspect_checkpoint", "install"]


def inspect_checkpoint(path, iteration=None, trust_checkpoint=False):
    """The layout of the checkpoint at ``path``, its shards' consistency checked (what ``megatron-preflight inspect``
    reports; see :func:`megatron_preflight.reshard.open_index`)."""
    return reshard.open_index(path, iteration=iteration, trust_checkpoint=trust_checkpoint).layout


def install(**kwargs):
    """Install the Megatron-LM hook (see :mod:`megatron_preflight.hook.install`)."""
    return importlib.import_module("megatron_preflight.hook.install").install(**kwargs)
