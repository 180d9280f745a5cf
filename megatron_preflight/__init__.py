"""megatron-preflight: know what a Megatron checkpoint is, and whether a run can load it, before the job starts."""

from megatron_preflight.errors import PreflightError
from megatron_preflight.hook.install import install as _install
from megatron_preflight.reshard import open_index

__version__ = "0.1.0"

__all__ = ["PreflightError", "__version__", "inspect_checkpoint", "install"]


def inspect_checkpoint(path, iteration=None, trust_checkpoint=False):
    """The layout of the checkpoint at ``path``, its shards' consistency checked (what ``megatron-preflight inspect``
    reports; see :func:`megatron_preflight.reshard.open_index`)."""
    return open_index(path, iteration=iteration, trust_checkpoint=trust_checkpoint).layout


def install(**kwargs):
    """Install the Megatron-LM hook (see :mod:`megatron_preflight.hook`)."""
    return _install(**kwargs)
