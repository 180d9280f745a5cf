"""What the hook does at job start, independent of Megatron-LM's module layout (testable with megatron-core alone).

``preflight(args)`` runs once, after torch.distributed is up and before the model is built: rank 0 reads the
checkpoint metadata and makes the plan, every rank receives the same :class:`Decision`, and a fatal verdict exits
every rank with status 1 (rank 0 prints the one-screen report first). The decision is then applied to ``args``
(loader, optimizer / RNG state) and logged on rank 0.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from megatron_preflight import reshard  # its modules load on first use (a lazy package)
from megatron_preflight.check import advice, releases
from megatron_preflight.check.findings import first_layout_problem
from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.report import render_plan
from megatron_preflight.check.runtime_args import from_namespace
from megatron_preflight.check.verdict import Loader, Verdict
from megatron_preflight.errors import PreflightError, environment_error
from megatron_preflight.hook import consensus
from megatron_preflight.hook.state import STATE, reset  # noqa: F401 - reset is part of this module's API
from megatron_preflight.layout import naming, optimizer_kinds, storage
from megatron_preflight.remote.store import NO_OBJECTS, is_msc
from megatron_preflight.reshard.plan.rules import MTP_LAYER_NAMES
from megatron_preflight.units import human_bytes

log = logging.getLogger("megatron_preflight")

EXIT_FAIL, EXIT_USAGE = 1, 2


@dataclass
class Decision:
    """The plan, reduced to plain data every rank can act on."""

    mode: str
    verdict: Verdict
    loader: Loader | None
    load_optimizer: bool = True
    load_rng: bool = True
    checkpoint: str | None = None
    target: Any = None  # the run's layout for the resharder (reshard.TargetLayout), made once on rank 0
    report: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    exit_code: int = 1  # with a fail verdict: 1, or 2 for a usage error (a flag to fix)


def advise_layout(args: Any, exc: BaseException) -> None:
    """Megatron's argument validation refused the run's layout (before torch.distributed is up, so before the check):
    rank 0 names the fitting layouts of the world size nearest to the run's (fit/nearest.py), then Megatron's own
    error ends the job as it would have. Advice only: any failure here is silent."""
    if getattr(args, "preflight", "off") == "off" or not getattr(args, "load", None):
        return
    if int(getattr(args, "rank", os.environ.get("RANK", 0)) or 0) != 0:
        return
    try:
        from megatron_preflight.fit.nearest import nearest_text  # only a refused run needs the planner

        rt = from_namespace(args)
        text = nearest_text(reshard.open_index(args.load, shards="auto"), rt)
    except Exception as e:  # noqa: BLE001 - advice never hides Megatron's own error
        log.debug("no layout advice: %s", e)
        return
    if text:
        print(f"[megatron-preflight] Megatron refuses the run's layout ({exc}); {text}", file=sys.stderr, flush=True)


def current() -> Decision | None:
    """The decision of this process's pre-flight run (None before it ran, or with --preflight off)."""
    return STATE.decision


def _say(msg: str) -> None:
    if consensus.rank() == 0:
        print(f"[megatron-preflight] {msg}", flush=True)


def running_version() -> str | None:
    """The version of the megatron-core this job runs (what every release signal below was asked of)."""
    try:
        from megatron.core import package_info  # Megatron is present: this runs inside its job
    except Exception:  # noqa: BLE001 - no megatron.core: unknown
        return None
    return str(getattr(package_info, "__version__", "")) or None


def run_adam_family(args: Any) -> str | None:
    """The Adam this Megatron process builds: TE's or apex's FusedAdam when either is installed, torch's otherwise
    (Megatron decides it once, at import, in ``megatron.core.optimizer``); None for another optimizer or when this
    Megatron does not say."""
    try:
        kind = optimizer_kinds.kind_named(getattr(args, "optimizer", None))
    except PreflightError:
        return None
    if not kind.fused_form or getattr(args, "optimizer_cpu_offload", False):
        return None
    try:
        from megatron.core import optimizer as mcore_optimizer  # Megatron is present: this runs inside its job
    except Exception:  # noqa: BLE001 - no megatron.core (a library user): unknown
        return None
    using_torch = getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", None)
    if using_torch is None:  # megatron-core < 0.15 has no flag: the class it imported as Adam says
        adam = getattr(mcore_optimizer, "Adam", None)
        module = getattr(adam, "__module__", "") or ""
        if module.startswith("torch.optim"):
            return "torch"
        return "fused" if module.startswith(("transformer_engine", "apex")) else None
    return "torch" if using_torch else "fused"


def builds_grouped_mlp(args: Any) -> bool | None:
    """Whether this Megatron builds the legacy GroupedMLP for the run (the local spec with --moe-grouped-gemm, in a
    megatron-core that still has the class; Megatron-LM main's local spec builds sequential experts); None: unknown."""
    if not (getattr(args, "moe_grouped_gemm", False) and getattr(args, "transformer_impl", None) == "local"):
        return False
    try:
        from megatron.core.transformer.moe import experts  # Megatron is present: this runs inside its job
    except Exception:  # noqa: BLE001 - no megatron.core: unknown
        return None
    return hasattr(experts, "GroupedMLP")


def mtp_layer_name() -> str | None:
    """What this megatron-core names an MTP layer's transformer layer (the field of its layer's submodules:
    ``mtp_model_layer``, or ``transformer_layer`` before megatron-core 0.17); None: unknown, or no MTP."""
    try:
        from megatron.core.transformer import multi_token_prediction as mtp  # Megatron is present: in its job
        names = {f.name for f in dataclasses.fields(mtp.MultiTokenPredictionLayerSubmodules)}
    except Exception:  # noqa: BLE001 - no megatron.core, or a version without MTP: unknown
        return None
    return next((name for name in MTP_LAYER_NAMES if name in names), None)


def fsdp_mtp_layer_name() -> str | None:
    """What this Megatron-FSDP names an MTP layer's transformer layer among an fsdp_dtensor file's model tensors:
    the name its save maps the module to (``MTP_INNER_LAYER_CHECKPOINT_NAME``, megatron-core 0.20), else the module's
    own name; None: unknown, or no MTP."""
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc  # Megatron is present: in its job
    except Exception:  # noqa: BLE001 - no Megatron-FSDP in this megatron.core: unknown
        return None
    return getattr(fdc, "MTP_INNER_LAYER_CHECKPOINT_NAME", None) or mtp_layer_name()


def loads_flattened_range() -> bool | None:
    """Whether this megatron-core still loads ShardedTensors with a ``flattened_range`` (the distributed optimizer's
    ``fully_sharded_model_space`` torch_dist form): megatron-core 0.16 and Megatron-LM main raise "ShardedTensor.
    flattened_range is not supported"; None: unknown. Read from the class's source (nothing is built)."""
    try:
        from megatron.core.dist_checkpointing import mapping  # Megatron is present: this runs inside its job
        text = inspect.getsource(mapping.ShardedTensor)
    except Exception:  # noqa: BLE001 - no megatron.core, or no source to read: unknown
        return None
    return "flattened_range" in text and "flattened_range is not supported" not in text


def param_group_keys() -> tuple[str, ...] | None:
    """The per-group settings by which this megatron.core pairs a checkpoint's optimizer param groups with the run's
    on load (``param_group_identifier_keys``; Megatron-LM main includes max_lr and min_lr); None: unknown."""
    try:
        from megatron.core.optimizer import optimizer as mcore_optimizer  # Megatron is present: in its job
    except Exception:  # noqa: BLE001 - no megatron.core: unknown
        return None
    keys = getattr(mcore_optimizer, "param_group_identifier_keys", None)
    if keys is None:  # older megatron-core: the groups' structure only (wd_mult, lr_mult, expert, decoupled)
        return releases.STRUCTURE_KEYS
    return tuple(str(k) for k in keys)


def device_memory_gib() -> float | None:
    """This rank's CUDA device memory in GiB (None without CUDA, e.g. on the CPU runner)."""
    try:
        import torch  # deferred: torch is loaded in a Megatron job; the check itself does not need it

        if torch.cuda.is_available() and torch.version.cuda is not None:
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / (1 << 30)
    except Exception:  # noqa: BLE001 - no device information: not checked against one
        return None
    return None


def _make_decision(args: Any, mode: str, load_dir: str) -> Decision:
    if getattr(args, "preflight_allow_missing_checkpoint", False) and not os.path.exists(load_dir):
        return Decision(mode, Verdict.SKIP, None, checkpoint=load_dir,
                        report=f"no checkpoint in {load_dir} (it does not exist); starting from scratch "
                               "(--preflight-allow-missing-checkpoint)")
    rt = from_namespace(args)
    rt.optimizer_family = run_adam_family(args)
    rt.builds_grouped_mlp = builds_grouped_mlp(args)
    rt.loads_flattened_range = loads_flattened_range()
    rt.mtp_layer_name = mtp_layer_name() if getattr(args, "mtp_num_layers", None) else None
    if rt.mtp_layer_name and rt.use_megatron_fsdp:
        rt.fsdp_mtp_layer_name = fsdp_mtp_layer_name()
    rt.param_group_keys = param_group_keys()
    biased_experts = bool(rt.num_experts and rt.add_bias_linear)
    version = releases.installed_version() if rt.hybrid_layer_pattern or rt.tokenizer_type == "NullTokenizer" \
        or biased_experts else None
    if version is not None:
        rt.null_tokenizer_adds_eod = releases.facts(version).null_tokenizer_adds_eod
        if biased_experts:
            rt.expert_bias_in_place = releases.facts(version).expert_bias_in_place
        if rt.hybrid_layer_pattern:
            rt.mamba_conv_name = releases.facts(version).mamba_conv_name
    if rt.preflight_device_memory is None:
        rt.preflight_device_memory = device_memory_gib()
    if mode in ("auto", "verify"):
        rt.auto_detect_ckpt_format = True  # auto mode turns it on for a dist checkpoint (apply_decision)
    if not rt.world_size:
        rt.world_size = consensus.world_size()
    plan = make_plan(load_dir, rt, trust_checkpoint=bool(getattr(args, "preflight_trust_checkpoint", False)),
                     shards="auto")  # a sampled verdict on rank 0 at scale; the resharder reads what it needs
    STATE.indexes[os.path.abspath(load_dir)] = plan.index  # the loader reuses it: read and indexed once
    if first_layout_problem(plan.findings):
        from megatron_preflight.fit.nearest import annotate  # the planner: only for a layout that cannot run

        annotate(plan.findings, plan.index, rt)  # a layout that cannot run: the nearest ones that can
    allow_missing = bool(getattr(args, "preflight_allow_missing_checkpoint", False))
    if allow_missing and plan.layout.format is None and any(
            p.code in ("not_megatron", "no_iterations") for p in plan.layout.problems):
        return Decision(mode, Verdict.SKIP, None, checkpoint=load_dir,
                        report=f"no checkpoint in {load_dir}; starting from scratch (--preflight-allow-missing-checkpoint)")
    verdict = plan.verdict
    report = render_plan(plan)
    if mode == "check" and plan.verdict == Verdict.RESHARD:
        verdict = Verdict.FAIL
        report += ("\n--preflight check loads as Megatron would, and Megatron cannot load this legacy checkpoint at "
                   "another layout. Fix: run with --preflight auto (in-memory reshard), or reshard offline: "
                   + advice.offline_fix(plan.layout, rt) + ".")
    if verdict == Verdict.FAIL and plan.layout.format is None and not allow_missing:
        report += ("\nIf starting from scratch is intended, add --preflight-allow-missing-checkpoint.")
    target = dataclasses.replace(reshard.TargetLayout.from_args(args), optimizer_family=rt.optimizer_family,
                                 mamba_conv_name=rt.mamba_conv_name) if plan.loader == Loader.RESHARD else None
    return Decision(mode, verdict, plan.loader, plan.load_optimizer, plan.load_rng, load_dir, target, report,
                    plan.to_json())


def _remote_decision(args: Any, mode: str, url: str) -> Decision:
    """The decision on an ``msc://`` checkpoint: its metadata staged (remote/mirror.py), judged as a local one, the
    report naming the URL. Megatron's own loaders read it from the store themselves; the resharder reads each rank's
    bytes into its node's mirror (hook/remote_load.py). A run with MSC off is refused first: Megatron-LM then finds
    no tracker at the URL, warns, trains from scratch and exits 0 (seen with Megatron-LM main)."""
    if getattr(args, "enable_msc", None) is False:
        fix = "add --enable-msc" if hasattr(args, "disable_msc_deprecated") else "remove --disable-msc"
        return Decision(mode, Verdict.FAIL, None, checkpoint=url, exit_code=EXIT_USAGE,
                        report=f"--load {url} is an object-storage URL and this run has MSC off: Megatron-LM then "
                               "finds no checkpoint there ('could not find the metadata file'), trains from scratch "
                               f"and exits 0. Fix: {fix} (with multi-storage-client installed and MSC_CONFIG naming "
                               "the profile), or --load a local copy.")
    from megatron_preflight.remote.mirror import Mirror  # (an msc:// load only)

    try:
        mirror = Mirror(url)
    except PreflightError as exc:
        if exc.code == NO_OBJECTS and exc.path == url.rstrip("/") and \
                getattr(args, "preflight_allow_missing_checkpoint", False):  # (not a malformed URL's usage error)
            return Decision(mode, Verdict.SKIP, None, checkpoint=url,
                            report=f"no checkpoint under {url}; starting from scratch "
                                   "(--preflight-allow-missing-checkpoint)")
        raise
    with mirror:
        mirror.stage_metadata()
        d = _make_decision(args, mode, mirror.local)
        index = STATE.indexes.pop(os.path.abspath(mirror.local), None)  # (its files go with the mirror)
        d.checkpoint = url
        d.report = mirror.shown(d.report) + f"\n{mirror.summary()} (metadata only)"
        if d.loader == Loader.RESHARD and d.target is not None and index is not None:
            d.report += "\n" + _fetch_estimate(index, d, mirror.size)
        d.plan = json.loads(mirror.shown(json.dumps(d.plan, default=str)))
    return d


def _fetch_estimate(index: Any, d: Decision, size: int) -> str:
    """What the in-memory reshard of a remote checkpoint fetches: the bytes of the largest rank's plan (planned at
    the representative ranks of a large target), besides its node's metadata."""
    # a remote reshard only
    from megatron_preflight.remote.mirror import STAGING_ENV
    from megatron_preflight.reshard.sources.byte_ranges import total

    r = reshard.open_resharder(index, d.target, keep_optimizer=d.load_optimizer)
    every = naming.shard_writers(r.tgt)
    names = reshard.representative_ranks(r.tgt) if len(every) > 64 else list(every)
    most = max((total(r.byte_ranges(r.plan_for_coords(every[n], n))) for n in names), default=0)
    return (f"load: each rank fetches its own bytes into its node's staged mirror, the largest {human_bytes(most)} "
            f"of {human_bytes(size)} (staged in memory where it fits, else the temp dir; ${STAGING_ENV} chooses)")


def _error_decision(mode: str, load_dir: str, exc: BaseException) -> Decision:
    if isinstance(exc, OSError):
        exc = environment_error(exc)
    if isinstance(exc, PreflightError):
        text = str(exc)
        if is_msc(load_dir) and exc.code == NO_OBJECTS and exc.path == load_dir.rstrip("/"):
            return Decision(mode, Verdict.FAIL, None, checkpoint=load_dir, exit_code=EXIT_USAGE,
                            report=f"--load {load_dir}: {text} If starting from scratch is intended, add "
                                   "--preflight-allow-missing-checkpoint (or run with --preflight off).")
        if not is_msc(load_dir) and not os.path.lexists(load_dir):  # the --load dir itself
            return Decision(mode, Verdict.FAIL, None, checkpoint=load_dir, exit_code=EXIT_USAGE,
                            report=f"--load {load_dir}: no such directory. Fix: pass the --load dir of the run; if "
                                   "starting from scratch is intended, add --preflight-allow-missing-checkpoint (or "
                                   "run with --preflight off).")
        if exc.code == "usage":
            return Decision(mode, Verdict.FAIL, None, checkpoint=load_dir, report=text, exit_code=EXIT_USAGE)
    else:
        text = (f"internal error while checking the checkpoint ({type(exc).__name__}: {exc}); this is a bug in "
                "megatron-preflight: rerun with --preflight off to bypass it, and report it")
    return Decision(mode, Verdict.FAIL, None, checkpoint=load_dir, report=text)


def preflight(args: Any) -> Decision | None:
    """Run the pre-flight check for Megatron ``args`` (all ranks call it). Exits every rank on a fatal verdict."""
    mode = getattr(args, "preflight", "off") or "off"
    if mode == "off":
        return None
    load_dir = getattr(args, "load", None) or getattr(args, "pretrained_checkpoint", None)
    if not load_dir:
        STATE.decision = Decision(mode, Verdict.SKIP, None, report="no --load: nothing to check")
        return STATE.decision
    remote = storage.is_url(load_dir)
    if remote and not is_msc(load_dir):  # a URL Megatron does not read either (it reads msc://): left to Megatron
        STATE.decision = Decision(mode, Verdict.SKIP, None, checkpoint=load_dir,
                                  report=f"--load {load_dir} is a URL of a scheme read through no msc profile: not "
                                         "checked; Megatron loads it as it would without the plugin")
        _say(STATE.decision.report)
        return STATE.decision
    make = _remote_decision if remote else _make_decision
    decision = consensus.decide_on_rank0(lambda: make(args, mode, load_dir),
                                         lambda exc: _error_decision(mode, load_dir, exc))
    STATE.decision = decision
    report_path = getattr(args, "preflight_report", None)
    if report_path and consensus.rank() == 0:
        tmp = report_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(asdict(decision), fh, indent=1, default=str)
        os.replace(tmp, report_path)
    if decision.verdict == Verdict.FAIL:
        if consensus.rank() == 0:
            print("\n".join(f"[megatron-preflight] {line}" for line in decision.report.splitlines()),
                  file=sys.stderr, flush=True)
            print(f"[megatron-preflight] the job must not start: stopping every rank (exit {decision.exit_code}; "
                  "--preflight off leaves the decision to Megatron)", file=sys.stderr, flush=True)
        exit_job(decision.exit_code)
    apply_decision(args, decision)
    return decision


def fail_load(exc: BaseException) -> None:
    """The in-memory reshard failed on this rank: one message naming the file and the fix (no traceback), then exit 1
    (torchrun stops the other ranks)."""
    what = exc.render() if isinstance(exc, PreflightError) else f"{type(exc).__name__}: {exc}"
    print(f"[megatron-preflight] rank {consensus.rank()}: loading through the resharder failed: {what}",
          file=sys.stderr, flush=True)
    exit_job(EXIT_FAIL)


def exit_job(code: int) -> NoReturn:
    """Leave the job now with ``code``.

    With peers (a process group of more than one rank) the process ends at once, after flushing what it printed and
    logged: no communicator teardown and no interpreter shutdown, either of which can abort the process (SIGABRT,
    exit -6 instead of ``code``) when a peer has already left — seen with gloo on a loaded 2-core box. Every rank got
    the same decision and no collective follows, so nothing is left to say to the others; torchrun reports ``code``.
    Alone, it raises SystemExit (callers and in-process tests can catch it).
    """
    if consensus.world_size() <= 1:
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say
            pass
    os._exit(code)


def apply_decision(args: Any, d: Decision) -> None:
    """Set the args the chosen loader needs; say so on rank 0."""
    if d.verdict == Verdict.SKIP:
        _say(d.report)
        return
    version = running_version()
    took = [f"judged for megatron-core {version}"] if version else []
    if d.plan.get("seconds") is not None:
        took.append(f"check {d.plan['seconds']:.2f} s on rank 0")
    said = f" ({'; '.join(took)})" if took else ""
    _say(f"checkpoint {d.checkpoint}: verdict {d.verdict.value}, loader {d.loader.value if d.loader else '-'}{said}")
    if d.mode in ("auto", "verify") and d.loader == Loader.DIST and not getattr(args, "auto_detect_ckpt_format", False) and \
            getattr(args, "ckpt_format", "torch_dist") == "torch":
        args.auto_detect_ckpt_format = True
        d.applied.append("auto_detect_ckpt_format=True")
    if d.loader == Loader.RESHARD:
        if not getattr(args, "no_load_rng", False):
            args.no_load_rng = True
            d.applied.append("no_load_rng=True (RNG state cannot be mapped to another layout)")
        if not d.load_optimizer and not getattr(args, "no_load_optim", False):
            args.no_load_optim = True
            d.applied.append("no_load_optim=True (the checkpoint holds no optimizer state to reshard)")
    elif not d.load_rng and not getattr(args, "no_load_rng", False):
        args.no_load_rng = True
        d.applied.append("no_load_rng=True")
    for item in d.applied:
        _say(f"applied: {item}")
