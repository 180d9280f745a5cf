"""The layout checks at argument parsing (hook/early.py), on Megatron argument namespaces as parsed: every layout a
run cannot have stops every rank with status 1, rank 0 printing each problem with its fix and the nearest layouts the
model can have; the printed layouts are layouts the same check accepts (a printed fix is a promise)."""

from __future__ import annotations

import argparse
import shlex

import pytest

from megatron_preflight.hook import early


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(early, "OTHERS_WAIT_S", 0.0)

# The tiny GPT of the fixtures, as Megatron's parser leaves it before validate_args (derived fields still None).
BASE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=32,
            max_position_embeddings=32, micro_batch_size=1, global_batch_size=12, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
            context_parallel_size=1, num_experts=None, group_query_attention=False, num_query_groups=None,
            transformer_impl="local", preflight="check", load="/ckpt", rank=0)


def ns(**over) -> argparse.Namespace:
    return argparse.Namespace(**{**BASE, **over})


CASES = {
    "TP3 on 4 heads": (dict(tensor_model_parallel_size=3, world_size=3), "--tensor-model-parallel-size",
                       "4 attention heads are not divisible by TP3"),
    "PP3 on 4 layers": (dict(pipeline_model_parallel_size=3, world_size=3), "--pipeline-model-parallel-size",
                        "4 layers are not divisible by PP3"),
    "EP3 on 8 experts": (dict(num_experts=8, expert_model_parallel_size=3, world_size=3, add_bias_linear=False),
                         "--expert-model-parallel-size", "8 experts are not divisible by EP3"),
    "world 3 at TP2": (dict(tensor_model_parallel_size=2, world_size=3), "world size",
                       "world size 3 is not divisible by TP·PP·CP = 2"),
    "CP2 on a 30-token sequence": (dict(context_parallel_size=2, seq_length=30, transformer_impl="transformer_engine",
                                        world_size=2), "--context-parallel-size", "sequence length 30"),
    "VPP without PP": (dict(num_layers_per_virtual_pipeline_stage=2, world_size=1),
                       "--num-layers-per-virtual-pipeline-stage", "a virtual pipeline needs PP > 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_impossible_layout_stops_every_rank_and_rank_0_says_why(name, capsys, monkeypatch):
    over, flag, words = CASES[name]
    with pytest.raises(SystemExit) as exc:
        early.check_at_parse(ns(**over))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert f"[megatron-preflight]   {flag}: " in err and words in err and "Fix: " in err, err
    assert all(line.startswith("[megatron-preflight]") for line in err.splitlines()), err
    assert "--preflight off" in err  # the flag that changes the behaviour
    # every other rank: the same exit, nothing printed, after rank 0 has had the time to print
    slept: list[float] = []
    monkeypatch.setattr(early.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as exc:
        early.check_at_parse(ns(**over, **{"rank": 1}))
    assert exc.value.code == 1 and capsys.readouterr().err == "" and slept == [early.OTHERS_WAIT_S]


@pytest.mark.parametrize("name", [n for n in CASES if n != "VPP without PP"])
def test_the_nearest_layouts_printed_are_layouts_the_check_accepts(name, capsys):
    over, _, _ = CASES[name]
    args = ns(**over)
    with pytest.raises(SystemExit):
        early.check_at_parse(args)
    err = capsys.readouterr().err
    nearest = [line for line in err.splitlines() if "nearest to the run's" in line]
    assert nearest, err
    assert f"megatron-preflight plan /ckpt --world-size {over['world_size']}" in nearest[0]
    choices = nearest[0].split("): ", 1)[1].split("; ")
    assert choices
    for choice in choices:
        flags = shlex.split(choice.split(": ", 1)[1])
        fixed = vars(args).copy()
        for key, value in zip(flags[::2], flags[1::2], strict=True):
            fixed[key.lstrip("-").replace("-", "_")] = int(value)
        assert early.layout_findings(argparse.Namespace(**fixed)) == [], choice


def test_a_layout_that_works_or_preflight_off_passes(capsys):
    early.check_at_parse(ns(tensor_model_parallel_size=2, world_size=4))
    early.check_at_parse(ns(tensor_model_parallel_size=3, world_size=3, preflight="off"))
    early.check_at_parse(ns(tensor_model_parallel_size=3, world_size=3, preflight=None))  # parsed without the flags
    assert capsys.readouterr().err == ""


def test_every_problem_is_named_at_once(capsys):
    with pytest.raises(SystemExit):
        early.check_at_parse(ns(tensor_model_parallel_size=3, pipeline_model_parallel_size=3, world_size=9))
    err = capsys.readouterr().err
    assert "not divisible by TP3" in err and "not divisible by PP3" in err


def test_a_size_that_is_no_size_is_answered_not_crashed_on(capsys):
    with pytest.raises(SystemExit) as exc:
        early.check_at_parse(ns(tensor_model_parallel_size=0, world_size=2))
    assert exc.value.code == 1 and "positive integer" in capsys.readouterr().err


def test_the_plan_command_printed_runs_as_printed(capsys):
    """The report names `megatron-preflight plan CKPT --world-size N` for the ranking by memory: it runs as printed."""
    import shlex

    from megatron_preflight.cli.main import main
    from tests.conftest import fixture_path

    with pytest.raises(SystemExit):
        early.check_at_parse(ns(tensor_model_parallel_size=3, world_size=3, load=fixture_path("tp2_torch")))
    err = capsys.readouterr().err
    command = err.split("(megatron-preflight plan ", 1)[1].split(" ranks every one", 1)[0]
    argv = shlex.split(command)
    assert main(["plan", *argv]) == 0
    assert "TP1 CP1 PP3" in capsys.readouterr().out
