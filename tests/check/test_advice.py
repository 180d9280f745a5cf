"""Every command ``check`` prints is a promise: for every fixture and a run that resumes it the way users write runs
(the size flags left out, or one size changed), each offline reshard a finding names is run exactly as printed (only
the ``NEW_DIR`` placeholder substituted), and ``check`` of what it wrote, with the same run flags, says the run loads
it as is. The round trip of the printed layout flags (they give ``reshard`` the layout ``check`` compared) is proven
for every run without writing anything."""

from __future__ import annotations

import os
import shlex

import pytest

from megatron_preflight.check import advice
from megatron_preflight.check.compare import check_runtime_layout
from megatron_preflight.check.plan import make_plan
from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.check.verdict import Verdict
from megatron_preflight.cli.main import main
from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import TargetLayout
from tests.conftest import FIXTURES
from tests.helpers.advised import advised, commands_in, follow
from tests.helpers.run_flags import model_flags


def _fixtures() -> list[str]:
    return sorted(n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n)))


def _runs(name: str) -> list[tuple[str, list[str]]]:
    """The run that leaves every size at Megatron's default, and runs that change one size of the saved layout (the
    others written out as saved): those the model admits (ETP 1 where MoE biases need it; no uneven PP)."""
    root = os.path.join(FIXTURES, name)
    layout = discover(root)
    saved = {"tp": layout.tp or 1, "pp": layout.pp or 1, "ep": layout.ep or 1}
    runs = [("defaults", model_flags(root))]
    experts = bool(getattr(layout.saved_args, "num_experts", None))
    for key in ("tp", "pp", "ep"):
        if key == "ep" and not experts:
            continue
        if key == "pp" and getattr(layout.saved_args, "use_megatron_fsdp", False):
            continue  # (a Megatron-FSDP run does not build with PP: check/fsdp.py)
        sizes = dict(saved, **{key: 1 if saved[key] > 1 else 2})
        if not experts:
            sizes.pop("ep")
        for extra in ({}, {"etp": 1}):
            flags = model_flags(root, **sizes, **extra)
            if not check_runtime_layout(from_cli(flags, env={})):
                runs.append((f"{key}{sizes[key]}", flags))
                break
    return runs


CASES = [(name, label, flags) for name in _fixtures() for label, flags in _runs(name)]


def _plan(root: str, flags: list[str]):
    return make_plan(root, from_cli(flags, env={}))


def _commands(plan) -> list[str]:
    return commands_in([f.fix for f in plan.findings])


@pytest.mark.parametrize("name,label,flags", CASES, ids=[f"{n}-{lab}" for n, lab, _ in CASES])
def test_the_printed_layout_flags_give_reshard_the_layout_check_compared(name, label, flags):
    """The flags a command prints after ``--`` read back (as ``reshard`` reads them) to the target of the run."""
    rt = from_cli(flags, env={})
    printed = from_cli(advice.layout_flags(rt), env={})
    named = TargetLayout.from_args(printed, named=printed.given)
    assert named == TargetLayout.from_args(rt, named=rt.given)


@pytest.mark.parametrize("name,label,flags", CASES, ids=[f"{n}-{lab}" for n, lab, _ in CASES])
def test_each_advised_reshard_run_as_printed_writes_what_the_run_loads(tmp_path, capsys, name, label, flags):
    root = os.path.join(FIXTURES, name)
    plan = _plan(root, flags)
    if [f.field for f in plan.fatal] == ["optimizer"] and "add --no-load-optim" in plan.fatal[0].fix:
        flags = [*flags, "--no-load-optim"]  # a state that cannot follow this layout (SOAP at another TP): as printed
        plan = _plan(root, flags)
    commands = _commands(plan)
    assert plan.verdict != Verdict.FAIL, [(f.field, f.message) for f in plan.fatal]
    if plan.verdict == Verdict.RESHARD and plan.layout.format.value == "torch":
        assert commands, "a legacy checkpoint at another layout: check names the offline reshard"
    if not commands:
        pytest.skip(f"check names no command for this run ({plan.verdict.value})")
    for i, cmd in enumerate(commands):
        dst = str(tmp_path / f"new{i}")
        argv = [dst if word == advice.PLACEHOLDER else word for word in shlex.split(cmd)]
        assert argv[:2] == ["megatron-preflight", "reshard"]
        rc = main(argv[1:4] + ["--no-progress", "--workers", "1"] + argv[4:])  # quiet, in this process
        out = capsys.readouterr()
        assert rc == 0, f"{cmd}\n{out.out}\n{out.err}"
        after = _plan(dst, _load_flags(flags, plan, cmd))
        left = [(f.field, f.severity.value, f.message) for f in after.findings if f.severity.value != "info"]
        assert after.verdict == Verdict.LOAD, f"{cmd}\nstill: {left}"


def _load_flags(flags: list[str], plan, cmd: str) -> list[str]:
    """The run's flags as the advice's ``then ...`` part says to load the new directory (a format it names)."""
    fix = next(f.fix for f in plan.findings if cmd in f.fix)
    then = fix.split(cmd, 1)[1].removeprefix(", then ").split(";")[0]
    extra = [w for w in shlex.split(then) if w not in ("--load", advice.PLACEHOLDER)]
    return flags + extra


def test_a_printed_command_runs_in_a_shell_word_for_word(tmp_path):
    """The console script itself, given the printed text through a shell (quoting included), from check's own
    process and JSON."""
    root = os.path.join(FIXTURES, "hyb_tp2_torch")
    flags = model_flags(root)
    verdict, commands = advised(root, flags)
    assert verdict == "reshard" and len(commands) == 1
    dst = str(tmp_path / "new dir")  # a space: the placeholder is one shell word
    done = follow(commands[0], dst)
    assert done.returncode == 0, done.stderr
    assert _plan(dst, flags).verdict == Verdict.LOAD


def test_a_run_flags_target_the_world_size_cannot_hold_is_a_usage_error(tmp_path, capsys):
    """--world-size (or --nproc-per-node) after -- is the run's: a target it cannot hold says why, exit 2."""
    rc = main(["reshard", os.path.join(FIXTURES, "tp2_torch"), str(tmp_path / "out"), "--",
               "--tensor-model-parallel-size", "4", "--world-size", "6"])
    err = capsys.readouterr().err
    assert rc == 2 and "world size 6 is not divisible by TP·PP·CP = 4" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
