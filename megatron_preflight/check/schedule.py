"""The LR schedule and the training horizon: what Megatron asserts or decides only after the model, the optimizer
and the checkpoint are loaded, decided here from the run's args and the checkpoint's saved scheduler state.

Megatron rebuilds its ``OptimizerParamScheduler`` from the run's args (``get_optimizer_param_scheduler`` in
``megatron/training/training.py``): steps are counted in samples, so an iteration-based run's decay steps are
``(lr_decay_iters or train_iters) × global_batch_size``, its warmup ``lr_warmup_fraction × decay steps`` or
``lr_warmup_iters × global_batch_size``, its weight-decay increment steps ``train_iters × global_batch_size``; a
sample-based run uses the sample counts as they are. Loading the optimizer also loads the scheduler, which asserts
that max LR, min LR, warmup steps, decay steps, decay style and the weight-decay settings equal the checkpoint's,
unless ``--override-opt-param-scheduler`` (the run's values win) or ``--use-checkpoint-opt-param-scheduler`` (the
checkpoint's win) is given. A checkpoint at or past the run's horizon trains nothing: Megatron exits after the
whole start-up.
"""

from __future__ import annotations

from typing import Any

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Layout

FATAL, INFO = Severity.FATAL, Severity.INFO

_BOTH_FLAGS = ("add --use-checkpoint-opt-param-scheduler (the checkpoint's schedule continues: its values above), or "
               "--override-opt-param-scheduler (the run's args define the schedule from now on: the LR follows the "
               "new curve at the checkpoint's step)")


def saved_scheduler(layout: Layout) -> dict[str, Any] | None:
    """The checkpoint's scheduler state (``opt_param_scheduler``; ``lr_scheduler`` in old checkpoints), from the
    first file's header or the common state: metadata only."""
    head = layout.common_state if layout.common_state is not None else (
        layout.shards[0].meta if layout.shards else None)
    if not isinstance(head, dict):
        return None
    state = head.get("opt_param_scheduler", head.get("lr_scheduler"))
    return state if isinstance(state, dict) else None


def _first(state: dict[str, Any], *names: str) -> Any:
    return next((state[n] for n in names if n in state), None)


def run_schedule(rt: RuntimeArgs) -> dict[str, Any] | None:
    """The scheduler values the run will build (Megatron's formulas), None when its horizon is not known."""
    gbs = rt.global_batch_size
    if rt.train_iters:
        if not gbs:
            return None
        decay_iters = rt.lr_decay_iters or rt.train_iters
        decay = decay_iters * gbs
        warmup = rt.lr_warmup_fraction * decay if rt.lr_warmup_fraction is not None else rt.lr_warmup_iters * gbs
        wd_steps = rt.train_iters * gbs
        cause = {"decay": f"lr_decay_iters ({'--lr-decay-iters' if rt.lr_decay_iters else '--train-iters'} "
                          f"{decay_iters}) × global batch size {gbs}"}
    elif rt.train_samples:
        decay = rt.lr_decay_samples or rt.train_samples
        warmup = rt.lr_warmup_fraction * decay if rt.lr_warmup_fraction is not None else rt.lr_warmup_samples
        wd_steps = rt.train_samples
        cause = {"decay": f"{'--lr-decay-samples' if rt.lr_decay_samples else '--train-samples'} {decay}"}
    else:
        return None
    wd = rt.weight_decay
    return {"max_lr": rt.lr, "min_lr": rt.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": rt.lr_decay_style,
            "start_wd": rt.start_weight_decay if rt.start_weight_decay is not None else wd,
            "end_wd": rt.end_weight_decay if rt.end_weight_decay is not None else wd,
            "wd_incr_steps": wd_steps, "wd_incr_style": rt.weight_decay_incr_style, "_cause": cause}


# (our field name, the checkpoint's key(s), Megatron's name for it in its assert)
_COMPARED = (
    ("max_lr", ("start_lr", "max_lr"), "learning rate", "--lr"),
    ("min_lr", ("min_lr",), "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", ("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup iterations",
     "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction"),
    ("lr_decay_steps", ("end_iter", "decay_steps", "lr_decay_steps"), "total number of iterations",
     "--lr-decay-iters / --lr-decay-samples (default: the horizon)"),
    ("lr_decay_style", ("decay_style", "lr_decay_style"), "learning rate decay style", "--lr-decay-style"),
    ("start_wd", ("start_wd",), "start weight decay", "--start-weight-decay (default --weight-decay)"),
    ("end_wd", ("end_wd",), "end weight decay", "--end-weight-decay (default --weight-decay)"),
    ("wd_incr_steps", ("wd_incr_steps",), "total number of weight decay iterations",
     "--train-iters / --train-samples"),
    ("wd_incr_style", ("wd_incr_style",), "weight decay incr style", "--weight-decay-incr-style"),
)


def _why(name: str, ck: Any, run: Any, rt: RuntimeArgs, saved_args: Any, sched: dict[str, Any]) -> str:
    """The likely cause of a difference in steps, in the user's terms."""
    if name not in ("lr_decay_steps", "lr_warmup_steps", "wd_incr_steps"):
        return ""
    ck_gbs = getattr(saved_args, "global_batch_size", None) if saved_args is not None else None
    parts = []
    if ck_gbs and rt.global_batch_size and ck_gbs != rt.global_batch_size and rt.train_iters:
        ratio = rt.global_batch_size / ck_gbs
        parts.append(f"global batch size {ck_gbs} → {rt.global_batch_size} multiplies the steps by {ratio:g} "
                     "(steps are counted in samples)")
    ck_iters = getattr(saved_args, "train_iters", None) if saved_args is not None else None
    if ck_iters and rt.train_iters and ck_iters != rt.train_iters and (name == "wd_incr_steps" or (
            name == "lr_decay_steps" and not rt.lr_decay_iters)):
        parts.append(f"--train-iters {ck_iters} → {rt.train_iters} moves the horizon "
                     + ("(the default decay horizon)" if name == "lr_decay_steps" else ""))
    if name == "lr_decay_steps" and not parts:
        parts.append(sched["_cause"]["decay"])
    return "; ".join(p.strip() for p in parts)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def schedule_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """The scheduler values the run builds against the checkpoint's: every difference Megatron would assert on
    (the first one, after the load), at once; and what --no-load-optim / --finetune do to the schedule."""
    state = saved_scheduler(layout)
    if state is None or rt.lr is None:
        return []  # no saved schedule, or the run's schedule flags are not known (a partial flag list)
    out: list[Finding] = []
    steps_done = _first(state, "num_iters", "num_steps")
    if rt.finetune:
        out.append(Finding("opt_param_scheduler", f"step {steps_done}", "restarted", INFO,
                           "--finetune: the iteration and the LR schedule start from 0 (warmup included)", ""))
        return out
    if rt.no_load_optim:
        out.append(Finding("opt_param_scheduler", f"step {steps_done}", "restarted", INFO,
                           "--no-load-optim also leaves the LR schedule unloaded: it restarts at step 0 (warmup "
                           "again, then the full decay) while the iteration count continues from the checkpoint's",
                           "to keep the schedule, load the optimizer; to restart training deliberately, use "
                           "--finetune"))
        return out
    sched = run_schedule(rt)
    if sched is None:
        return out
    if rt.override_opt_param_scheduler or rt.use_checkpoint_opt_param_scheduler:
        changed = [n for n, keys, _, _ in _COMPARED if (ck := _first(state, *keys)) is not None
                   and not _same(ck, sched[n])]
        if changed:
            winner = "the run's args" if rt.override_opt_param_scheduler else "the checkpoint's values"
            out.append(Finding("opt_param_scheduler", "saved", "differs", INFO,
                               f"the schedule differs in {', '.join(changed)}; "
                               f"{'--override-opt-param-scheduler' if rt.override_opt_param_scheduler else '--use-checkpoint-opt-param-scheduler'}"
                               f": {winner} apply", ""))
        return out
    for name, keys, megatron_name, flag in _COMPARED:
        ck = _first(state, *keys)
        if ck is None or _same(ck, sched[name]):
            continue
        why = _why(name, ck, sched[name], rt, layout.saved_args, sched)
        fix = _BOTH_FLAGS
        if rt.param_group_keys is not None and name in rt.param_group_keys:  # check/param_groups.py
            fix = (f"resume with the checkpoint's {flag} {ck} (this Megatron also pairs the optimizer's param groups "
                   "by it: the scheduler flags do not avoid that failure), or add --no-load-optim")
        out.append(Finding(name, ck, sched[name], FATAL,
                           f"the LR schedule differs: Megatron asserts after the load that the {megatron_name} "
                           f"({flag}) equals the checkpoint's ('OptimizerParamScheduler: class input value "
                           f"{sched[name]} and checkpoint value {ck} ... do not match')" + (f": {why}" if why else ""),
                           fix))
    return out


def horizon_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """A checkpoint at or past the run's horizon trains nothing: Megatron builds and loads everything, then exits."""
    if rt.finetune or rt.skip_train or layout.iteration in (None, "release"):
        return []
    iteration = int(layout.iteration)
    if rt.train_iters and iteration >= rt.train_iters:
        return [Finding("train_iters", iteration, rt.train_iters, FATAL,
                        f"the checkpoint is at iteration {iteration}, at or past the run's --train-iters "
                        f"{rt.train_iters}: Megatron would build the model, load the checkpoint and exit without "
                        "training a step",
                        f"raise --train-iters above {iteration} (and mind the LR schedule: the decay horizon follows "
                        "it unless --lr-decay-iters is set), or add --skip-train for evaluation only")]
    consumed = getattr(layout.saved_args, "consumed_train_samples", None) if layout.saved_args is not None else None
    if rt.train_samples and not rt.train_iters and consumed is not None and consumed >= rt.train_samples:
        return [Finding("train_samples", consumed, rt.train_samples, FATAL,
                        f"the checkpoint has consumed {consumed} samples, at or past the run's --train-samples "
                        f"{rt.train_samples}: Megatron would load everything and exit without training",
                        f"raise --train-samples above {consumed}, or add --skip-train for evaluation only")]
    return []


def scheduler_flag_findings(rt: RuntimeArgs) -> list[Finding]:
    """--override-opt-param-scheduler with --use-checkpoint-opt-param-scheduler: Megatron asserts on it when it
    builds the scheduler, after the model and the optimizer."""
    if not (rt.override_opt_param_scheduler and rt.use_checkpoint_opt_param_scheduler):
        return []
    return [Finding("override_opt_param_scheduler", "", "both set", FATAL,
                    "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are both given: "
                    "Megatron asserts ('both override and use-checkpoint are set.') when it builds the LR scheduler, "
                    "after building the model and the optimizer",
                    "keep one: --override-opt-param-scheduler (the run's flags define the schedule) or "
                    "--use-checkpoint-opt-param-scheduler (the checkpoint's schedule continues)")]
