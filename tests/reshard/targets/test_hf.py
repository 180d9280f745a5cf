"""``reshard --ckpt-format hf``: a Megatron checkpoint written as a Hugging Face model. HF -> Megatron (any layout,
legacy or torch_dist) -> HF is tensor-identical, every family; a real Megatron-LM checkpoint's export loads in
``transformers`` as is and computes the logits a megatron-core model loaded from the checkpoint computes (fp32);
a model no HF architecture expresses is refused before a byte is written; the files are the hub's layout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron_preflight.cli.main import main  # noqa: E402
from tests.conftest import fixture_path  # noqa: E402
from tests.helpers import hf_models  # noqa: E402


def cli(*argv: str) -> subprocess.CompletedProcess:
    """The command, in this process (a fresh interpreter per call cost the suite ~2 s each: torch's import)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def tensors(path: str) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


ROUND_TRIPS = [("llama", ["--tensor-model-parallel-size", "2"], "torch"),
               ("qwen2", ["--pipeline-model-parallel-size", "2"], "torch_dist"),
               ("qwen3", ["--tensor-model-parallel-size", "2"], "torch_dist"),
               ("mixtral", ["--expert-model-parallel-size", "2"], "torch"),
               ("qwen3_moe", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
                "torch_dist"),
               ("deepseek_v3", ["--expert-model-parallel-size", "2", "--transformer-impl", "transformer_engine",
                                "--moe-grouped-gemm"], "torch"),
               ("qwen3_moe", [], "fsdp_dtensor"),
               ("glm4_moe", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2"], "torch_dist"),
               ("glm4_moe", ["--expert-model-parallel-size", "2"], "torch"),
               # under the TE spec: its fused norms and extra states, in the MTP layer's own layer too, both ways
               ("glm4_moe", ["--expert-model-parallel-size", "2", "--transformer-impl", "transformer_engine"],
                "torch"),
               ("nemotron_h", ["--tensor-model-parallel-size", "2"], "torch_dist"),
               ("nemotron_h", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|M-"], "torch"),
               # NemotronH's MoE layers: sigmoid router and its bias, squared-ReLU experts, shared experts; latent
               ("nemotron_h_moe", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                "torch_dist"),
               ("nemotron_h_latent", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|E",
                                      "--expert-model-parallel-size", "2"], "torch"),
               ("qwen3_next", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                "torch_dist"),
               ("qwen3_next", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "GEGE|GE*E"],
                "torch"),
               ("qwen3_5_moe", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                "torch_dist"),
               ("qwen3_5", ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "G-G-|G-*-"], "torch"),
               # GPT-OSS: stacked experts (transposed, gate / up rows interleaved) split per expert and joined back
               ("gpt_oss", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "1"], "torch_dist"),
               ("gpt_oss", ["--pipeline-model-parallel-size", "2", "--transformer-impl", "transformer_engine",
                            "--moe-grouped-gemm"], "torch")]


@pytest.mark.parametrize("name, layout, fmt", ROUND_TRIPS, ids=[f"{r[0]}-{r[2]}{'-te' if 'transformer_engine' in r[1] else ''}" for r in ROUND_TRIPS])
def test_hf_to_megatron_to_hf_is_tensor_identical(tmp_path, name, layout, fmt):
    src = hf_models.write(name, str(tmp_path / "hf"))
    if name in ("deepseek_v3", "glm4_moe"):
        hf_models.add_mtp(src)  # the MTP layer travels both ways
    mid, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    done = cli("reshard", src, mid, "--no-progress", "--ckpt-format", fmt, "--", *layout)
    assert done.returncode == 0, done.stderr
    done = cli("reshard", mid, back, "--no-progress", "--ckpt-format", "hf", "--verify")
    assert done.returncode == 0, done.stderr
    a, b = tensors(src), tensors(back)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    with open(os.path.join(src, "config.json")) as fh:
        before = json.load(fh)
    with open(os.path.join(back, "config.json")) as fh:
        after = json.load(fh)
    assert after["architectures"] == before["architectures"]
    assert cli("diff", src, back).returncode == 0
    # the hub's layout: the files at the root, the index naming every tensor (written last)
    with open(os.path.join(back, "model.safetensors.index.json")) as fh:
        assert set(json.load(fh)["weight_map"]) == set(b)


def test_a_real_megatron_checkpoint_computes_the_same_logits_in_transformers(mcore_pool, tmp_path):
    """bf16_gqa_tp2_torch (written by Megatron-LM's pretrain_gpt.py: GQA, SwiGLU, RoPE, RMSNorm, untied, bf16 at
    TP2, NullTokenizer's 100 ids + EOD): exported in fp32, its padding rows dropped (101 of 256 kept)."""
    src = fixture_path("bf16_gqa_tp2_torch")
    out = str(tmp_path / "hf")
    done = cli("reshard", src, out, "--no-progress", "--ckpt-format", "hf", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    assert "optimizer state was not written" in done.stdout
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    assert (config["architectures"], config["vocab_size"], config["num_key_value_heads"]) == \
        (["LlamaForCausalLM"], 101, 2)
    ref = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=src, tp=1)[0]
    ours = hf_models.hf_logits(out, hf_models.tokens(vocab=101))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_a_model_no_architecture_expresses_is_refused_before_writing(tmp_path):
    out = str(tmp_path / "hf")
    done = cli("reshard", fixture_path("moe_ep2_torch"), out, "--ckpt-format", "hf")  # GPT-2 style: learned, GELU
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "learned_absolute position embeddings" in done.stderr and not os.path.exists(out)
    done = cli("reshard", fixture_path("bf16_gqa_tp2_torch"), out, "--ckpt-format", "hf", "--hf-architecture",
               "Qwen3ForCausalLM")
    assert done.returncode == 1 and "Qwen3ForCausalLM does not express" in done.stderr
    done = cli("reshard", fixture_path("bf16_gqa_tp2_torch"), out, "--ckpt-format", "hf", "--hf-architecture",
               "MistralForCausalLM", "--no-progress")
    assert done.returncode == 0, done.stderr
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["model_type"] == "mistral"


def test_the_tokenizer_travels_with_the_model(tmp_path):
    """An HF dir's tokenizer files go into the imported checkpoint's iteration dir (where Megatron-LM main keeps its
    tokenizer assets, --save-tokenizer-assets), and from there beside the exported model."""
    src = hf_models.write("llama", str(tmp_path / "hf"))
    files = {"tokenizer.json": '{"model": {"vocab": {}}}', "tokenizer_config.json": '{"model_max_length": 64}'}
    for name, text in files.items():
        with open(os.path.join(src, name), "w") as fh:
            fh.write(text)
    mid, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    assert cli("reshard", src, mid, "--no-progress", "--tp", "2").returncode == 0
    done = cli("reshard", mid, back, "--no-progress", "--ckpt-format", "hf")
    assert done.returncode == 0, done.stderr
    saved = os.path.join(mid, "release", "tokenizer")  # where Megatron-LM main saves its tokenizer's files
    assert sorted(os.listdir(saved)) == sorted(files)
    assert f"copied from {saved}" in done.stdout
    for name, text in files.items():
        with open(os.path.join(back, name)) as fh:
            assert fh.read() == text
    with open(os.path.join(saved, "tokenizer.json"), "w") as fh:
        fh.write('{"saved": true}')
    again = str(tmp_path / "again")
    done = cli("reshard", mid, again, "--no-progress", "--ckpt-format", "hf")
    assert done.returncode == 0 and f"copied from {saved}" in done.stdout
    with open(os.path.join(again, "tokenizer.json")) as fh:
        assert fh.read() == '{"saved": true}'


def test_an_export_is_never_another_resharders_whose_id_was_reused():
    """An export is planned once per resharder, keyed by its id; once that resharder is collected its id can be
    reused by another checkpoint's resharder, which must get its own export (CI saw a GPT-2 style model exported with
    an earlier test's Llama plan). The stale entry is planted under the new resharder's id."""
    import weakref

    from megatron_preflight.reshard.resharder import open_resharder
    from megatron_preflight.reshard.target import TargetLayout
    from megatron_preflight.reshard.targets import hf as hf_target

    llama = open_resharder(fixture_path("bf16_gqa_tp2_torch"), TargetLayout())
    export = hf_target.export_of(llama)
    assert hf_target.export_of(llama) is export
    gpt2 = open_resharder(fixture_path("moe_ep2_torch"), TargetLayout())

    class Gone:
        pass

    gone = Gone()
    hf_target._EXPORTS[id(gpt2)] = (weakref.ref(gone), export)
    del gone
    with pytest.raises(Exception, match="learned_absolute position embeddings"):
        hf_target.export_of(gpt2)
