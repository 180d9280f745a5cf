"""What every output format provides to the offline writer (:mod:`.offline`): the units it writes (a legacy
target's shard dirs; a torch_dist target's one global state), what each weighs (to deal them to ranks), and how one
is written (and verified) into the temp iteration dir. A new format is a class with these three methods and a row in
``offline.TARGETS``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the resharder imports the targets' helpers, never the reverse at run time
    from megatron_preflight.reshard.resharder import Resharder


@dataclass
class ShardResult:
    """What writing one unit did."""

    bytes_read: int
    bytes_written: int
    verified: int
    replicas: int


class Target(Protocol):
    def units(self, r: Resharder) -> list[str]: ...

    def weights(self, r: Resharder) -> dict[str, int]: ...

    def write(self, r: Resharder, unit: str, iter_out: str, verify: bool) -> ShardResult: ...
