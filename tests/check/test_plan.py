"""The pre-flight plan on real Megatron-LM checkpoints: verdict, loader, every finding with its fix."""

import argparse
import dataclasses
import functools
import os

import pytest
import torch

from megatron_preflight.check.findings import Severity
from megatron_preflight.check.plan import Loader, Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli, from_namespace, from_yaml
from megatron_preflight.layout import naming
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS

TINY = FLAGS
MOE = "--num-experts 4 --moe-router-topk 2".split()


def plan(name, *flags):
    return make_plan(name if os.path.isabs(name) else fixture_path(name), from_cli(TINY + list(flags)))


def fields(p, severity=None):
    return [f.field for f in p.findings if severity is None or f.severity.value == severity]


@pytest.mark.parametrize("name, flags, loader", [
    ("tp1_torch", ["--world-size", "1"], Loader.NON_EP),
    ("tp2_torch", ["--tensor-model-parallel-size", "2", "--world-size", "2"], Loader.NON_EP),
    ("pp2_torch", ["--pipeline-model-parallel-size", "2", "--world-size", "2"], Loader.NON_EP),
    ("moe_ep2_torch", MOE + ["--expert-model-parallel-size", "2", "--world-size", "2"], Loader.EP_3D),
    ("tp2_distopt_torch", ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], Loader.NON_EP),
    ("tp2_torch_dist", ["--tensor-model-parallel-size", "2"], Loader.DIST),
    ("moe_ep2_torch_dist", MOE + ["--expert-model-parallel-size", "2"], Loader.DIST),
])
def test_matching_args_load(name, flags, loader):
    p = plan(name, *flags)
    assert p.verdict == Verdict.LOAD, [f.to_json() for f in p.fatal]
    assert p.loader == loader
    assert fields(p, "fatal") == [] and fields(p, "reshard") == []


@pytest.mark.parametrize("name, flags, changed", [
    ("tp2_torch", ["--tensor-model-parallel-size", "1"], "tensor_model_parallel_size"),
    ("tp1_torch", ["--tensor-model-parallel-size", "2"], "tensor_model_parallel_size"),
    ("pp2_torch", [], "pipeline_model_parallel_size"),
    ("tp1_torch", ["--pipeline-model-parallel-size", "2"], "pipeline_model_parallel_size"),
    ("moe_ep2_torch", MOE, "expert_model_parallel_size"),
    ("moe_ep2_torch", MOE + ["--expert-model-parallel-size", "4"], "expert_model_parallel_size"),
])
def test_legacy_layout_change_reshards(name, flags, changed):
    p = plan(name, *flags, "--no-load-optim")
    assert p.verdict == Verdict.RESHARD and p.loader == Loader.RESHARD, [f.to_json() for f in p.fatal]
    assert changed in fields(p, "reshard")
    assert not p.load_rng and "rng_state" in fields(p, "info")


def test_legacy_layout_change_reshards_plain_optimizer():
    p = plan("tp2_torch", "--tensor-model-parallel-size", "1")
    assert p.verdict == Verdict.RESHARD and p.load_optimizer
    opt = [f for f in p.findings if f.field == "optimizer"]
    assert opt and opt[0].runtime == "resharded"


def _regroup_optimizer(root):
    """Rewrite every shard so one bias sits in the weight-decay group: param groups Megatron's default rules do not
    make (as custom per-parameter settings would)."""
    from megatron_preflight import pickling
    from megatron_preflight.reshard.resharder import open_resharder
    from megatron_preflight.reshard.target import TargetLayout

    r = open_resharder(root, TargetLayout())
    for name, coords in naming.shard_writers(r.tgt).items():
        sd = r.build(r.plan_for_coords(coords, name))
        groups = sd["optimizer"]["param_groups"]
        groups[0]["params"].append(groups[1]["params"].pop(0))
        torch.save(sd, os.path.join(root, "iter_0000002", name, "model_optim_rng.pt"), pickle_module=pickling)


def test_legacy_layout_change_never_drops_optimizer_silently(real_fixture):
    root = real_fixture("tp2_torch")
    _regroup_optimizer(root)
    p = plan(root, "--tensor-model-parallel-size", "1")
    assert p.verdict == Verdict.FAIL
    opt = [f for f in p.fatal if f.field == "optimizer"]
    assert opt and "--no-load-optim" in opt[0].fix and "param group" in opt[0].message
    assert plan(root, "--tensor-model-parallel-size", "1", "--finetune").verdict == Verdict.RESHARD
    assert plan(root, "--tensor-model-parallel-size", "2").verdict == Verdict.LOAD  # its own layout: loads as is


def test_legacy_distopt_layout_change_reshards_the_distributed_optimizer_state():
    p = plan("distopt_tp2dp2_torch", "--use-distributed-optimizer")
    assert p.verdict == Verdict.RESHARD and p.load_optimizer, [f.to_json() for f in p.fatal]
    f = next(f for f in p.findings if f.field == "optimizer")
    assert f.checkpoint == "distributed" and "distrib_optim.pt" in f.message
    # a run without the distributed optimizer gets the state converted (even at the checkpoint's own layout)
    p = plan("distopt_tp2dp2_torch", "--tensor-model-parallel-size", "2")
    assert p.verdict == Verdict.RESHARD and p.loader == Loader.RESHARD and p.load_optimizer
    assert "use_distributed_optimizer" in fields(p, "reshard")
    p = plan("tp2_torch", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer")
    assert p.verdict == Verdict.RESHARD and "use_distributed_optimizer" in fields(p, "reshard")
    assert plan("tp2_distopt_torch", "--use-distributed-optimizer", "--no-load-optim").verdict == Verdict.RESHARD


def test_dist_layout_change_loads_via_dist():
    p = plan("tp2_torch_dist")  # TP2 -> TP1
    assert p.verdict == Verdict.LOAD and p.loader == Loader.DIST
    assert "tensor_model_parallel_size" in fields(p, "reshard")


def test_dist_ep_change_with_optimizer_names_megatrons_failure_and_reshards():
    """Megatron's dist loader fails on this EP change with the optimizer state; the resharder reads the state, so the
    check picks the in-memory resharder (and says why). Without the optimizer, Megatron's own loader does it."""
    p = plan("moe_ep2_torch_dist", *MOE)
    assert p.verdict == Verdict.RESHARD and p.loader == Loader.RESHARD
    found = [f for f in p.findings if f.field == "optimizer"]
    assert "Could not find parameter group" in found[0].message and "--preflight auto" in found[0].fix
    assert plan("moe_ep2_torch_dist", *MOE, "--no-load-optim").verdict == Verdict.LOAD


@pytest.mark.parametrize("name,flags,verdict", [
    ("distopt_dpr_tp2dp2_torch_dist", ["--tensor-model-parallel-size", "1"], Verdict.RESHARD),
    ("distopt_dpr_tp2dp2_torch_dist", ["--tensor-model-parallel-size", "2"], Verdict.LOAD),
    ("distopt_tp2dp2_torch_dist", ["--tensor-model-parallel-size", "1"], Verdict.LOAD),
])
def test_dp_reshardable_tp_change_is_megatrons_refusal_and_a_reshard(name, flags, verdict):
    """dp_reshardable (Megatron's default) at another TP: Megatron raises '(TP, PP) mismatch'; the check says so and
    picks the in-memory resharder. At the same TP, or for the fully_reshardable form, Megatron's loader stays."""
    p = plan(name, "--use-distributed-optimizer", "--ckpt-format", "torch_dist", *flags)
    assert p.verdict == verdict, p.findings
    if verdict == Verdict.RESHARD:
        assert p.loader == Loader.RESHARD
        assert any("(TP, PP) mismatch" in f.message for f in p.findings if f.field == "optimizer")
    else:
        assert p.loader == Loader.DIST


def test_dist_ckpt_with_runtime_torch_format():
    p = plan("tp2_torch_dist", "--tensor-model-parallel-size", "2", "--ckpt-format", "torch")
    assert p.verdict == Verdict.FAIL and "ckpt_format" in fields(p, "fatal")
    assert plan("tp2_torch_dist", "--tensor-model-parallel-size", "2", "--ckpt-format", "torch",
                "--auto-detect-ckpt-format").verdict == Verdict.LOAD


ARCH_CHANGES = [
    ("num_layers", ["--num-layers", "6"]),
    ("hidden_size", ["--hidden-size", "64"]),
    ("ffn_hidden_size", ["--ffn-hidden-size", "128"]),
    ("num_attention_heads", ["--num-attention-heads", "2"]),
    ("num_query_groups", ["--group-query-attention", "--num-query-groups", "2"]),
    ("kv_channels", ["--kv-channels", "16"]),
    ("num_experts", MOE),
    ("position_embedding_type", ["--position-embedding-type", "rope"]),
    ("max_position_embeddings", ["--max-position-embeddings", "64"]),
    ("normalization", ["--normalization", "RMSNorm"]),
    ("swiglu", ["--swiglu"]),
    ("add_bias_linear", ["--disable-bias-linear"]),
    ("qk_layernorm", ["--qk-layernorm"]),
    ("untie_embeddings_and_output_weights", ["--untie-embeddings-and-output-weights"]),
    ("vocab_size", ["--vocab-size", "200"]),
]


@pytest.mark.parametrize("field, flags", ARCH_CHANGES, ids=[c[0] for c in ARCH_CHANGES])
def test_each_architecture_field_is_fatal(field, flags):
    p = plan("tp1_torch", *flags)
    assert p.verdict == Verdict.FAIL
    f = [f for f in p.fatal if f.field == field]
    assert len(f) == 1, [x.to_json() for x in p.findings]
    assert f[0].fix and f[0].message


# the real MLA fixture's model (TE spec through the CPU stand-in for TE, not TE): LOCAL_FIXTURES.md
MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
       "--v-head-dim 6 --qk-layernorm --position-embedding-type rope --sequence-parallel").split()
MLA_CHANGES = [("q_lora_rank", "--q-lora-rank", "8"), ("kv_lora_rank", "--kv-lora-rank", "16"),
               ("qk_head_dim", "--qk-head-dim", "16"), ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", "8"),
               ("v_head_dim", "--v-head-dim", "8")]


@pytest.mark.parametrize("field, flag, value", MLA_CHANGES, ids=[c[0] for c in MLA_CHANGES])
def test_each_mla_size_is_fatal_and_the_same_model_reshards(field, flag, value):
    assert plan("mla_te_tp2_torch", *MLA, "--transformer-impl", "transformer_engine",
                "--no-load-rng").verdict == Verdict.RESHARD
    changed = [*MLA, flag, value]  # the later flag wins, as in Megatron's argparse
    p = plan("mla_te_tp2_torch", *changed, "--transformer-impl", "transformer_engine", "--no-load-rng")
    assert p.verdict == Verdict.FAIL and [f.field for f in p.fatal] == [field], [x.to_json() for x in p.findings]
    assert p.fatal[0].fix == f"set {flag} {getattr(from_cli(TINY + MLA), field)}"


MTP = "--mtp-num-layers 1 --position-embedding-type rope --untie-embeddings-and-output-weights".split()


def test_mtp_layers_are_compared_and_an_mtp_checkpoint_reshards():
    te = ["--transformer-impl", "transformer_engine", "--no-load-rng"]
    assert plan("mtp_te_tp2pp2_torch", *MTP, *te).verdict == Verdict.RESHARD  # TP2·PP2 -> TP1·PP1
    dropped = plan("mtp_te_tp2pp2_torch", *MTP[2:], *te)
    assert [(f.field, f.fix) for f in dropped.fatal] == [("mtp_num_layers", "add --mtp-num-layers 1")]
    added = plan("te_tp2_torch", "--tensor-model-parallel-size", "2", "--mtp-num-layers", "2", *te)
    assert [(f.field, f.fix) for f in added.fatal] == [("mtp_num_layers", "remove --mtp-num-layers")]


def test_an_mtp_layer_named_otherwise_than_the_running_megatron_names_it_is_a_reshard():
    """The legacy fixture names its MTP layers' transformer layer `mtp_model_layer`; a Megatron-LM before late 2025
    (the hook asks megatron.core) names it `transformer_layer` and would miss every key: resharded in memory, at the
    saved layout too. Unknown (offline) or the same name: nothing to say."""
    flags = [*MTP, "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2"]
    for name, verdict in ((None, Verdict.LOAD), ("mtp_model_layer", Verdict.LOAD), ("transformer_layer",
                                                                                   Verdict.RESHARD)):
        rt = from_cli(TINY + flags)
        rt.mtp_layer_name = name
        p = make_plan(fixture_path("mtp_te_tp2pp2_torch"), rt)
        found = [(f.field, f.checkpoint, f.runtime) for f in p.findings if f.field == "mtp_layer_name"]
        assert p.verdict == verdict and found == ([] if verdict == Verdict.LOAD else
                                                  [("mtp_layer_name", "mtp_model_layer", "transformer_layer")])
        assert p.loader == (Loader.RESHARD if verdict == Verdict.RESHARD else Loader.NON_EP)


def test_a_tensor_no_rule_covers_blocks_only_a_reshard(monkeypatch):
    """A key the split-rule table does not know (here: MLA's down projections with their rows taken out of the
    table, as a newer Megatron's module would be): the job loads at the saved layout (Megatron reads it as saved),
    and a layout change that needs our reshard fails at start, naming the key."""
    from megatron_preflight.reshard.plan import rules

    monkeypatch.setattr(rules, "_COMPILED", [(p, r) for p, r in rules._COMPILED if "down_proj" not in p.pattern])
    monkeypatch.setattr(rules, "_rule_of_suffix", functools.lru_cache(maxsize=None)(rules._rule_of_suffix.__wrapped__))
    te = [*MLA, "--transformer-impl", "transformer_engine"]
    same = plan("mla_te_tp2_torch", *te, "--tensor-model-parallel-size", "2")
    assert same.verdict == Verdict.LOAD and [f.severity for f in same.findings if f.field == "unknown_key"] == [Severity.INFO]
    other = plan("mla_te_tp2_torch", *te, "--no-load-rng")
    assert other.verdict == Verdict.FAIL and [f.field for f in other.fatal] == ["unknown_key"]
    assert "linear_q_down_proj.weight" in other.fatal[0].message


def test_mla_dropped_from_the_run_is_one_fatal_finding():
    p = plan("mla_te_tp2_torch", "--qk-layernorm", "--position-embedding-type", "rope", "--transformer-impl",
             "transformer_engine", "--no-load-rng")
    assert [f.field for f in p.fatal] == ["multi_latent_attention"] and p.fatal[0].fix == "add --multi-latent-attention"


@pytest.mark.parametrize("name, flags", [
    ("tp1_torch", ["--transformer-impl", "transformer_engine"]),  # local -> TE: the same tensors, other names
    ("te_tp2_torch", ["--tensor-model-parallel-size", "2", "--transformer-impl", "local"]),  # TE -> local
])
def test_a_layer_spec_change_is_a_reshard(name, flags):
    p = plan(name, *flags)
    assert p.verdict == Verdict.RESHARD and p.loader == Loader.RESHARD, [f.to_json() for f in p.fatal]
    f, = [f for f in p.findings if f.field == "transformer_impl"]
    assert f.severity.value == "reshard" and "--preflight auto" in f.fix and "--transformer-impl" in f.fix


@pytest.mark.parametrize("name, flags, run, ckpt", [
    ("tp2_torch", ["--tensor-model-parallel-size", "2"], "fused", "torch"),
    ("te_tp2_torch", ["--tensor-model-parallel-size", "2", "--transformer-impl", "transformer_engine"], "torch",
     "fused"),
    ("te_tp2_torch_dist", ["--tensor-model-parallel-size", "2", "--transformer-impl", "transformer_engine"], "torch",
     "fused"),
])
def test_another_adam_is_converted_by_the_resharder(name, flags, run, ckpt):
    """The run builds another Adam (TE / apex installed on one side only): Megatron would fail at the first step
    (KeyError: 'bias_correction') or lose the step; the resharder's loader converts it, legacy and torch_dist."""
    rt = from_cli(TINY + flags + ["--optimizer-family", run])
    p = make_plan(fixture_path(name), rt)
    f, = [f for f in p.findings if f.field == "optimizer_family"]
    assert (f.checkpoint, f.runtime, f.severity.value) == (ckpt, run, "reshard")
    assert p.verdict == Verdict.RESHARD and p.loader == Loader.RESHARD
    assert "--optimizer-family" in f.fix
    same = make_plan(fixture_path(name), from_cli(TINY + flags + ["--optimizer-family", ckpt]))
    assert "optimizer_family" not in fields(same)
    dropped = make_plan(fixture_path(name), from_cli(TINY + flags + ["--optimizer-family", run, "--no-load-optim"]))
    assert "optimizer_family" not in fields(dropped)


def test_every_changed_field_reported_at_once():
    flags = ["--hidden-size", "64", "--num-attention-heads", "8", "--swiglu", "--disable-bias-linear",
             "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2"]
    p = plan("tp1_torch", *flags)
    fatal = fields(p, "fatal")
    for field in ("hidden_size", "num_attention_heads", "swiglu", "add_bias_linear", "normalization",
                  "untie_embeddings_and_output_weights"):
        assert fatal.count(field) == 1, (field, fatal)
    assert "tensor_model_parallel_size" in fields(p, "reshard")


@pytest.mark.parametrize("flags, field", [
    (["--tensor-model-parallel-size", "3"], "tensor_model_parallel_size"),
    (["--pipeline-model-parallel-size", "3"], "pipeline_model_parallel_size"),
    (MOE + ["--expert-model-parallel-size", "3"], "expert_model_parallel_size"),
    (["--tensor-model-parallel-size", "2", "--world-size", "3"], "world_size"),
    (MOE + ["--expert-model-parallel-size", "4", "--world-size", "2"], "world_size"),
    (MOE + ["--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "2"], "expert_tensor_parallel_size"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "virtual_pipeline_model_parallel_size"),
    (["--expert-model-parallel-size", "2"], "expert_model_parallel_size"),
])
def test_invalid_runtime_layouts(flags, field):
    p = plan("tp1_torch", *flags)
    assert p.verdict == Verdict.FAIL
    assert field in fields(p, "fatal"), [f.to_json() for f in p.findings]


def test_three_sources_give_the_same_plan(tmp_path):
    flags = TINY + MOE + ["--expert-model-parallel-size", "1", "--no-load-optim", "--world-size", "2"]
    from_flags = make_plan(fixture_path("moe_ep2_torch"), from_cli(flags))
    ns = argparse.Namespace(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=32,
                            max_position_embeddings=32, vocab_size=100, transformer_impl="local", num_experts=4,
                            moe_router_topk=2, expert_model_parallel_size=1, tensor_model_parallel_size=1,
                            pipeline_model_parallel_size=1, no_load_optim=True, world_size=2,
                            tokenizer_type="NullTokenizer", padded_vocab_size=None, unrelated_arg="x")
    from_ns = make_plan(fixture_path("moe_ep2_torch"), from_namespace(ns))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_layers: 4\nhidden_size: 32\nffn_hidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n"
                   "max_position_embeddings: 32\nvocab_size: 100\ntransformer_impl: local\nnum_experts: 4\n"
                   "moe_router_topk: 2\nno_load_optim: true\nworld_size: 2\n")
    from_cfg = make_plan(fixture_path("moe_ep2_torch"), from_yaml(str(cfg)))
    views = [(p.verdict, p.loader, [f.to_json() for f in p.findings]) for p in (from_flags, from_ns, from_cfg)]
    assert views[0] == views[1] == views[2]
    assert views[0][0] == Verdict.RESHARD


def test_damaged_checkpoint_is_fatal(real_fixture):
    import os
    import shutil

    root = real_fixture("tp2_torch")
    shutil.rmtree(os.path.join(root, "iter_0000002", "mp_rank_01"))
    p = make_plan(root, from_cli(TINY + ["--tensor-model-parallel-size", "2"]))
    assert p.verdict == Verdict.FAIL and "missing_shard" in fields(p, "fatal")
    f = next(f for f in p.fatal if f.field == "missing_shard")
    assert f.checkpoint is None and f.runtime is None  # no problem code or path in the value columns
    assert "mp_rank_01" in f.message and "Fix" not in f.message and f.fix  # the fix once, in its own place
    from megatron_preflight.check.report import render_plan

    text = render_plan(p)
    assert text.count(f.fix) == 1


def test_json_shape():
    j = plan("tp2_torch", "--no-load-optim").to_json()
    assert j["verdict"] == "reshard" and j["loader"] == "reshard"
    assert {"field", "checkpoint", "runtime", "severity", "message", "fix"} <= set(j["findings"][0])
    assert j["layout"]["tp"] == 2


def test_reshard_to_a_custom_pipeline_layout():
    """pp2_torch holds its 4 layers as the even split (2 and 2): a layout string that spells that split loads; one
    that moves a layer (Megatron's legacy loader fails after the build) is a reshard to that placement before it; one
    the resharder cannot write (the loss before the last stage; more segments than stages) is fatal, naming it."""
    p = plan("pp2_torch", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E(t)*2|ttL",
             "--world-size", "2")
    assert p.verdict == Verdict.LOAD and "pipeline_model_parallel_layout" not in fields(p, "fatal") + fields(
        p, "reshard")
    p = plan("pp2_torch", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttL",
             "--world-size", "2", "--no-load-optim")
    assert p.verdict == Verdict.RESHARD and "pipeline_model_parallel_layout" in fields(p, "reshard")
    for layout in ("EtttL|t", "Et|tt|tL"):
        p = plan("pp2_torch", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", layout,
                 "--world-size", "2")
        assert p.verdict == Verdict.FAIL and "pipeline_model_parallel_layout" in fields(p, "fatal"), layout
        assert layout in next(f.message for f in p.fatal if f.field == "pipeline_model_parallel_layout")


def test_embedding_counted_in_pipeline_split_is_a_layout():
    five = ["--num-layers", "5", "--world-size", "2"]
    root = "acct_emb_pp2_torch"  # 5 layers over PP2: [2, 3]
    assert plan(root, *five, "--pipeline-model-parallel-size", "2",
                "--account-for-embedding-in-pipeline-split").verdict == Verdict.LOAD
    p = plan(root, *five, "--pipeline-model-parallel-size", "1")
    assert p.verdict == Verdict.RESHARD and "account_for_embedding_in_pipeline_split" in fields(p, "reshard")
    p = plan(root, *five, "--pipeline-model-parallel-size", "2")  # 5 layers do not split evenly over PP2
    assert p.verdict == Verdict.FAIL and "pipeline_model_parallel_size" in fields(p, "fatal")


def test_a_torch_dist_the_resharder_cannot_read_stays_fatal(tmp_path):
    """The reshard loader is picked only when the resharder can index the checkpoint: an unknown parameter (another
    model type) keeps Megatron's refusal fatal, with the resharder's reason."""
    import shutil

    from megatron_preflight.reshard import open_index

    assert open_index(fixture_path("distopt_dpr_tp2dp2_torch_dist")).source_problem() is None
    assert open_index(fixture_path("moe_ep2_torch_dist")).source_problem() is None
    md_key = "decoder.layers.self_attention.linear_qkv.weight"
    from torch.distributed.checkpoint import FileSystemReader

    root = tmp_path / "c"
    shutil.copytree(fixture_path("distopt_dpr_tp2dp2_torch_dist"), root)
    import pickle

    it = root / "iter_0000002"
    md = FileSystemReader(str(it)).read_metadata()  # torch's classes (ours reads them as inert records)
    mystery = "decoder.layers.self_attention.linear_mystery.weight"
    md.state_dict_metadata[mystery] = md.state_dict_metadata[md_key]
    for index, info in list(md.storage_data.items()):
        if index.fqn == md_key:
            md.storage_data[dataclasses.replace(index, fqn=mystery)] = info
    (it / ".metadata").write_bytes(pickle.dumps(md))
    assert "no split rule" in open_index(str(root)).source_problem()
    p = plan(str(root), "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
             "--tensor-model-parallel-size", "1")
    assert p.verdict == Verdict.FAIL and any("cannot serve it either" in f.message for f in p.fatal), p.fatal


FSMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron-core-0.13",
                    "fsms_bf16_tp2dp2_torch_dist")
FSMS_FLAGS = ["--bf16", "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--disable-bias-linear",
              "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2",
              "--world-size", "4"]


@pytest.mark.parametrize("loads, verdict, severity", [(False, Verdict.RESHARD, "reshard"),
                                                      (None, Verdict.LOAD, "info"), (True, Verdict.LOAD, None)])
def test_a_fully_sharded_model_space_state_on_a_megatron_that_refuses_it_is_resharded(loads, verdict, severity):
    """megatron-core 0.13.1's default distributed-optimizer form (a real checkpoint it wrote): megatron-core >= 0.16
    raises 'ShardedTensor.flattened_range is not supported' inside load_checkpoint, even at the saved layout; the
    hook asks megatron.core (offline: unknown, said as info). Where it is refused, the in-memory resharder loads it
    (--preflight auto: a reshard verdict, Megatron's loader never meets it; `check` stops naming the fix); the fix
    also names the offline conversion."""
    rt = from_cli(FLAGS + FSMS_FLAGS)
    rt.loads_flattened_range = loads
    p = make_plan(FSMS, rt)
    found = [f for f in p.findings if f.checkpoint == "fully_sharded_model_space"]
    assert p.verdict == verdict, [f.to_json() for f in p.findings if f.severity.value != "info"]
    assert [f.severity.value for f in found] == ([severity] if severity else [])
    if found:
        assert "megatron-preflight reshard" in found[0].fix and "--ckpt-format torch_dist" in found[0].fix
    if loads is False:
        assert p.loader.value == "reshard" and "--preflight auto" in found[0].fix
    rt.no_load_optim = True
    assert not [f for f in make_plan(FSMS, rt).findings if f.checkpoint == "fully_sharded_model_space"]


def test_the_hook_asks_megatron_core_whether_it_loads_flattened_ranges():
    import megatron.core

    from megatron_preflight.hook.runtime import loads_flattened_range

    assert loads_flattened_range() is (megatron.core.__version__ < "0.16")  # 0.16.1 here: refused


def _flex_run(*more: str) -> list[str]:
    from tests.helpers.tiny import FLAGS

    return [*FLAGS, "--ckpt-format", "torch", "--pipeline-model-parallel-size", "2", *more]


def test_a_flexible_layout_moved_at_the_same_pp_size_is_seen_before_the_build():
    """flex_pp2_torch was saved with --pipeline-model-parallel-layout 'Et|tttL' (1 and 3 layers). A PP2 run that
    places them otherwise — another layout, or the even split — is a layout change (Megatron's legacy loader fails after
    the build: "Number of unpadded elements must be same"), not a LOAD: the even split and another flexible layout
    reshard; the same placement spelled otherwise loads."""
    root = fixture_path("flex_pp2_torch")
    even = make_plan(root, from_cli(_flex_run(), env={}))
    assert even.verdict == Verdict.RESHARD
    moved = next(f for f in even.findings if f.field == "pipeline_model_parallel_layout")
    assert moved.checkpoint == "Et|tttL" and "none (the even split)" in moved.message
    other = make_plan(root, from_cli(_flex_run("--pipeline-model-parallel-layout", "Ettt|tL"), env={}))
    assert other.verdict == Verdict.RESHARD
    same = make_plan(root, from_cli(_flex_run("--pipeline-model-parallel-layout", "E(t)*1|t*3L"), env={}))
    assert same.verdict == Verdict.LOAD, [(f.field, f.message) for f in same.findings if f.severity.value != "info"]


@pytest.mark.parametrize("name", ["flex_pp2_torch", "flex_distopt_pp2dp2_torch", "flex_distopt_dpr_pp2dp2_torch_dist"])
def test_a_flexible_layout_target_followed_as_printed_writes_what_the_run_loads(tmp_path, name):
    """From a flexible layout to another ('Et|tttL' -> 'Ettt|tL') or from an even split: the offline command check
    prints, run as printed, writes the placement the run asks for (check of it: LOAD), stage 0 holding layers 0-2."""
    from tests.helpers.advised import follow_advice
    from tests.helpers.ckpt_edit import load

    dist = name.endswith("_dist")
    extra = ["--use-distributed-optimizer", "--world-size", "4"] if "distopt" in name else []
    run = [*_flex_run("--pipeline-model-parallel-layout", "Ettt|tL", *extra)]
    if dist:
        run = [f if f != "torch" else "torch_dist" for f in run]
    new = str(tmp_path / "new")
    follow_advice(fixture_path(name), run, new)
    first = [d for d in os.listdir(os.path.join(new, "iter_0000002")) if d.endswith("_000")][0] if not dist else None
    if first is not None:
        model = load(os.path.join(new, "iter_0000002", first, "model_optim_rng.pt"))["model"]
        assert {k.split(".")[2] for k in model if k.startswith("decoder.layers.")} == {"0", "1", "2"}


def test_the_flexible_layouts_repeats_are_written_out():
    from megatron_preflight.parallel import expand_pipeline_layout as expand

    assert expand("E(t|)*2L") == "Et|t|L"
    assert expand(" E t*3 | (tt|)*2 m L") == "Ettt|tt|tt|mL"
    assert expand("(t|)*") == "(t|)*" and expand(None) is None  # malformed: compared as written
