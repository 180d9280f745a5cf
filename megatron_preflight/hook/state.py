"""Everything the hook remembers in one process, in one object that :func:`reset` clears."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HookState:
    decision: Any = None  # the Decision of this process's pre-flight run (runtime.Decision)
    indexes: dict[str, Any] = field(default_factory=dict)  # --load dir -> this process's CheckpointIndex of it
    shared: set[str] = field(default_factory=set)  # --load dirs whose index every rank now holds (after the load)
    resharders: dict[tuple, Any] = field(default_factory=dict)  # (load dir, iteration, target, ...) -> Resharder
    seconds: dict[str, float] = field(default_factory=dict)  # where this process's load time went (index, build)


STATE = HookState()


def reset() -> None:
    """Forget the decision, the checkpoints indexed and the resharders built (a new job in the same process, or a test)."""
    STATE.decision = None
    STATE.indexes.clear()
    STATE.shared.clear()
    STATE.resharders.clear()
    STATE.seconds.clear()
