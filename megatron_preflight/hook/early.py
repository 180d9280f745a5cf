"""The checks at argument parsing: every layout the run cannot have, from its arguments and world size alone, answered
before Megatron's own validation and model-config build raise.

Megatron refuses an impossible layout in several places before the checkpoint check can run (``validate_args``'s
asserts, then ``TransformerConfig``'s ``ValueError`` when pretrain_gpt.py builds the model config right after parsing,
then ``initialize_model_parallel``), each as a traceback per rank with no fix. Here, on every rank, before Megatron
validates: the run's TP / PP / VPP / EP / ETP / CP against its heads, query groups, ffn, layers, experts, sequence
and world size (:func:`~megatron_preflight.check.compare.check_runtime_layout`, the checks ``check`` makes). No I/O,
no collectives: every rank computes the same answer from the same arguments, rank 0 prints it (each finding with
its fix, and the nearest layouts of the world size the model can have), every rank exits 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.errors import PreflightError

log = logging.getLogger("megatron_preflight")
PREFIX = "[megatron-preflight]"
# how long the other ranks wait before exiting, so that rank 0 prints before torchrun stops it (seen on a loaded box:
# ranks 1 and 2 exited first and rank 0 was terminated before its message)
OTHERS_WAIT_S = 5.0


def layout_findings(args: Any) -> list[Finding]:
    """The fatal layout findings of Megatron args ``args`` (a Namespace as parsed, before validation)."""
    # the check's modules load when the check runs (never with --preflight off)
    from megatron_preflight.check.compare import check_runtime_layout
    from megatron_preflight.check.runtime_args import from_namespace

    try:
        rt = _with_release(from_namespace(args))
        return [f for f in check_runtime_layout(rt) if f.severity == Severity.FATAL]
    except PreflightError as exc:  # a size that is no size (0, a negative): the run cannot have it either
        return [Finding(exc.code, None, None, Severity.FATAL, exc.message, exc.fix or "")]


def _with_release(rt: Any) -> Any:
    """``rt`` with what the running megatron-core does differently (check/releases.py: found on the path, not
    imported), so that a layout the release cannot train is refused and not proposed."""
    # the check's modules load when the check runs (never with --preflight off)
    from megatron_preflight.check import releases

    version = releases.installed_version()
    if version is not None:
        releases.apply(rt, releases.facts(version))
    return rt


def report(args: Any, findings: list[Finding]) -> str:
    """The message: each finding with its fix, then the nearest layouts of the world size the model can have."""
    # the planner loads only for a layout that cannot run
    from megatron_preflight.check.runtime_args import from_namespace
    from megatron_preflight.fit.nearest import nearest_by_args_text

    lines = [f"{PREFIX} the run's parallel layout cannot work ({len(findings)} problem(s)), found before Megatron "
             "builds anything; every rank exits with status 1:"]
    for f in findings:
        flag = f"--{f.field.replace('_', '-')}" if f.field and f.field != "world_size" else "world size"
        lines.append(f"{PREFIX}   {flag}: {f.message}. Fix: {f.fix.rstrip('.')}." if f.fix else
                     f"{PREFIX}   {flag}: {f.message}.")
    try:
        nearest = nearest_by_args_text(_with_release(from_namespace(args)), getattr(args, "load", None))
    except Exception as exc:  # noqa: BLE001 - advice: never hides the findings
        log.debug("no nearest layouts: %s", exc)
        nearest = None
    if nearest:
        lines.append(f"{PREFIX}   or take one of {nearest}")
    lines.append(f"{PREFIX} (--preflight off skips megatron-preflight's checks; Megatron then refuses this layout "
                 "itself)")
    return "\n".join(lines)


def check_at_parse(args: Any) -> None:
    """Exit this process with status 1 when the run's layout cannot work (rank 0 prints why first); return otherwise.
    Off with ``--preflight off``. A failure of the check itself never stops a run: Megatron then decides."""
    if getattr(args, "preflight", "off") in (None, "off"):
        return
    try:
        findings = layout_findings(args)
    except Exception as exc:  # noqa: BLE001 - our own failure must not stop a run Megatron would start
        log.debug("the layout check at parsing failed: %s", exc)
        return
    if not findings:
        return
    rank = int(getattr(args, "rank", None) or os.environ.get("RANK", 0) or 0)
    if rank == 0:
        print(report(args, findings), file=sys.stderr, flush=True)
    else:  # the first rank to exit makes torchrun stop the others: rank 0 must have said why by then
        time.sleep(OTHERS_WAIT_S)
    sys.stdout.flush()
    raise SystemExit(1)  # (no process group exists yet: nothing to tear down)
