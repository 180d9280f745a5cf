"""Real Megatron-LM fixtures resharded to smaller and larger layouts and back: bit-exact (hypothesis for random
layouts), and equal to Megatron's own torch_dist twin of the same weights."""

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_preflight.errors import PreflightError
from megatron_preflight.layout import naming
from megatron_preflight.layout.discover import discover
from megatron_preflight.reshard import write_resharded
from megatron_preflight.reshard.resharder import open_resharder
from megatron_preflight.reshard.target import TargetLayout
from megatron_preflight.torch_file import TensorRef, TorchFile
from megatron_preflight.tree import iter_leaves
from tests.conftest import fixture_path

VOCAB = 100  # the true vocab of the fixtures and of the test models (--vocab-size 100)


def model_tensors(root):
    """{(shard, chunk, key): tensor} of a legacy checkpoint, read with our lazy reader."""
    layout = discover(root)
    assert layout.ok, layout.problems
    out = {}
    for s in layout.shards:
        with TorchFile(os.path.join(s.path, "model_optim_rng.pt")) as f:
            for chunk, sd in s.meta.items():
                if chunk.startswith("model"):
                    for k, v in sd.items():
                        t = f.tensor(v).clone() if isinstance(v, TensorRef) else v
                        out[(s.name, chunk, k)] = (t, s.tp_rank)
    return out


def _assert_same(a, b, is_vocab):
    for k in a:
        (x, tp_rank), (y, _) = a[k], b[k]
        if not isinstance(x, torch.Tensor):
            assert x == y, k
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if is_vocab(k, x):
            # Vocab padding is re-made (zero) when an intermediate layout had fewer padded rows; real rows exact.
            real = max(0, min(x.shape[0], VOCAB - tp_rank * x.shape[0]))  # this shard's rows below the true vocab
            assert torch.equal(x[:real], y[:real]), k
            assert torch.equal(y[real:], x[real:]) or not bool(y[real:].any()), k
        else:
            assert torch.equal(x, y), k


def assert_same_weights(a, b):
    assert list(a) == list(b)  # same keys, in the same (Megatron module) order
    _assert_same(a, b, lambda k, x: "word_embeddings" in k[2] or k[2] == "output_layer.weight")


def optimizer_entries(root):
    """{(shard, path...): value} over the optimizer state of every shard (tensors read with our lazy reader)."""
    layout = discover(root)
    out = {}
    for s in layout.shards:
        with TorchFile(os.path.join(s.path, "model_optim_rng.pt")) as f:
            for path, v in iter_leaves(s.meta.get("optimizer")):
                out[(s.name, *path)] = (f.tensor(v).clone() if isinstance(v, TensorRef) else v, s.tp_rank)
    return out


def assert_same_optimizer(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b), key=str)[:5]
    # The word-embedding / head state is the only 2-D state with 128 (local padded vocab) rows in the fixtures.
    _assert_same(a, b, lambda k, x: x.dim() == 2 and x.shape[0] == 128)


def roundtrip(tmp, name, target, back):
    """A -> B -> A with the optimizer state: the weights and every Adam state tensor come back bit-exact."""
    mid, out = os.path.join(tmp, "mid"), os.path.join(tmp, "back")
    write_resharded(fixture_path(name), mid, target)
    mid_layout = discover(mid)
    assert mid_layout.ok, mid_layout.problems
    write_resharded(mid, out, back, verify=True)
    assert_same_weights(model_tensors(fixture_path(name)), model_tensors(out))
    assert_same_optimizer(optimizer_entries(fixture_path(name)), optimizer_entries(out))
    return mid_layout


# The way back to each source layout, stated in full: a target that keeps PP and names no stage split keeps the
# intermediate's split (uneven stages, accounting flags), so the even splits below say embedding_in_split=False.
SOURCES = {
    "tp2_torch": (TargetLayout(tp=2, pp=1), dict(num_experts=None)),
    "pp2_torch": (TargetLayout(tp=1, pp=2, embedding_in_split=False), dict(num_experts=None)),
    "moe_ep2_torch": (TargetLayout(tp=1, pp=1, ep=2, etp=1), dict(num_experts=4)),
    "tp1_torch": (TargetLayout(tp=1, pp=1), dict(num_experts=None)),
    "bf16_gqa_tp2_torch": (TargetLayout(tp=2, pp=1), dict(num_experts=None)),
    "fp16_qkln_tp2_torch": (TargetLayout(tp=2, pp=1), dict(num_experts=None)),
    "vpp_qkln_pp2_torch": (TargetLayout(tp=1, pp=2, vpp=2, embedding_in_split=False), dict(num_experts=None)),
    "moe_shared_tp2pp2ep2_torch": (TargetLayout(tp=2, pp=2, ep=2, etp=1, embedding_in_split=False),
                                   dict(num_experts=4)),
    # 5 layers over PP2 with the embedding counted as a layer: stage 0 holds 2 layers, stage 1 holds 3
    "acct_emb_pp2_torch": (TargetLayout(tp=1, pp=2, embedding_in_split=True), dict(num_experts=None)),
    # Megatron-LM core_r0.14: optimizer param groups ordered per rank (stage 1 starts with the no-decay group)
    "v14_tp2pp2_torch": (TargetLayout(tp=2, pp=2, embedding_in_split=False), dict(num_experts=None)),
    "declr_tp2_torch": (TargetLayout(tp=2, pp=1), dict(num_experts=None)),  # --decoupled-lr: a third group
    # multi-latent attention, TE spec (the CPU stand-in for TE, not TE): up projections split, down ones duplicated
    "mla_te_tp2_torch": (TargetLayout(tp=2, pp=1), dict(num_experts=None)),
    # multi-token prediction (TE spec via the stand-in): the MTP layer and its own word embedding on the last stage
    "mtp_te_tp2pp2_torch": (TargetLayout(tp=2, pp=2, embedding_in_split=False), dict(num_experts=None)),
    # an MoE MTP layer (TE-grouped experts, EP2: the MTP layer's experts split over EP as the decoder's)
    "mtp_moe_te_ep2_torch": (TargetLayout(tp=1, pp=1, ep=2, etp=1), dict(num_experts=4)),
    # VPP + MoE + the distributed optimizer at once (qkv bias, learned positions, untied head, aux loss)
    "vppmoe_distopt_tp2pp2ep2_torch": (TargetLayout(tp=2, pp=2, vpp=2, ep=2, etp=1, embedding_in_split=False),
                                       dict(num_experts=4)),
}


@pytest.mark.parametrize("name, target", [
    ("tp2_torch", TargetLayout(tp=1)), ("tp2_torch", TargetLayout(tp=4)), ("tp2_torch", TargetLayout(tp=1, pp=4)),
    ("pp2_torch", TargetLayout(pp=1)), ("pp2_torch", TargetLayout(pp=4)), ("pp2_torch", TargetLayout(tp=2, pp=1)),
    ("pp2_torch", TargetLayout(pp=2, vpp=2)), ("pp2_torch", TargetLayout(pp=2, first_stage_layers=1)),
    ("moe_ep2_torch", TargetLayout(ep=1)), ("moe_ep2_torch", TargetLayout(ep=4)),
    ("moe_ep2_torch", TargetLayout(tp=2, ep=2, etp=1)), ("moe_ep2_torch", TargetLayout(tp=2, ep=1, etp=2)),
    ("moe_ep2_torch", TargetLayout(pp=2, ep=4)), ("tp1_torch", TargetLayout(tp=4, pp=2)),
    ("bf16_gqa_tp2_torch", TargetLayout(tp=1)), ("bf16_gqa_tp2_torch", TargetLayout(tp=1, pp=2, vpp=2)),
    ("fp16_qkln_tp2_torch", TargetLayout(tp=4)), ("vpp_qkln_pp2_torch", TargetLayout(tp=2, pp=1)),
    ("vpp_qkln_pp2_torch", TargetLayout(pp=4)), ("moe_shared_tp2pp2ep2_torch", TargetLayout(tp=1, pp=1, ep=1)),
    ("moe_shared_tp2pp2ep2_torch", TargetLayout(tp=1, pp=4, ep=4, etp=1)),
    ("acct_emb_pp2_torch", TargetLayout(pp=1)), ("acct_emb_pp2_torch", TargetLayout(pp=5, tp=2)),
    ("acct_emb_pp2_torch", TargetLayout(pp=3, embedding_in_split=True)),
    ("acct_emb_pp2_torch", TargetLayout(pp=7, embedding_in_split=True, loss_in_split=True)),  # end stages: 0 layers
    ("v14_tp2pp2_torch", TargetLayout(tp=1, pp=1)), ("v14_tp2pp2_torch", TargetLayout(tp=4, pp=4)),
    ("declr_tp2_torch", TargetLayout(tp=1, pp=2)),
    ("mla_te_tp2_torch", TargetLayout(tp=1)), ("mla_te_tp2_torch", TargetLayout(tp=4, pp=2)),
    ("mtp_te_tp2pp2_torch", TargetLayout(tp=1, pp=1)), ("mtp_te_tp2pp2_torch", TargetLayout(tp=4, pp=4, vpp=None)),
    ("mtp_te_tp2pp2_torch", TargetLayout(tp=1, pp=2, vpp=2)),
    ("mtp_moe_te_ep2_torch", TargetLayout(ep=1)), ("mtp_moe_te_ep2_torch", TargetLayout(ep=4, pp=2)),
    ("vppmoe_distopt_tp2pp2ep2_torch", TargetLayout(tp=1, pp=1, ep=2, etp=1)),
    ("vppmoe_distopt_tp2pp2ep2_torch", TargetLayout(tp=1, pp=4, vpp=None, ep=1)),
    ("mtp_moe_te_ep2_torch", TargetLayout(tp=2, ep=1, etp=2)),
])
def test_fixture_roundtrip_bit_exact(tmp_path, name, target):
    back, _ = SOURCES[name]
    mid = roundtrip(str(tmp_path), name, target, back)
    assert (mid.tp, mid.pp) == (target.tp or mid.tp, target.pp or mid.pp)


layouts = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4]), "pp": st.sampled_from([1, 2, 4]), "ep": st.sampled_from([1, 2, 4]),
    "etp": st.sampled_from([None, 1]), "vpp": st.sampled_from([None, 2]),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lay=layouts, name=st.sampled_from(sorted(SOURCES)))
def test_random_layouts_roundtrip(tmp_path_factory, lay, name):
    back, info = SOURCES[name]
    if not info["num_experts"]:
        lay["ep"], lay["etp"] = 1, None
    if lay["vpp"] and 4 // lay["pp"] < 2:
        lay["vpp"] = None
    try:  # some drawn layouts cannot hold the model (5 layers over PP2, 2 query groups over TP4): not round trips
        open_resharder(fixture_path(name), TargetLayout(**lay)).tgt.chunk_layer_counts()
    except PreflightError as e:
        assume("does not fit the model" not in e.message and e.code != "layout")
        raise
    tmp = str(tmp_path_factory.mktemp("rt"))
    roundtrip(tmp, name, TargetLayout(**lay), back)


def dist_globals(name):
    """The global tensors of a torch_dist twin (weights and optimizer state), loaded with
    torch.distributed.checkpoint (no process group)."""
    import torch.distributed.checkpoint as dcp

    layout = discover(fixture_path(name))
    sd = {k: torch.empty(shape, dtype=getattr(torch, dt.split(".")[1])) for k, (shape, dt) in layout.dist_tensors.items()
          if "rng" not in k}
    dcp.load(sd, checkpoint_id=layout.iter_dir, no_dist=True)
    return sd


LOCAL_TO_DIST = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def twin_tensor(g, key, prefix=""):
    """The twin's global tensor that a TP1 legacy key corresponds to. torch_dist stacks per-layer tensors over layers
    (and experts) when every layer is alike, and keys them per layer (``decoder.layers.{i}.``) when not (MoE every
    other layer)."""
    grouped = re.match(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$", key)
    if grouped:  # TE's grouped experts: expert j of a stacked tensor, as the sequential experts below
        head, linear, param, j = grouped.groups()
        key = f"{head}.local_experts.{j}.{linear}.{param}"
    parts = key.split(".")
    if parts[:2] != ["decoder", "layers"]:  # an MTP layer's transformer layer: `transformer_layer` in torch_dist
        key = key.replace(".mtp_model_layer.", ".transformer_layer.")
        if ".local_experts." not in key:
            return g[prefix + key]
        head, tail = key.split(".local_experts.")
        j, tail = tail.split(".", 1)
        return g[f"{prefix}{head}.experts.{tail}"][int(j)]
    layer, rest = int(parts[2]), ".".join(parts[3:])
    if not {prefix + f"decoder.layers.{layer}." + rest, prefix + "decoder.layers." + rest} & g.keys():
        for a, b in LOCAL_TO_DIST.items():  # a local-spec norm the twin keeps under TE's fused name
            rest = rest.replace(a, b) if rest.startswith(a) else rest
    expert = None
    if ".local_experts." in rest:
        head, tail = rest.split(".local_experts.")
        expert, tail = tail.split(".", 1)
        expert, rest = int(expert), f"{head}.experts.{tail}"
    stacked, per_layer = prefix + "decoder.layers." + rest, prefix + f"decoder.layers.{layer}." + rest
    if per_layer in g:
        return g[per_layer] if expert is None else g[per_layer][expert]
    return g[stacked][layer] if expert is None else g[stacked][layer, expert]


@pytest.mark.parametrize("legacy, dist, target", [
    ("tp2_torch", "tp2_torch_dist", TargetLayout(tp=1)),
    ("moe_ep2_torch", "moe_ep2_torch_dist", TargetLayout(ep=1)),
    ("bf16_gqa_tp2_torch", "bf16_gqa_tp2_torch_dist", TargetLayout(tp=1)),
    ("fp16_qkln_tp2_torch", "fp16_qkln_tp2_torch_dist", TargetLayout(tp=1)),
    ("vpp_qkln_pp2_torch", "vpp_qkln_pp2_torch_dist", TargetLayout(pp=1)),
    ("moe_shared_tp2pp2ep2_torch", "moe_shared_tp2pp2ep2_torch_dist", TargetLayout(tp=1, pp=1, ep=1)),
    ("acct_emb_pp2_torch", "acct_emb_pp2_torch_dist", TargetLayout(pp=1)),
    ("v14_tp2_torch", "v14_tp2_torch_dist", TargetLayout(tp=1)),  # Megatron-LM core_r0.14
    ("declr_tp2_torch", "declr_tp2_torch_dist", TargetLayout(tp=1)),
    ("mla_te_tp2_torch", "mla_te_tp2_torch_dist", TargetLayout(tp=1)),  # MLA (TE spec through the stand-in)
    ("mtp_te_tp2pp2_torch", "mtp_te_tp2pp2_torch_dist", TargetLayout(tp=1, pp=1)),  # MTP (the same)
    ("mtp_moe_te_ep2_torch", "mtp_moe_te_ep2_torch_dist", TargetLayout(ep=1)),  # an MoE MTP layer
])
def test_tp1_reshard_equals_megatrons_torch_dist_twin(legacy, dist, target):
    """Megatron's own global view of the same weights and Adam state is the ground truth for a TP1·PP1·EP1
    reshard."""
    from megatron_preflight.reshard.optimizer.plain import is_param, iter_plans

    g = dist_globals(dist)
    r = open_resharder(fixture_path(legacy), target)
    plan = r.plan_for_rank(0)
    built = r.build(plan)
    compared = 0
    for key, value in built["model"].items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):  # TE's: a sharded object in the twin
            continue
        ref = twin_tensor(g, key)
        if "word_embeddings" in key or key == "output_layer.weight":
            assert torch.equal(value[:VOCAB], ref[:VOCAB]), key
        else:
            assert torch.equal(value, ref), key
        compared += 1
    assert compared == len([k for k in built["model"] if not k.endswith("_extra_state")]) >= 25
    opt = 0
    for path, tp in iter_plans(plan.optimizer):
        if not ("state" in path or "fp32_from_fp16_params" in path) or tp.key.endswith("#step"):
            continue
        value = built["optimizer"]
        for part in path:
            value = value[part]
        param, field = tp.key.split("#")
        field = {"@master": "fp32_param"}.get(field, field)  # a bf16 run's fp32 master copy
        ref = twin_tensor(g, param, f"optimizer.state.{field}.")
        rows = VOCAB if "word_embeddings" in param or "output_layer" in param else None
        assert torch.equal(value[:rows], ref[:rows]), tp.key
        opt += 1
    masters = 1 if "fp32_from_fp16_params" in built["optimizer"] else 0
    assert opt == (2 + masters) * len([k for k, v in built["model"].items() if is_param(k, v)])


def test_group_order_follows_the_saving_megatron():
    """Megatron-LM main sorts param groups the same on every rank; core_r0.14 orders them per rank by the first
    parameter met. The target follows what the source shows (a round trip above restores it bit-exact)."""
    r = open_resharder(fixture_path("v14_tp2pp2_torch"), TargetLayout(tp=2, pp=2))
    assert r.optimizer_index.per_rank_order
    last = r.plan_for_coords(naming.shard_writers(r.tgt)["mp_rank_00_001"], "mp_rank_00_001").optimizer
    assert [g["wd_mult"] for g in last["param_groups"]] == [0.0, 1.0]
    r = open_resharder(fixture_path("tp2_torch"), TargetLayout(tp=2, pp=2))
    assert not r.optimizer_index.per_rank_order
    last = r.plan_for_coords(naming.shard_writers(r.tgt)["mp_rank_00_001"], "mp_rank_00_001").optimizer
    assert [g["wd_mult"] for g in last["param_groups"]] == [1.0, 0.0]


def test_align_groups_to_the_running_optimizer():
    """The hook puts the groups in the live optimizer's order; parameters are renumbered with their state."""
    from megatron_preflight.reshard.optimizer.plain import GROUP_KEY, align_groups

    r = open_resharder(fixture_path("tp2_torch"), TargetLayout(tp=2, pp=2))
    opt = r.build(r.plan_for_coords(naming.shard_writers(r.tgt)["mp_rank_00_001"], "mp_rank_00_001"))["optimizer"]
    before = {i: s["exp_avg"].clone() for i, s in opt["state"].items()}
    groups = [g["params"] for g in opt["param_groups"]]
    live = [[(tuple(g.get(k) for k in GROUP_KEY), len(g["params"])) for g in reversed(opt["param_groups"])]]
    out = align_groups(opt, live)
    assert [len(g["params"]) for g in out["param_groups"]] == [len(groups[1]), len(groups[0])]
    moved = groups[1] + groups[0]  # old indices in the new order
    assert all(torch.equal(out["state"][new]["exp_avg"], before[old]) for new, old in enumerate(moved))
    with pytest.raises(PreflightError):
        align_groups(opt, [[((0.5, 1.0, False, False, None), 3)]])
