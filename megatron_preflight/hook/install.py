"""Install the hook into Megatron-LM by wrapping module attributes (no Megatron file is edited).

Seams (names are looked up at call time in the importing module, so each is patched where it is used):

* ``megatron.training.arguments.add_megatron_arguments`` — adds ``--preflight`` & co. to every Megatron parser
  (the script's own ``extra_args_provider`` still runs after it). Megatron-LM before 2025-03 (core <= 0.11) has no
  such function: there ``parse_args`` is wrapped instead (in ``arguments`` and where ``initialize`` imported it), so
  its ``extra_args_provider`` also adds the preflight flags;
* ``megatron.training.training.setup_model_and_optimizer`` — runs the check after torch.distributed and the
  parallel state are up and before the model, optimizer and data loaders are built;
* ``megatron.training.training.load_checkpoint`` and ``megatron.training.checkpointing.load_checkpoint`` — load
  through the chosen loader;
* ``megatron.training.checkpointing._load_base_checkpoint`` — replaced, only during a ``reshard`` load, by the
  in-memory resharder.
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

from megatron_preflight.check.verdict import Loader
from megatron_preflight.errors import PreflightError
from megatron_preflight.gc_budget import fewer_collections
from megatron_preflight.hook import early, legacy_load, remote_load, runtime, save_fingerprint, verify
from megatron_preflight.hook import state as state_mod
from megatron_preflight.hook.flags import add_preflight_arguments

log = logging.getLogger("megatron_preflight")

# Each run through its own pretrain_gpt.py on CPU (tests/hook/test_megatron_releases.py; README "Megatron-LM releases")
CHECKED_VERSIONS = ("Megatron-LM main d98e8a64 (2026-08-22, megatron-core 0.20.0)",
                    *(f"Megatron-LM core_r0.{m}.0" for m in range(19, 12, -1)))
# The argument seam: the newer function, or (older Megatron-LM) parse_args, where it is defined and where it is used.
ARGS_SEAMS = (("megatron.training.arguments", "add_megatron_arguments"),
              ("megatron.training.arguments", "parse_args"))
PARSE_ARGS_USERS = ("megatron.training.initialize",)

REQUIRED = (
    ("megatron.training.training", "setup_model_and_optimizer"),
    ("megatron.training.training", "load_checkpoint"),
    ("megatron.training.checkpointing", "load_checkpoint"),
    ("megatron.training.checkpointing", "_load_base_checkpoint"),
    ("megatron.training.global_vars", "get_args"),
)

_INSTALLED = False


def _resolve(module: str, name: str) -> tuple[Any, Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise PreflightError(
            f"cannot import {module} ({exc}); megatron-preflight's hook needs Megatron-LM (megatron.training) on "
            "the Python path", fix="run from a Megatron-LM checkout (or add it to PYTHONPATH); checked with: "
            + "; ".join(CHECKED_VERSIONS), code="megatron_version") from None
    if not hasattr(mod, name):
        raise PreflightError(
            f"this Megatron-LM has no {module}.{name}, which the hook wraps; it is another Megatron-LM version",
            fix="use --preflight off with this version, or a supported one: " + "; ".join(CHECKED_VERSIONS),
            code="megatron_version")
    return mod, getattr(mod, name)


def _wrapped(fn: Callable) -> bool:
    return bool(getattr(fn, "__megatron_preflight__", False))


def _mark(fn: Callable) -> Callable:
    fn.__megatron_preflight__ = True  # type: ignore[attr-defined]
    return fn


def _install_args_seam(add_preflight_arguments: Callable) -> None:
    """Add the preflight flags to Megatron's parser, through whichever seam this Megatron-LM has."""
    args_mod = importlib.import_module("megatron.training.arguments")
    add_args = getattr(args_mod, "add_megatron_arguments", None)
    if add_args is not None:
        if not _wrapped(add_args):
            @functools.wraps(add_args)
            def add_megatron_arguments(parser, *a, **k):
                parser = add_args(parser, *a, **k)
                return add_preflight_arguments(parser)

            args_mod.add_megatron_arguments = _mark(add_megatron_arguments)
        return
    _, parse = _resolve(*ARGS_SEAMS[1])  # older Megatron-LM: no add_megatron_arguments
    if _wrapped(parse):
        return

    @functools.wraps(parse)
    def parse_args(extra_args_provider=None, *a, **k):
        def provider(parser):
            parser = add_preflight_arguments(parser)
            return extra_args_provider(parser) if extra_args_provider is not None else parser

        return parse(provider, *a, **k)

    wrapped = _mark(parse_args)
    args_mod.parse_args = wrapped
    _rebind("parse_args", parse, wrapped, PARSE_ARGS_USERS)


def _rebind(name: str, original: Callable, wrapped: Callable, users: tuple[str, ...]) -> None:
    """Point each module of ``users`` that imported ``original`` under ``name`` at ``wrapped``."""
    for user in users:
        try:
            mod = importlib.import_module(user)
        except ImportError:  # pragma: no cover - not every version has it
            continue
        if getattr(mod, name, None) is original:
            setattr(mod, name, wrapped)


def _install_validate_seam() -> None:
    """Before Megatron validates the args, the layout checks that need only the args and the world size run on every
    rank (hook/early.py): an impossible layout is answered by the plugin, every rank exits 1. Anything else
    validate_args refuses gets rank 0's nearest fitting layouts (hook/runtime.advise_layout), then Megatron's error
    as before."""
    args_mod = importlib.import_module("megatron.training.arguments")
    validate = getattr(args_mod, "validate_args", None)
    if validate is None or _wrapped(validate):
        return

    @functools.wraps(validate)
    def validate_args(args, *a, **k):
        early.check_at_parse(args)
        try:
            return validate(args, *a, **k)
        except (AssertionError, ValueError) as exc:
            runtime.advise_layout(args, exc)
            raise

    wrapped = _mark(validate_args)
    args_mod.validate_args = wrapped
    _rebind("validate_args", validate, wrapped, ("megatron.training.initialize", "megatron.training"))


def install() -> None:
    """Patch Megatron-LM in this process. Idempotent. Raises PreflightError naming anything missing."""
    global _INSTALLED
    if _INSTALLED:
        return
    resolved = {(m, n): _resolve(m, n) for m, n in REQUIRED}
    _install_args_seam(add_preflight_arguments)
    _install_validate_seam()

    training_mod, setup = resolved[("megatron.training.training", "setup_model_and_optimizer")]
    _, get_args = resolved[("megatron.training.global_vars", "get_args")]
    if not _wrapped(setup):
        @functools.wraps(setup)
        def setup_model_and_optimizer(*a, **k):
            with fewer_collections():
                runtime.preflight(get_args())
            return setup(*a, **k)

        training_mod.setup_model_and_optimizer = _mark(setup_model_and_optimizer)

    ckpt_mod, base_loader = resolved[("megatron.training.checkpointing", "_load_base_checkpoint")]

    def make_load_wrapper(original: Callable) -> Callable:
        @functools.wraps(original)
        def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *a, **k):
            decision = runtime.current()
            if decision is None or decision.loader != Loader.RESHARD or load_arg != "load":
                result = original(ddp_model, optimizer, opt_param_scheduler, load_arg, *a, **k)
                if decision is not None and decision.mode == "verify" and load_arg == "load":
                    verify.verify_after_load(ddp_model, get_args(), optimizer)
                if load_arg == "load":
                    remote_load.release(getattr(get_args(), "load", None))
                return result

            def reshard_base(load_dir, args, rank0=False, sharded_state_dict=None, *ba, **bk):
                # Megatron-LM is optional: present only inside a Megatron job
                from megatron.training.checkpointing import CheckpointType

                with fewer_collections():
                    state, name, release = legacy_load.resharded_state_dict(load_dir, args, rank0=rank0,
                                                                            optimizer=optimizer, model=ddp_model)
                return state, name, release, CheckpointType.LEGACY

            def fsdp_base(load_dir, args, rank0=False, sharded_state_dict=None, *ba, **bk):
                # Megatron-LM and torch's DCP: present only inside a Megatron-FSDP job
                from megatron.training.checkpointing import CheckpointType

                from megatron_preflight.hook import fsdp_load  # torch's DCP: only a Megatron-FSDP job loads it

                with fewer_collections():
                    state, name, release = fsdp_load.fsdp_base(load_dir, args, rank0=rank0,
                                                               sharded_state_dict=sharded_state_dict,
                                                               checkpointing=ckpt_mod)
                return state, name, release, CheckpointType.FSDP_DTENSOR

            fsdp = bool(getattr(get_args(), "use_megatron_fsdp", False))
            ckpt_mod._load_base_checkpoint = fsdp_base if fsdp else reshard_base
            # A distributed optimizer reads distrib_optim.pt by path after the model: serve it from memory too.
            restore = (lambda: None) if fsdp else legacy_load.serve_parameter_state(optimizer, get_args(), ddp_model)
            started = time.perf_counter()
            try:
                result = original(ddp_model, optimizer, opt_param_scheduler, load_arg, *a, **k)
            except PreflightError as exc:  # our own, clear errors: one message and exit 1, never a traceback
                runtime.fail_load(exc)
                raise
            finally:
                ckpt_mod._load_base_checkpoint = base_loader
                restore()
            spent = state_mod.STATE.seconds
            runtime._say(f"loaded through the in-memory resharder (iteration {result[0] if result else '?'}; "
                         f"load_checkpoint {time.perf_counter() - started:.2f} s on rank 0, of which the shared "
                         f"index {spent.get('index', 0.0):.2f} s, reading and building its state "
                         f"{spent.get('build', 0.0):.2f} s)")
            if decision.mode == "verify":
                verify.verify_after_load(ddp_model, get_args(), optimizer)
            remote_load.release(getattr(get_args(), "load", None))
            return result

        return _mark(load_checkpoint)

    for module in ("megatron.training.training", "megatron.training.checkpointing"):
        mod, fn = resolved[(module, "load_checkpoint")]
        if not _wrapped(fn):
            mod.load_checkpoint = make_load_wrapper(fn)

    pending: list[Callable[[], None]] = []  # an asynchronous save's fingerprinting, until its request is scheduled

    def make_save_wrapper(original: Callable) -> Callable:
        @functools.wraps(original)
        def save_checkpoint(iteration, model, optimizer, *a, **k):
            args = get_args()
            why = save_fingerprint.skipped(args, k)
            asynchronous = why is None and bool(getattr(args, "async_save", False))
            if asynchronous:  # fingerprinted by the request's last finalize function (see schedule_async_save)
                with_optimizer = optimizer is not None and not getattr(args, "no_save_optim", False)
                pending[:] = [lambda: save_fingerprint.fingerprint_after_finalize(args, iteration, with_optimizer)]
            during = save_fingerprint.start_during_save(model, optimizer, args) if why is None and not asynchronous \
                else None
            started = time.perf_counter()
            try:
                result = original(iteration, model, optimizer, *a, **k)
            finally:
                left, pending[:] = list(pending), []
            saved = time.perf_counter() - started
            if asynchronous and left:
                runtime._say(f"fingerprints at save (iteration {iteration}): not taken (this Megatron's asynchronous "
                             "save has no request to finalize them with); run `megatron-preflight fingerprint` on the "
                             "checkpoint once it is finalized")
            elif why is None and not asynchronous:
                save_fingerprint.fingerprint_after_save(model, optimizer, args, iteration, saved, during)
            elif why == "off":  # the save's own time: what fingerprints would add to, measured the same way
                runtime._say(f"fingerprints at save (iteration {iteration}): off (the save itself {saved:.2f} s)")
            elif why not in (None, "disabled"):
                runtime._say(f"fingerprints at save (iteration {iteration}): {why}")
            return result

        return _mark(save_checkpoint)

    def make_schedule_wrapper(original: Callable) -> Callable:
        @functools.wraps(original)
        def schedule_async_save(request, *a, **k):
            if pending and request is not None:  # the checkpoint's request (scheduled first): ours runs last
                fn = pending.pop()
                if hasattr(request, "add_finalize_fn"):
                    request.add_finalize_fn(fn)
                else:
                    request.finalize_fns.append(fn)
            return original(request, *a, **k)

        return _mark(schedule_async_save)

    for module in ("megatron.training.training", "megatron.training.checkpointing"):
        mod = importlib.import_module(module)
        fn = getattr(mod, "save_checkpoint", None)
        if fn is not None and not _wrapped(fn):
            mod.save_checkpoint = make_save_wrapper(fn)
    ckpt = importlib.import_module("megatron.training.checkpointing")
    fn = getattr(ckpt, "schedule_async_save", None)
    if fn is not None and not _wrapped(fn):
        ckpt.schedule_async_save = make_schedule_wrapper(fn)
    _INSTALLED = True
    log.debug("megatron-preflight hook installed")
