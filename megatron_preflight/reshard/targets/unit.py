"""What every output format provides to the offline writer (:mod:`.offline`): the units it writes (a legacy
target's shard dirs; a torch_dist target's one global state; an HF model's safetensors files), what each weighs (to
deal them to ranks), how one is written (and verified), where in the temp destination (``out_dir``), and what is
written last, after every unit (``seal``: Megatron's tracker; an HF model's index). A new format is a class with these
methods and a row in ``offline.TARGETS``; Megatron's formats share :class:`MegatronDirs`.
A writer may be *tapped*: every tensor it writes is shown, a piece at a time, to a :class:`Tap` (what
``reshard --fingerprint`` uses to hash the output as it streams, without reading it back). The tap's kind comes from a
higher layer (:class:`Tapping`, picklable: it travels to the worker processes); the writers only call it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from megatron_preflight.layout import naming
from megatron_preflight.reshard.targets import assets, durable

if TYPE_CHECKING:  # annotations only: the resharder imports the targets' helpers, never the reverse at run time
    from megatron_preflight.reshard.plan.types import TensorPlan
    from megatron_preflight.reshard.resharder import Resharder


class Tap(Protocol):
    """Sees what one unit's writer writes."""

    def tensor(self, plan: TensorPlan, r0: int, rows: Any) -> None:
        """Rows ``r0:r0+len(rows)`` (along dim 0; the whole value for a 0-dim tensor) of the planned tensor ``plan``,
        as written."""

    def result(self) -> Any:
        """What the tap gathered (sent back from a worker: picklable)."""


class Tapping(Protocol):
    """Makes a unit's tap, and turns every unit's results into output files (in the temp root, before the rename)."""

    def open(self, r: Resharder, coords: dict[str, int]) -> Tap: ...

    def finish(self, r: Resharder, results: list[Any], tmp_root: str, dst_root: str) -> list[str]: ...


@dataclass
class ShardResult:
    """What writing one unit did."""

    bytes_read: int
    bytes_written: int
    verified: int
    replicas: int
    tapped: Any = None  # the unit's tap result, when the writer was tapped
    drifted: Any = None  # replicas.Drifted: the copies Megatron lets drift that differed (TP rank 0's used)


class Target(Protocol):
    def units(self, r: Resharder) -> list[str]: ...

    def weights(self, r: Resharder) -> dict[str, int]: ...

    def least_bytes(self, r: Resharder) -> int | None:
        """A lower bound of the bytes the output takes (its tensors' bytes), or None where it is not known before
        writing: the destination's free space is checked against it before anything is written."""
        ...

    def out_dir(self, tmp: str, iteration: Any) -> str: ...

    def write(self, r: Resharder, unit: str, iter_out: str, verify: bool, tapping: Tapping | None = None
              ) -> ShardResult: ...

    def seal(self, r: Resharder, tmp: str, iteration: Any) -> list[str]: ...


class MegatronDirs:
    """Megatron's layout: the units in the iteration dir (``iter_NNNNNNN/`` or ``release/``), the tracker last."""

    def out_dir(self, tmp: str, iteration: Any) -> str:
        return os.path.join(tmp, naming.iteration_dir_name(iteration))

    def least_bytes(self, r: Resharder) -> int | None:
        return None  # (a target whose weights() are not byte counts says nothing)

    integrity = False  # writes Megatron's integrity.json (torch_dist: what --verify-integrity checks)

    def seal(self, r: Resharder, tmp: str, iteration: Any) -> list[str]:
        """The tokenizer assets and (torch_dist) the integrity manifest in the iteration dir, then the tracker."""
        iter_out = self.out_dir(tmp, iteration)
        notes = assets.copy_tokenizer(r.layout, iter_out)
        if self.integrity:
            assets.write_integrity(iter_out)
            notes.append(f"{assets.INTEGRITY}: SHA-256 of every file of the iteration dir (Megatron's "
                         "--verify-integrity checks it)")
        elif os.path.isdir(iter_out):
            assets.remove_digests(iter_out)
        durable.write_text(os.path.join(tmp, naming.TRACKER_FILENAME), str(iteration))
        return notes
