"""The batch size at the checkpoint's consumed samples, and the samples the run's training set is built for: two
things Megatron decides only after the checkpoint is loaded.

* A batch-size schedule (``--step-batch-size-schedule "THRESHOLD:BS ..."``, thresholds in tokens when the run has a
  sequence length, with K/M/B/T suffixes; or the older ``--rampup-batch-size START INCR SAMPLES``) gives the global
  batch size from the consumed samples. Megatron checks that this batch size divides by micro batch × data-parallel
  size only in ``update_num_microbatches(consumed_samples)`` inside ``load_checkpoint`` (megatron-core's
  ``num_microbatches_calculator``: "Divisibility of the CURRENT batch size is checked at runtime ... after
  checkpoint loading"), so a new data-parallel size that does not divide it fails after the whole start-up.
* An iteration-based run builds its training set for ``train_iters × global_batch_size`` samples
  (``get_train_valid_test_num_samples``) and its sampler starts at the checkpoint's ``consumed_train_samples``. With
  a smaller global batch size than the checkpoint's, the samples already consumed exceed ``iteration × new batch
  size``: the run needs more samples than the set is built for. A blend (sized exactly) then runs out before the
  horizon, or at once ("no samples left to consume"); a single dataset may have spare samples in its last epoch.
"""

from __future__ import annotations

from megatron_preflight.check.findings import Finding, Severity
from megatron_preflight.check.runtime_args import RuntimeArgs
from megatron_preflight.layout.model import Layout

FATAL, INFO = Severity.FATAL, Severity.INFO

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def parse_step_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """``"0:768 250B:1536"`` → [(threshold in samples, batch size)], ascending (Megatron's parsing: thresholds are
    tokens when the run has a sequence length). Raises ValueError on a malformed entry."""
    out = []
    for entry in text.replace(",", " ").split():
        threshold, _, size = entry.partition(":")
        if not size:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        samples = _number(threshold)
        out.append((samples // seq_length if seq_length else samples, _number(size)))
    return sorted(out)


def batch_size_at(rt: RuntimeArgs, consumed: int) -> tuple[int, str] | None:
    """The global batch size the run's schedule gives at ``consumed`` samples, and the flag that sets it (None: the
    run has no batch-size schedule)."""
    if rt.step_batch_size_schedule:
        size = None
        for threshold, bs in parse_step_schedule(rt.step_batch_size_schedule, rt.seq_length):
            if consumed >= threshold or size is None:
                size = bs
        return (size, "--step-batch-size-schedule") if size is not None else None
    if rt.rampup_batch_size and len(rt.rampup_batch_size) == 3 and rt.global_batch_size:
        start, incr, ramp = (int(v) for v in rt.rampup_batch_size)
        increments = (rt.global_batch_size - start) // incr if incr else 0
        if consumed > ramp or increments <= 0:
            return rt.global_batch_size, "--global-batch-size (after --rampup-batch-size)"
        return start + int(consumed / (ramp / increments)) * incr, "--rampup-batch-size"
    return None


def _consumed(layout: Layout) -> int | None:
    value = getattr(layout.saved_args, "consumed_train_samples", None) if layout.saved_args is not None else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def batch_findings(layout: Layout, rt: RuntimeArgs) -> list[Finding]:
    """The schedule's batch size at the checkpoint's consumed samples against micro batch × DP; a training set
    smaller than what the run will consume."""
    consumed = _consumed(layout)
    if consumed is None or rt.finetune:
        return []  # --finetune restarts the sample count at 0
    out: list[Finding] = []
    dp, mbs = rt.data_parallel_size, rt.micro_batch_size
    try:
        current = batch_size_at(rt, consumed)
    except ValueError as exc:
        return [Finding("step_batch_size_schedule", None, rt.step_batch_size_schedule, FATAL,
                        f"--step-batch-size-schedule cannot be parsed: {exc}", "write it as \"0:BS THRESHOLD:BS ...\"")]
    if current and dp and mbs and not rt.decrease_batch_size_if_needed and current[0] % (mbs * dp):
        size, flag = current
        out.append(Finding("global_batch_size", f"{consumed} samples consumed", size, FATAL,
                           f"at the checkpoint's {consumed} consumed samples the run's {flag} gives a global batch "
                           f"size of {size}, not divisible by micro batch size {mbs} × data-parallel size {dp}: "
                           "Megatron asserts this only inside load_checkpoint ('current global batch size ... is not "
                           "divisible by micro-batch-size ... times data parallel size'), after the whole start-up",
                           f"choose a data-parallel size (world size / (TP·PP·CP)) and --micro-batch-size whose "
                           f"product divides {size}, or change the schedule's batch size there"))
    iteration = layout.iteration
    gbs = rt.global_batch_size
    if current is None and rt.train_iters and not rt.train_samples and gbs and isinstance(iteration, int) \
            and not rt.skip_train and iteration < rt.train_iters and consumed > iteration * gbs:
        built = rt.train_iters * gbs
        needed = consumed + (rt.train_iters - iteration) * gbs
        saved_gbs = getattr(layout.saved_args, "global_batch_size", None)
        out.append(Finding("consumed_train_samples", consumed, f"{built} samples built", INFO,
                           f"warning: the checkpoint has consumed {consumed} samples in {iteration} iterations "
                           f"(global batch size {saved_gbs}); at the run's global batch size {gbs} Megatron builds "
                           f"its training set for --train-iters {rt.train_iters} × {gbs} = {built} samples but the "
                           f"run consumes {needed}: a blended dataset (sized exactly) runs out "
                           + ("at once ('no samples left to consume')" if consumed >= built else
                              f"after iteration {iteration + (built - consumed) // gbs}")
                           + ", a single dataset only if its last epoch has no spare samples",
                           f"size the run in samples: --train-samples {needed} instead of --train-iters "
                           f"(the horizon then counts the samples consumed so far)"))
    return out
