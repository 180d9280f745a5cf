"""Layout discovery: what a Megatron checkpoint dir holds, from metadata only."""

from megatron_preflight.layout.discover import discover
from megatron_preflight.layout.model import Format, Layout, Problem, Shard

__all__ = ["Format", "Layout", "Problem", "Shard", "discover"]
