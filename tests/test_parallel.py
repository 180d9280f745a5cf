"""The one parallel-layout type: built from Megatron args in one function, the split of layers over stages and
virtual stages, expert placement, ETP defaulting, vocab padding."""

import pytest

from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import LayoutError, ParallelLayout, derive_vpp, divisor_keeping, from_args, pad_vocab


def test_from_args_defaults_and_etp_follows_tp():
    lay = from_args({"tensor_model_parallel_size": 4, "num_layers": 8})
    assert (lay.tp, lay.pp, lay.ep, lay.etp, lay.etp_eff, lay.vpp, lay.cp) == (4, 1, 1, None, 4, None, 1)
    assert from_args({"tensor_model_parallel_size": 4, "expert_tensor_parallel_size": 1}).etp_eff == 1
    assert from_args({"use_tp_pp_dp_mapping": True}).order == "tp-cp-ep-pp-dp"


@pytest.mark.parametrize("args,vpp", [
    ({"num_layers": 8, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2}, 2),
    ({"num_layers": 8, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 4}, None),
    ({"num_layers": 8, "pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2}, 2),
    # Megatron counts the embedding / loss as layers when it derives the VPP: (5 + 1) / 2 / 1 = 3
    ({"num_layers": 5, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
      "account_for_embedding_in_pipeline_split": True}, 3),
    ({"num_layers": 6, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
      "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}, 4),
    ({"virtual_pipeline_model_parallel_size": 2}, 2),  # saved args carry the derived value
])
def test_vpp_derivation(args, vpp):
    assert derive_vpp(args) == vpp
    assert from_args(args).vpp == vpp


def test_impossible_vpp_is_a_layout_error():
    with pytest.raises(LayoutError, match="not divisible by --num-layers-per-virtual-pipeline-stage 4"):
        derive_vpp({"num_layers": 12, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 4})


@pytest.mark.parametrize("kw,counts", [
    ({"num_layers": 8, "pp": 2}, [[4, 4]]),
    ({"num_layers": 8, "pp": 2, "vpp": 2}, [[2, 2], [2, 2]]),
    ({"num_layers": 5, "pp": 2, "embedding_in_split": True}, [[2, 3]]),
    ({"num_layers": 4, "pp": 2, "embedding_in_split": True, "loss_in_split": True}, [[2, 2]]),
    ({"num_layers": 4, "pp": 2, "vpp": 3, "embedding_in_split": True, "loss_in_split": True},
     [[0, 1], [1, 1], [1, 0]]),
    ({"num_layers": 7, "pp": 3, "first_stage_layers": 1}, [[1, 3, 3]]),
    ({"num_layers": 7, "pp": 3, "first_stage_layers": 1, "last_stage_layers": 2}, [[1, 4, 2]]),
])
def test_chunk_layer_counts(kw, counts):
    assert ParallelLayout(**kw).chunk_layer_counts() == counts


@pytest.mark.parametrize("kw,msg", [
    ({"num_layers": 5, "pp": 2}, "not divisible by PP2"),
    ({"num_layers": 8, "pp": 2, "vpp": 3}, "not divisible into 3 virtual stages"),
    ({"num_layers": 7, "pp": 3, "first_stage_layers": 2}, "do not split 7 layers"),
    ({"num_layers": 5, "pp": 2, "vpp": 2, "embedding_in_split": True}, "do not split over PP2 x VPP2"),
])
def test_layouts_that_cannot_hold_the_model(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        ParallelLayout(**kw).chunk_layer_counts()


def test_layer_placement_is_chunk_major_and_invertible():
    lay = ParallelLayout(num_layers=8, pp=2, vpp=2)
    # chunk 0 of every stage first: layers 0,1 on stage 0 chunk 0; 2,3 on stage 1 chunk 0; 4,5 stage 0 chunk 1
    assert [lay.place_layer(g) for g in (0, 2, 4, 7)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 1)]
    assert all(lay.global_layer(*lay.place_layer(g)) == g for g in range(8))
    with pytest.raises(LayoutError):
        lay.global_layer(0, 0, 5)


def test_experts():
    lay = ParallelLayout(ep=4, num_experts=8)
    assert lay.place_expert(5) == (2, 1) and lay.global_expert(2, 1) == 5
    with pytest.raises(LayoutError, match="not divisible by EP3"):
        ParallelLayout(ep=3, num_experts=8).experts_per_rank()
    assert ParallelLayout(ep=1, tp=2, etp=1).experts_are_expert_parallel()
    assert not ParallelLayout(ep=1, tp=2).experts_are_expert_parallel()


@pytest.mark.parametrize("kw", [{"tp": 0}, {"pp": -1}, {"ep": 0}, {"etp": 0}, {"cp": 0}, {"vpp": 0}, {"tp": "2"}])
def test_sizes_must_be_positive_integers(kw):
    with pytest.raises(PreflightError, match="must be a positive integer"):
        ParallelLayout(**kw)


def test_non_integer_arg_is_a_usage_error():
    with pytest.raises(PreflightError, match="must be an integer"):
        from_args({"tensor_model_parallel_size": "two"})


def test_min_world_and_vocab_padding():
    assert ParallelLayout(tp=2, ep=4, etp=1, pp=2).min_world() == 8
    assert ParallelLayout(tp=4, ep=2, etp=1).min_world() == 4
    assert pad_vocab(100, 128, 1) == 128 and pad_vocab(129, 64, 2) == 256


@pytest.mark.parametrize("kw", [
    {"num_layers": 8, "pp": 2, "vpp": 2},
    {"num_layers": 5, "pp": 2, "vpp": 3, "embedding_in_split": True},
    {"num_layers": 7, "pp": 3, "vpp": 1, "first_stage_layers": 1},
])
def test_vpp_args_round_trip_through_the_builder(kw):
    lay = ParallelLayout(**kw)
    args = {"num_layers": lay.num_layers, "pipeline_model_parallel_size": lay.pp,
            "account_for_embedding_in_pipeline_split": lay.embedding_in_split,
            "decoder_first_pipeline_num_layers": lay.first_stage_layers, **lay.vpp_args()}
    assert from_args(args).vpp == lay.vpp


@pytest.mark.parametrize("vocab, padded, tp, want", [
    (4200, 4352, 1, 256),  # saved at TP2 with the default 128: keep it at TP1 with 256
    (4200, 4352, 4, 64),
    (100, 256, 1, 256),
    (4200, 4352, 3, None),  # 4352 rows cannot be split over 3 ranks
    (151655, 151936, 2, 1187),  # no power of two pads to it at TP2: the smallest number that does
])
def test_the_divisor_that_keeps_a_saved_padded_vocab(vocab, padded, tp, want):
    got = divisor_keeping(vocab, padded, tp)
    assert got == want
    if got is not None:
        assert pad_vocab(vocab, got, tp) == padded


def test_tokenizer_ids_count_null_tokenizers_end_of_document_where_the_release_adds_it():
    from megatron_preflight.parallel import tokenizer_ids

    assert tokenizer_ids(127, "NullTokenizer") == 128  # (release unknown: the row that may be a token counted)
    assert tokenizer_ids(127, "NullTokenizer", null_adds_eod=False) == 127
    assert tokenizer_ids(127, "HuggingFaceTokenizer") == 127
