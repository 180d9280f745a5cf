"""``megatron-preflight`` command line: inspect, check, plan, reshard, diff, fingerprint, flags."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from megatron_preflight.cli import (
    check_cmd,
    diff_cmd,
    fingerprint_cmd,
    flags_cmd,
    inspect_cmd,
    plan_cmd,
    reshard_cmd,
)
from megatron_preflight.cli.common import EXIT_PROBLEMS, EXIT_USAGE
from megatron_preflight.cli.remote_args import staged_args
from megatron_preflight.errors import PreflightError, environment_error
from megatron_preflight.gc_budget import fewer_collections, no_collections

log = logging.getLogger("megatron_preflight")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors exit 2 with one line, as argparse does
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# the subcommands, in the order the top-level help lists them
COMMANDS = {"inspect": inspect_cmd, "check": check_cmd, "plan": plan_cmd, "reshard": reshard_cmd, "diff": diff_cmd,
            "fingerprint": fingerprint_cmd, "flags": flags_cmd}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The program's parser. ``command``: only that subcommand gets its arguments (the others are listed by name and
    help, all the top-level help shows; ~240 arguments in all took ~8 ms to build, at every start)."""
    parser = _Parser(prog="megatron-preflight",
                     description="Pre-flight checks and resharding for Megatron-LM checkpoints.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        module.add_parser(sub, arguments=command is None or name == command)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option: the top level's only option is a
    switch), or None when that is not one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


class Terminated(BaseException):
    """SIGTERM (a scheduler stopping the job): unwinds like Ctrl-C, so partial output is removed."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail on the closed pipe again."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass


def _missing_dependency(exc: BaseException) -> str | None:
    """The top-level package a failed import of another project names (torch, numpy, yaml...), else None."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    return None if top == __name__.split(".")[0] else top


# commands that read metadata only and answer in seconds: no cyclic garbage collection while they run (gc_budget)
VERDICTS = frozenset({"inspect", "check", "plan"})


def entry() -> int:
    """The ``megatron-preflight`` program (its console script, ``python -m megatron_preflight``): :func:`main` in a
    process that ends when it returns."""
    return main(process_ends=True)


def main(argv: list[str] | None = None, *, process_ends: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # megatron flags after `--` go to the subcommand untouched
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser(_command_in(argv))
    ns = parser.parse_args(argv)
    ns.megatron_args = extra
    logging.basicConfig(level=logging.DEBUG if ns.debug else logging.WARNING, format="%(levelname)s %(message)s")
    func: Callable[[argparse.Namespace], int] = ns.func
    main_thread = threading.current_thread() is threading.main_thread()  # signals can only be set there
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        with no_collections(restore=not process_ends) if ns.command in VERDICTS else fewer_collections(), \
                staged_args(ns):
            return func(ns)
    except Terminated:
        print("megatron-preflight: terminated (SIGTERM); nothing was left at the destination", file=sys.stderr)
        return 143
    except PreflightError as exc:
        print(f"megatron-preflight: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.code == "usage" else EXIT_PROBLEMS
    except KeyboardInterrupt:
        print("megatron-preflight: interrupted; nothing was left at the destination", file=sys.stderr)
        return 130
    except BrokenPipeError:  # whoever read stdout stopped (`| head`): end as a Unix tool killed by SIGPIPE, quietly
        _drop_stdout()
        return 141
    except OSError as exc:  # the environment (disk, filesystem, permissions), not this tool
        print(f"megatron-preflight: {environment_error(exc)}", file=sys.stderr)
        return EXIT_PROBLEMS
    except Exception as exc:  # never a raw traceback for the user
        if ns.debug:
            raise
        missing = _missing_dependency(exc)
        if missing:  # a broken install, not a bug
            print(f"megatron-preflight: {ns.command} needs the Python package {missing!r}, which this environment "
                  f"({sys.executable}) does not have. Fix: install megatron-preflight with its dependencies (pip "
                  "install -e . in its checkout; pip install torch==2.13.0 for torch's CPU build).", file=sys.stderr)
            return EXIT_PROBLEMS
        print(f"megatron-preflight: internal error ({type(exc).__name__}: {exc}). This is a bug in megatron-preflight, "
              "not in your checkpoint; rerun with --debug and report the traceback.", file=sys.stderr)
        return 3
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
