"""``megatron-preflight plan``: the table, the JSON, each layout's flags (read back by check as that layout, and
checked as the run), exit codes, bad input."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.cli.main import main
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS as TINY

MOE = [*TINY, "--num-experts", "4", "--no-load-rng", "--micro-batch-size", "1", "--global-batch-size", "16"]


def test_plan_ranks_the_layouts_and_checks_the_top_ones(capsys):
    rc = main(["plan", fixture_path("moe_ep2_torch"), "--world-size", "8", "--json", "--", *MOE])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    cands = doc["candidates"]
    assert doc["layouts"] >= len(cands) == 10 and doc["world_size"] == 8
    top = cands[0]
    assert (top["tp"], top["pp"], top["ep"], top["cp"], top["load"]) == (1, 1, 2, 1, "as saved")
    assert top["check"]["verdict"] == "load" and cands[3]["check"] is None  # (--check-top 3)
    for c in cands:  # the printed flags are the run's, at exactly that layout
        rt = from_cli([*c["flags"], "--world-size", "8"])
        assert (rt.tp, rt.pp, rt.ep, rt.etp, rt.cp) == (c["tp"], c["pp"], c["ep"], c["etp"], c["cp"]), c["flags"]
        assert c["flags"][:len(TINY)] == TINY
        assert c["memory"]["total"] > 0
    reshards = [c for c in cands if c["load"] == "preflight reshards"]
    assert reshards and [c["load"] for c in cands] == sorted((c["load"] for c in cands),
                                                             key=["as saved", "preflight reshards"].index)


def test_a_device_size_ranks_fitting_layouts_first_and_a_reshard_names_its_cost(capsys):
    rc = main(["plan", fixture_path("moe_ep2_torch"), "--world-size", "4", "--device-memory", "0.00085", "--json",
               "--", *MOE])
    assert rc == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    fits = [c["fits"] for c in cands]
    assert fits[0] and fits == sorted(fits, reverse=True)
    assert all(c["memory"]["total"] <= 0.9 * 0.00085 * 2**30 for c in cands if c["fits"])
    top = cands[0]
    assert top["load"] == "preflight reshards" and top["check"]["verdict"] == "reshard"
    assert "each rank reads at most" in top["check"]["cost"]


def test_no_layout_fits_exits_1(capsys):
    rc = main(["plan", fixture_path("tp2_torch"), "--world-size", "2", "--device-memory", "0.0001", "--", *TINY])
    out = capsys.readouterr().out
    assert rc == 1 and "0 fit" in out


def test_the_table_without_run_flags_uses_the_saved_args(capsys):
    assert main(["plan", fixture_path("pp2_torch"), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "saved at TP1 PP2" in out and "no run flags given" in out
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2" in out


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for argv, words in ((["plan", fixture_path("tp2_torch")], "--world-size"),
                        (["plan", fixture_path("tp2_torch"), "--world-size", "0"], "must be positive"),
                        (["plan", str(tmp_path), "--world-size", "8"], "not a Megatron checkpoint")):
        r = subprocess.run([sys.executable, "-m", "megatron_preflight.cli.main", *argv], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode in (1, 2) and words in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)


def test_the_printed_flags_run_as_printed_through_check(capsys):
    """Text output: each layout's flags line, pasted after `check CKPT --`, is that layout and may start."""
    assert main(["plan", fixture_path("moe_ep2_torch"), "--world-size", "8", "--top", "3", "--", *MOE]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("flags (the run's flags at each layout):")
    numbered = [x for x in lines[start + 1:] if x.split(None, 1)[0].isdigit()]  # (a check's cost line follows some)
    assert len(numbered) == 3
    for line in numbered:
        flags = shlex.split(line.split(None, 1)[1])
        assert main(["check", fixture_path("moe_ep2_torch"), "--", *flags, "--world-size", "8"]) == 0


def test_a_damaged_checkpoint_is_one_paragraph_naming_the_file_and_exit_1(real_fixture):
    """A missing shard of a legacy checkpoint: the plan names it (as inspect does) instead of planning from half a
    model; the source is not written to."""
    import os
    import shutil

    root = real_fixture("pp2_torch")
    shard = os.path.join(root, "iter_0000002", "mp_rank_00_001")
    shutil.rmtree(shard)
    before = sorted(os.listdir(root))
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "plan", root, "--world-size", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "mp_rank_00_001" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(root)) == before


def test_a_megatron_fsdp_run_of_an_fsdp_checkpoint_loads_it_at_other_layouts_only_at_the_saved_vocab_padding(capsys):
    """fsdp_gqa_untied_rope (TP1, vocab padded to 128) planned for a Megatron-FSDP run on 2 GPUs: TP1 loads as saved,
    TP2 (the vocab padded to 256, which Megatron-FSDP does not load) is a preflight reshard; with the divisor that
    keeps 128 at TP2, Megatron-FSDP loads it itself. Each layout's class agrees with check of its flags."""
    run = [*TINY, "--transformer-impl", "transformer_engine", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
           "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--no-load-rng"]
    expected = {(): {1: ("as saved", "load"), 2: ("preflight reshards", "reshard")},
                ("--make-vocab-size-divisible-by", "64"): {1: ("as saved", "load"), 2: ("Megatron reshards", "load")}}
    for extra, by_tp in expected.items():
        rc = main(["plan", fixture_path("fsdp_gqa_untied_rope"), "--world-size", "2", "--json", "--check-top", "4",
                   "--", *run, *extra])
        assert rc == 0
        cands = json.loads(capsys.readouterr().out)["candidates"]
        got = {c["tp"]: (c["load"], c["check"]["verdict"]) for c in cands if c["cp"] == 1}
        assert got == by_tp, (extra, got)


def test_a_device_of_no_memory_is_a_usage_error(capsys):
    for gib in ("0", "-3"):
        assert main(["plan", fixture_path("tp2_torch"), "--world-size", "8", "--device-memory", gib]) == 2
        assert "--device-memory must be a positive number of GiB" in capsys.readouterr().err
