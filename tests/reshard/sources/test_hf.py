"""A Hugging Face model resharded from its safetensors: real megatron-core GPT models (local spec, gloo, 4 ranks)
built from the Megatron args megatron-preflight derives and loaded strictly from the reshard compute the logits of
``transformers``' own model on the same tokens (fp32), in memory at TP1, TP2, EP2 and through Megatron checkpoints
written offline (legacy PP2, torch_dist TP2 EP2) read back."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
from tests.helpers import hf_models  # noqa: E402

DENSE = ["llama", "mistral", "qwen2", "qwen3"]
MOE = ["mixtral", "qwen3_moe", "glm4_moe", "gpt_oss"]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: (p := hf_models.write(name, str(root / name)), hf_models.hf_logits(p)) for name in DENSE + MOE}


def _layouts(name: str) -> list[dict]:
    # MoE with TP > 1 needs sequence parallelism, which megatron-core's local-spec torch norms refuse: MoE runs at
    # TP2 in the real Megatron-LM tests (the CPU runner's norms accept it)
    return [dict(tp=1), dict(ep=2)] if name in MOE else [dict(tp=1), dict(tp=2)]


@pytest.mark.parametrize("name", DENSE + MOE)
def test_in_memory_logits_equal_transformers(mcore_pool, models, name):
    path, ref = models[name]
    for lay in _layouts(name):
        out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=path, **lay)
        torch.testing.assert_close(out[0], ref, **TOL, msg=lambda m, lay=lay: f"{name} at {lay}: {m}")


def _reshard(src: str, dst: str, *flags: str) -> None:
    """The command as a user runs it (in this process: a fresh interpreter per call costs torch's import)."""
    from megatron_preflight.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["reshard", src, dst, "--no-progress", *flags])
    assert rc == 0, err.getvalue()


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe", "glm4_moe"])
def test_offline_megatron_checkpoints_hold_the_same_model(mcore_pool, models, name, tmp_path):
    """HF -> legacy PP2 (and torch_dist TP2 or EP2) on disk -> each read back at TP1 in memory: transformers' logits."""
    path, ref = models[name]
    pp2, dist = str(tmp_path / "pp2"), str(tmp_path / "dist")
    _reshard(path, pp2, "--pp", "2")
    _reshard(path, dist, "--ckpt-format", "torch_dist", *(["--ep", "2"] if name in MOE else ["--tp", "2"]))
    assert os.path.exists(os.path.join(pp2, "release", "mp_rank_00_001", "model_optim_rng.pt"))
    with open(os.path.join(pp2, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read().strip() == "release"  # Megatron loads it at iteration 0, without optimizer or RNG state
    for root in (pp2, dist):
        out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=path, root=root)
        torch.testing.assert_close(out[0], ref, **TOL, msg=lambda m, root=root: f"{name} via {root}: {m}")


def test_a_virtual_pipeline_layout_holds_the_same_model(mcore_pool, tmp_path):
    """HF -> PP2 with two virtual stages per rank (4 layers: one per model chunk) on disk -> read back at TP1:
    transformers' logits."""
    path = hf_models.write("llama", str(tmp_path / "hf"), num_hidden_layers=4)
    ref = hf_models.hf_logits(path)
    vpp = str(tmp_path / "vpp")
    _reshard(path, vpp, "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1")
    import torch as _torch

    from megatron_preflight.torch_file import read_torch_file

    meta = read_torch_file(os.path.join(vpp, "release", "mp_rank_00_001", "model_optim_rng.pt"))
    assert {"model0", "model1"} <= set(meta)  # the rank's two model chunks
    out = mcore_pool.run("tests.helpers.hf_models:load_and_forward", hf_dir=path, root=vpp)
    _torch.testing.assert_close(out[0], ref, **TOL)
