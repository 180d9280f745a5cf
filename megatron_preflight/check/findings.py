"""One finding of the pre-flight check: a field, both values, a severity, why, and the fix."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from megatron_preflight.layout.model import to_plain


class Severity(str, enum.Enum):
    FATAL = "fatal"  # the job must not start
    RESHARD = "reshard"  # only the parallel layout differs: loadable through a resharding loader
    INFO = "info"  # worth knowing; loads as is


@dataclass
class Finding:
    field: str
    checkpoint: Any
    runtime: Any
    severity: Severity
    message: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "checkpoint": to_plain(self.checkpoint),
            "runtime": to_plain(self.runtime),
            "severity": self.severity.value,
            "message": self.message,
            "fix": self.fix,
        }
