"""Everything the hook remembers in one process, in one object that :func:`reset` clears."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HookState:
    decision: Any = None  # the Decision of this process's pre-flight run (runtime.Decision)
    indexes: dict[str, Any] = field(default_factory=dict)  # --load dir -> this process's CheckpointIndex of it
    resharders: dict[tuple, Any] = field(default_factory=dict)  # (load dir, iteration, target, ...) -> Resharder


STATE = HookState()


def reset() -> None:
    """Forget the decision, the checkpoints indexed and the resharders built (a new job in the same process, or a test)."""
    STATE.decision = None
    STATE.indexes.clear()
    STATE.resharders.clear()
