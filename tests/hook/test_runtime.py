"""The hook's job-start logic under real torch.distributed (gloo, several processes): one reader, one decision,
every rank exits non-zero on a fatal verdict, nobody hangs."""

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_preflight.hook import runtime
from tests.conftest import fixture_path
from tests.helpers.tiny import ARGS

TINY = ARGS

WORKER = textwrap.dedent("""
    import argparse, json, os, sys, time
    import torch.distributed as dist
    rank, world, init, spec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    if rank != 0:
        # Only rank 0 may read the checkpoint: make any read on other ranks blow up.
        import megatron_preflight.layout.discover as d
        def no_read(*a, **k):
            raise AssertionError("rank %d read the checkpoint" % rank)
        d.discover = no_read
        import megatron_preflight.reshard.checkpoint_index as ci
        ci.discover = no_read
    from megatron_preflight.hook import runtime
    args = argparse.Namespace(**spec)
    t = time.time()
    decision = runtime.preflight(args)
    print(json.dumps({"rank": rank, "verdict": decision.verdict, "loader": decision.loader,
                      "no_load_rng": getattr(args, "no_load_rng", None), "seconds": time.time() - t}), flush=True)
    # Leave as the hook's exit_job does: every rank past its last collective, then no communicator teardown and no
    # interpreter shutdown (gloo can abort either, SIGABRT, when a peer has already closed its sockets).
    dist.barrier()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
""")


def run_world(tmp_path, spec, world=3, timeout=400):
    init = str(tmp_path / "init")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), init, json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        out.append((p.returncode, so, se))
    return out


def stderrs(results) -> str:
    """Each rank's exit status and the end of its stderr, in full (a list would be shortened by pytest's repr)."""
    return "\n".join(f"--- rank {r}: exit {rc}\n{se[-3000:]}" for r, (rc, _, se) in enumerate(results))


def test_fatal_verdict_exits_every_rank_with_one_report(tmp_path):
    spec = dict(TINY, preflight="check", load=fixture_path("tp2_torch"), tensor_model_parallel_size=2,
                hidden_size=64, num_layers=8, world_size=2)
    results = run_world(tmp_path, spec)
    assert [rc for rc, _, _ in results] == [1, 1, 1], stderrs(results)
    reports = [se for _, _, se in results if "FAIL" in se]
    assert len(reports) == 1  # rank 0 only
    assert "hidden_size" in reports[0] and "num_layers" in reports[0]
    assert reports[0].count("hidden_size") >= 1 and "Traceback" not in reports[0]


@pytest.mark.parametrize("flag", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                  "expert_model_parallel_size", "expert_tensor_parallel_size",
                                  "context_parallel_size", "num_layers_per_virtual_pipeline_stage"])
def test_a_non_positive_size_is_a_usage_error_on_every_rank(flag):
    """In one process (every rank gets the same decision: see the tests above): exit 2, one line, no traceback."""
    args = argparse.Namespace(**dict(TINY, **{flag: 0}), preflight="check", load=fixture_path("tp2_torch"))
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 2
    assert "size must be a positive integer" in runtime.current().report
    assert "--" + flag.replace("_", "-") in runtime.current().report


def test_every_rank_gets_the_same_decision(tmp_path):
    spec = dict(TINY, preflight="auto", load=fixture_path("tp2_torch"), no_load_optim=True, world_size=3)
    results = run_world(tmp_path, spec)
    assert [rc for rc, _, _ in results] == [0, 0, 0], stderrs(results)
    decisions = [json.loads(so.strip().splitlines()[-1]) for _, so, _ in results]
    assert {(d["verdict"], d["loader"], d["no_load_rng"]) for d in decisions} == {("reshard", "reshard", True)}


def test_check_mode_refuses_what_megatron_cannot_load_and_its_offline_fix_works_as_printed(tmp_path):
    """--preflight check of a PP2 legacy checkpoint in a PP1 job: every rank exits 1; the report's offline reshard,
    run as printed (NEW_DIR substituted), writes what the same job then loads."""
    from tests.helpers.advised import follow

    spec = dict(TINY, preflight="check", load=fixture_path("pp2_torch"), no_load_optim=True, world_size=2)
    results = run_world(tmp_path, spec, world=2)
    assert [rc for rc, _, _ in results] == [1, 1], stderrs(results)
    report = results[0][2]
    assert "--preflight auto" in report
    cmd = report.split("or reshard offline: ", 1)[1].split(", then --load NEW_DIR")[0]
    new = str(tmp_path / "new")
    done = follow(cmd, new)
    assert done.returncode == 0, done.stderr
    second = tmp_path / "second"  # a fresh rendezvous file
    second.mkdir()
    results = run_world(second, dict(spec, load=new), world=2)
    assert [rc for rc, _, _ in results] == [0, 0], stderrs(results)
    assert {json.loads(so.strip().splitlines()[-1])["verdict"] for _, so, _ in results} == {"load"}


def test_missing_checkpoint_fails_unless_allowed(tmp_path):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    args = argparse.Namespace(**TINY, preflight="check", load=str(empty))
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 1
    args.preflight_allow_missing_checkpoint = True
    assert runtime.preflight(args).verdict == "skip"


def test_a_load_dir_that_does_not_exist_names_the_flag_that_allows_it(tmp_path, capsys):
    """Every line the hook prints carries its prefix; the flag that allows starting from scratch is named."""
    args = argparse.Namespace(**TINY, preflight="check", load=str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as exc:
        runtime.preflight(args)
    assert exc.value.code == 2  # a usage error: a flag to fix
    err = capsys.readouterr().err
    assert "--preflight-allow-missing-checkpoint" in err and "no such directory" in err
    assert all(line.startswith("[megatron-preflight] ") for line in err.splitlines()), err
    args.preflight_allow_missing_checkpoint = True
    assert runtime.preflight(args).verdict == "skip"


def test_off_and_no_load_do_nothing():
    args = argparse.Namespace(**TINY, preflight="off", load=fixture_path("pp2_torch"))
    before = dict(vars(args))
    assert runtime.preflight(args) is None and vars(args) == before
    args = argparse.Namespace(**TINY, preflight="check", load=None)
    assert runtime.preflight(args).verdict == "skip"


def test_report_file(tmp_path):
    report = tmp_path / "plan.json"
    args = argparse.Namespace(**dict(TINY, expert_model_parallel_size=2), preflight="auto", num_experts=4,
                              load=fixture_path("moe_ep2_torch"), preflight_report=str(report), world_size=2)
    d = runtime.preflight(args)
    assert d.verdict == "load" and d.loader == "3d-ep"
    j = json.loads(report.read_text())
    assert j["verdict"] == "load" and j["plan"]["layout"]["ep"] == 2


def test_auto_mode_turns_on_format_detection_for_dist_checkpoints():
    args = argparse.Namespace(**dict(TINY, tensor_model_parallel_size=2, world_size=2), load=fixture_path("tp2_torch_dist"),
                              preflight="auto", auto_detect_ckpt_format=False, ckpt_format="torch")
    d = runtime.preflight(args)
    assert d.loader == "dist" and args.auto_detect_ckpt_format is True
    args = argparse.Namespace(**dict(TINY, tensor_model_parallel_size=2, world_size=2), load=fixture_path("tp2_torch_dist"),
                              preflight="check", auto_detect_ckpt_format=False, ckpt_format="torch")
    with pytest.raises(SystemExit):
        runtime.preflight(args)


def test_reshard_report_states_each_ranks_cost_before_any_byte_moves(tmp_path):
    """A reshard decision's report and JSON carry the in-memory cost per rank (from the plans, before loading). (The
    run trains its biased experts at EP 1 through grouped experts: on the local spec Megatron-LM 0.15+ could not.)"""
    report = tmp_path / "plan.json"
    args = argparse.Namespace(**dict(TINY, expert_model_parallel_size=1, transformer_impl="transformer_engine",
                                     moe_grouped_gemm=True), preflight="auto", num_experts=4,
                              load=fixture_path("moe_ep2_torch"), preflight_report=str(report), world_size=1)
    d = runtime.preflight(args)
    assert d.verdict == "reshard" and d.loader == "reshard"
    assert "cost        " in d.report and "each rank reads at most" in d.report
    cost = json.loads(report.read_text())["plan"]["cost"]
    assert cost["mode"] == "in_memory" and cost["bytes_read"] > 0
    assert [r["name"] for r in cost["ranks"]] == ["mp_rank_00"]
    assert cost["ranks"][0]["bytes_read"] == cost["bytes_read"] and cost["ranks"][0]["files_opened"] == 2


def test_the_adam_family_is_read_from_what_this_megatron_core_has(monkeypatch):
    """megatron-core >= 0.15 says which Adam it built (USING_PYTORCH_OPTIMIZER); older releases (0.13, 0.14) have no
    flag, so the class they imported as ``Adam`` says: torch's AdamW, or TE's / apex's FusedAdam. The older module is
    imitated on the installed megatron-core (0.16.1) by removing the flag (a stand-in, named so: no older
    megatron-core is installed in CI; the release matrix runs the real ones)."""
    import torch
    from megatron.core import optimizer as mcore_optimizer

    args = argparse.Namespace(optimizer="adam", optimizer_cpu_offload=False)
    flag = getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", None)
    assert runtime.run_adam_family(args) == ("torch" if flag else "fused")
    monkeypatch.delattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", raising=False)
    monkeypatch.setattr(mcore_optimizer, "Adam", torch.optim.AdamW, raising=False)
    assert runtime.run_adam_family(args) == "torch"
    fused = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": "transformer_engine.pytorch.optimizers"})
    monkeypatch.setattr(mcore_optimizer, "Adam", fused)
    assert runtime.run_adam_family(args) == "fused"
    monkeypatch.setattr(mcore_optimizer, "Adam", type("Other", (), {"__module__": "somewhere.else"}))
    assert runtime.run_adam_family(args) is None
    assert runtime.run_adam_family(argparse.Namespace(optimizer="sgd")) is None
