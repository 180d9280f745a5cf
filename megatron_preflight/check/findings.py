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


# the findings of a layout that cannot run: its sizes against the model, the world, or the device (the layout
# planner names the nearest layouts that can: fit.nearest)
LAYOUT_FIELDS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "context_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers", "world_size", "memory",
})


def first_layout_problem(findings: list[Finding]) -> Finding | None:
    """The first fatal finding about the run's layout (see :data:`LAYOUT_FIELDS`), or None."""
    return next((f for f in findings if f.severity == Severity.FATAL and f.field in LAYOUT_FIELDS), None)
