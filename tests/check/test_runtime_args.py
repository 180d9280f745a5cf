import dataclasses

import pytest

from megatron_preflight.check.runtime_args import RuntimeArgs, from_cli, pad_vocab


def test_megatron_defaults():
    rt = from_cli("--hidden-size 64 --num-attention-heads 8 --num-layers 2".split())
    assert rt.ffn_hidden_size == 256 and rt.kv_channels == 8 and rt.num_query_groups == 8
    assert rt.etp == 1 and rt.ckpt_format == "torch_dist" and rt.transformer_impl == "transformer_engine"


def test_swiglu_ffn_default():
    assert from_cli("--hidden-size 4096 --num-attention-heads 32 --swiglu".split()).ffn_hidden_size == 10880


def test_gqa_and_vpp_and_world():
    rt = from_cli("--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
                  "--group-query-attention --num-query-groups 2 --num-attention-heads 8 --hidden-size 64 "
                  "--nproc-per-node 8 --nnodes 2 --some-unknown-flag 3".split())
    assert rt.vpp == 2 and rt.num_query_groups == 2 and rt.world_size == 16 and rt.data_parallel_size == 8


def test_world_size_from_torchrun_env():
    assert from_cli([], env={"WORLD_SIZE": "4"}).world_size == 4


def test_padded_vocab():
    assert pad_vocab(50257, 128, 1) == 50304 and pad_vocab(50257, 128, 8) == 51200
    assert from_cli("--vocab-size 100 --tensor-model-parallel-size 2".split()).padded_vocab_size == 256


def test_etp_follows_tp_unless_given():
    assert from_cli("--tensor-model-parallel-size 4".split()).etp == 4
    assert from_cli("--tensor-model-parallel-size 4 --expert-tensor-parallel-size 1".split()).etp == 1


def test_the_written_init_is_the_dataclass_one_by_name():
    """RuntimeArgs' __init__ is written, not generated (compiling ~150 parameters cost ~3 ms at every start): every
    field its declared default, keywords by name, an unknown name refused, `given` never shared, replace() works."""
    fields = dataclasses.fields(RuntimeArgs)
    assert len(fields) > 100
    a, b = RuntimeArgs(), RuntimeArgs(num_layers=3)
    for f in fields:
        expected = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(a, f.name) == expected, f.name
    assert (b.num_layers, a == RuntimeArgs(), a == b) == (3, True, False)
    a.given.add("num_layers")
    assert b.given == set() and RuntimeArgs().given == set()
    assert dataclasses.replace(b, hidden_size=8) == RuntimeArgs(num_layers=3, hidden_size=8)
    with pytest.raises(TypeError, match="no field num_layer"):
        RuntimeArgs(num_layer=3)
