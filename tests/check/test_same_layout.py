"""The same run flags mean the same layout to the check, the offline resharder (flags after `--` or its own flags)
and the hook: all of them build it with parallel.from_args. Drawn over many layouts, incl. the embedding / loss
counted in the pipeline split with virtual stages (where check and resharder once disagreed: VPP 2 vs 3)."""

import argparse

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_preflight.check.runtime_args import from_cli
from megatron_preflight.cli.main import build_parser
from megatron_preflight.cli.reshard_cmd import target_from
from megatron_preflight.errors import PreflightError
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from tests.conftest import fixture_path

# fixture -> its layer count (tests/fixtures/megatron-lm/LOCAL_FIXTURES.md)
SOURCES = {"acct_emb_pp2_torch": 5, "tp2_torch": 4}
RESHARDERS = {}


def source(name):
    if name not in RESHARDERS:
        RESHARDERS[name] = open_resharder(fixture_path(name), TargetLayout())
    return RESHARDERS[name]


def answer(fn):
    """(vpp, [chunk][stage] layer counts), or the layout error's message: what a layout means."""
    try:
        lay = fn()
        return lay.vpp, lay.chunk_layer_counts()
    except PreflightError as e:
        return "error", e.code


flags = st.fixed_dictionaries({
    "pp": st.sampled_from([1, 2, 3, 4]),
    "per_chunk": st.sampled_from([None, 1, 2]),
    "first": st.sampled_from([None, 1, 2]),
    "emb": st.booleans(),
    "loss": st.booleans(),
})


@settings(max_examples=120, deadline=None)
@given(f=flags, name=st.sampled_from(sorted(SOURCES)))
def test_check_resharder_and_hook_agree(f, name):
    argv = ["--num-layers", str(SOURCES[name]), "--pipeline-model-parallel-size", str(f["pp"])]
    if f["per_chunk"]:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(f["per_chunk"])]
    if f["first"]:
        argv += ["--decoder-first-pipeline-num-layers", str(f["first"])]
    if f["emb"]:
        argv += ["--account-for-embedding-in-pipeline-split"]
    if f["loss"]:
        argv += ["--account-for-loss-in-pipeline-split"]
    r = source(name)
    check = answer(lambda: from_cli(argv).layout())
    after_dashes = answer(lambda: TargetLayout.resolve(target_from(argparse.Namespace(megatron_args=argv)), r.src))
    hook = answer(lambda: TargetLayout.from_args(from_cli(argv)).resolve(r.src))
    assert check == after_dashes == hook, (argv, check, after_dashes, hook)
    if not (f["emb"] or f["loss"]) and not r.src.embedding_in_split:
        # the reshard command's own flags (no accounting flags there; sizes not given keep the source's, and a kept
        # PP keeps the source's stage split: see test_kept_pp_keeps_the_source_split)
        own = ["reshard", "s", "d", "--pp", str(f["pp"])]
        if f["per_chunk"]:
            own += ["--num-layers-per-virtual-pipeline-stage", str(f["per_chunk"])]
        if f["first"]:
            own += ["--decoder-first-pipeline-num-layers", str(f["first"])]
        ns = build_parser().parse_args(own)
        ns.megatron_args = []
        assert answer(lambda: target_from(ns).resolve(r.src)) == check, own


def test_the_case_that_once_disagreed():
    argv = ["--num-layers", "5", "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage", "1"]
    assert from_cli(argv).vpp == 3
    assert from_cli(argv).layout().chunk_layer_counts() == [[0, 1], [1, 1], [1, 1]]
    r = source("acct_emb_pp2_torch")
    assert target_from(argparse.Namespace(megatron_args=argv)).resolve(r.src).vpp == 3


def test_kept_pp_keeps_the_source_split():
    r = source("acct_emb_pp2_torch")  # 5 layers at PP2 with the embedding counted: stages [2, 3]
    assert TargetLayout(tp=1).resolve(r.src).chunk_layer_counts() == [[2, 3]]
    assert TargetLayout(pp=1).resolve(r.src).chunk_layer_counts() == [[5]]
