"""The one table of a checkpoint's top-level state and what resharding does with each entry, for every format: a
legacy file's top-level keys, a torch_dist checkpoint's common state."""

from __future__ import annotations

# Copied unchanged: key -> (kept in a legacy output, read from a torch_dist common state, written to a torch_dist
# common.pt). A torch_dist save keeps the rerun state machine per rank, not in its common state, and current
# Megatron-LM no longer reads ``total_iters`` (only legacy files of old versions hold it).
TABLE = {
    "iteration": (True, True, True),
    "checkpoint_version": (True, True, True),
    "num_floating_point_operations_so_far": (True, True, True),
    "tokens_so_far": (True, True, True),
    "opt_param_scheduler": (True, True, True),
    "rerun_state_machine": (True, False, True),
    "total_iters": (True, False, False),
}
CARRIED = tuple(k for k, (legacy, _, _) in TABLE.items() if legacy)
FROM_TORCH_DIST = tuple(k for k, (_, read, _) in TABLE.items() if read)
TO_TORCH_DIST = tuple(k for k, (_, _, written) in TABLE.items() if written)
# Rewritten for the target layout (parallel sizes, padded vocab, optimizer kind, format).
REWRITTEN = ("args",)
# Rebuilt for each target rank from the global index (model chunks; the optimizer state when it is carried).
RESHARDED = ("model", "optimizer")
# Per-rank state that cannot follow a layout change: never carried, and why.
NOT_MAPPABLE = {
    "rng_state": "RNG states are per (TP, PP) rank and cannot be mapped to another layout; load with --no-load-rng",
}
PROVENANCE_KEY = "megatron_preflight"  # the entry our legacy outputs add (Megatron ignores unknown entries)


def is_model_key(key: str) -> bool:
    """``model``, or ``model0``..``modelN`` (one per virtual pipeline chunk)."""
    return key == "model" or (key.startswith("model") and key[5:].isdigit())


def handled(key: str) -> bool:
    """Whether the table says what happens to a top-level entry (others are carried unchanged, with a warning)."""
    return key in CARRIED or key in REWRITTEN or key in RESHARDED or key in NOT_MAPPABLE or \
        key == PROVENANCE_KEY or is_model_key(key)
