"""The resharder, laid out as the stages a checkpoint flows through:

read (:mod:`.sources`) → index (:mod:`.checkpoint_index`, :mod:`.plan.index`) → plan (:mod:`.plan`,
:mod:`.optimizer`) → validate (:mod:`.plan.validate`) → execute (:mod:`.execute`) → write (:mod:`.targets`), with
:mod:`.resharder` tying one checkpoint to one target layout and :mod:`.cost` predicting a run from its plans.

The check, the hook and the CLI use only the names exported here. They are imported on first use (PEP 562), so a
verdict that needs no tensor index never imports the resharder's modules, and the writers' torch only when writing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # the checkpoint, read and indexed once per process
    "CheckpointIndex": "checkpoint_index", "open_index": "checkpoint_index", "index_builds": "checkpoint_index",
    "checkpoint_index": "", "has_legacy_grouped": "plan.index", "grouped_experts": "plan.spec",
    # the source's tensors and layout, as the planner of layouts reads them (megatron_preflight/fit)
    "iter_source_keys": "plan.index", "source_topology": "plan.topology", "is_tied": "plan.topology",
    "saved_arg": "plan.topology", "moe_layers": "plan.hybrid", "mtp_index": "plan.rules", "target_vocab": "plan.planner",
    # one checkpoint at one target layout
    "TargetLayout": "target", "Resharder": "resharder", "open_resharder": "resharder",
    "build_rank_state_dict": "resharder", "choose_optimizer": "resharder",
    # the optimizer state
    "OptimizerStatus": "optimizer.status", "OptimizerNotReshardable": "optimizer.plain", "GROUP_KEY": "optimizer.plain",
    "align_groups": "optimizer.plain", "iter_plans": "optimizer.plain", "read_dist_meta": "optimizer.distributed", "relocate": "optimizer.distributed",
    # executing a plan (the hook builds its rank's state in memory)
    "SourceFiles": "sources.files", "build_tree": "execute.executor",
    # writing a new checkpoint
    "write_resharded": "targets.offline", "check_destination": "targets.offline", "open_checked": "targets.offline",
    "starts_without_torch": "targets.offline", "global_resharders": "targets.torch_dist",
    # what it costs
    "predict_in_memory": "cost", "predict_offline": "cost", "predict_torch_dist": "cost", "process_age": "cost",
    "representative_ranks": "cost", "SAMPLE_ABOVE": "cost",
}

__all__ = [
    "CheckpointIndex",
    "GROUP_KEY",
    "OptimizerNotReshardable",
    "OptimizerStatus",
    "Resharder",
    "SAMPLE_ABOVE",
    "SourceFiles",
    "TargetLayout",
    "align_groups",
    "build_rank_state_dict",
    "build_tree",
    "check_destination",
    "checkpoint_index",
    "choose_optimizer",
    "global_resharders",
    "grouped_experts",
    "has_legacy_grouped",
    "index_builds",
    "is_tied",
    "iter_source_keys",
    "iter_plans",
    "moe_layers",
    "mtp_index",
    "open_checked",
    "open_index",
    "open_resharder",
    "predict_in_memory",
    "predict_offline",
    "predict_torch_dist",
    "process_age",
    "representative_ranks",
    "read_dist_meta",
    "relocate",
    "saved_arg",
    "source_topology",
    "starts_without_torch",
    "target_vocab",
    "write_resharded",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(f"{__name__}.{name}") if module == "" else \
        getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers only: at run time the names above are imported on first use
    from megatron_preflight.reshard.checkpoint_index import CheckpointIndex, index_builds, open_index
    from megatron_preflight.reshard.cost import (
        SAMPLE_ABOVE,
        predict_in_memory,
        predict_offline,
        predict_torch_dist,
        process_age,
        representative_ranks,
    )
    from megatron_preflight.reshard.execute.executor import build_tree
    from megatron_preflight.reshard.optimizer.distributed import read_dist_meta, relocate
    from megatron_preflight.reshard.optimizer.plain import GROUP_KEY, OptimizerNotReshardable, align_groups, iter_plans
    from megatron_preflight.reshard.optimizer.status import OptimizerStatus
    from megatron_preflight.reshard.plan.index import has_legacy_grouped, iter_source_keys
    from megatron_preflight.reshard.plan.planner import target_vocab
    from megatron_preflight.reshard.plan.rules import mtp_index
    from megatron_preflight.reshard.plan.spec import grouped_experts
    from megatron_preflight.reshard.plan.topology import is_tied, saved_arg, source_topology
    from megatron_preflight.reshard.resharder import Resharder, build_rank_state_dict, choose_optimizer, open_resharder
    from megatron_preflight.reshard.sources.files import SourceFiles
    from megatron_preflight.reshard.target import TargetLayout
    from megatron_preflight.reshard.targets.offline import (
        check_destination,
        open_checked,
        starts_without_torch,
        write_resharded,
    )
    from megatron_preflight.reshard.targets.torch_dist import global_resharders
