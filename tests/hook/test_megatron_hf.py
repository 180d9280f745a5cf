"""Starting real Megatron-LM from a Hugging Face model (skipped unless MEGATRON_LM_ROOT is set; see
test_megatron_lm.py): ``pretrain_gpt.py --load HF_DIR --preflight auto`` with the model flags ``megatron-preflight
flags`` prints, used as printed, trains its first iteration with ``transformers``' own loss on the same tokens
(fp32), at TP, PP, EP and TP with sequence parallelism; the offline conversion loads in plain Megatron-LM alike;
``--preflight check`` stops the job that Megatron alone would start from random weights.

The MoE runs at TP2 need --sequence-parallel (a Megatron rule), which the CPU runner's norms accept."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.hook.test_megatron_lm import MAMBA_CPU, ROOT, TE_CPU, megatron_env, run

pytestmark = pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set: no real Megatron-LM checkout here")
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, VOCAB = 16, 128
BASE = (f"--seq-length {SEQ} --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-4 "
        "--lr-decay-style constant --hidden-dropout 0 --attention-dropout 0 --split 100,0,0 "
        f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} --log-interval 1 --eval-iters 0 "
        "--eval-interval 1000 --seed 1234").split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("data") / "tokens")
    python, env = megatron_env(ROOT)
    env["PYTHONPATH"] = PROJECT + os.pathsep + env["PYTHONPATH"]
    done = subprocess.run([python, "-m", "tests.helpers.hf_data", prefix, str(SEQ), str(VOCAB)], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return prefix


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.helpers import hf_data, hf_models

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in hf_models.configs():
        path = hf_models.write(name, str(root / name))
        out[name] = (path, hf_data.hf_loss(path, SEQ, VOCAB))
    return out


def printed_flags(path: str) -> list[str]:
    """The model flags ``megatron-preflight flags`` prints, as a launch script would hold them."""
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "flags", path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line.rstrip(" \\") for line in done.stdout.splitlines() if not line.startswith("#")]
    return [word for line in lines for word in shlex.split(line)]  # (as a shell reads the launch script)


def run_flags(path: str, layout: list[str]) -> list[str]:
    """The printed flags a run of ``layout`` starts with: a hybrid layer pattern in ``layout`` (the printed one with
    its pipeline cut) replaces the printed one."""
    flags = printed_flags(path)
    if "--hybrid-layer-pattern" in layout:
        i = flags.index("--hybrid-layer-pattern")
        flags = flags[:i] + flags[i + 2:]
    return flags


def first_loss(log: str) -> float:
    m = re.search(r"iteration +1/ +1 .*?lm loss: ([0-9.E+-]+)", log)
    assert m, log[-4000:]
    return float(m.group(1))


CASES = [("llama", 2, ["--tensor-model-parallel-size", "2"]), ("llama", 2, ["--pipeline-model-parallel-size", "2"]),
         ("mistral", 1, []), ("qwen2", 2, ["--tensor-model-parallel-size", "2"]),
         ("qwen3", 2, ["--pipeline-model-parallel-size", "2"]),
         ("mixtral", 2, ["--expert-model-parallel-size", "2"]),
         ("qwen3_moe", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
         ("qwen3_moe", 2, ["--expert-model-parallel-size", "2"]),
         # GLM-4.5 (local spec): QKV bias, QK norm, RoPE on half of each head, a dense first layer, grouped sigmoid
         # routing with the expert bias and a scaling factor, a shared expert
         ("glm4_moe", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
         ("glm4_moe", 2, ["--pipeline-model-parallel-size", "2"]),
         ("glm4_moe", 2, ["--expert-model-parallel-size", "2"]),
         # GPT-OSS: biases on every linear; Megatron's local MoE path runs them only with EP > 1 and ETP 1 (at EP 1
         # it raises on an in-place bias add; the TE spec runs EP 1: TE_CASES)
         ("gpt_oss", 2, ["--expert-model-parallel-size", "2"]),
         ("gpt_oss", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                         "2", "--expert-tensor-parallel-size", "1"]),
         ("gpt_oss", 4, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"])]


@pytest.mark.parametrize("name, nproc, layout", CASES, ids=[f"{c[0]}-{'-'.join(c[2]) or 'tp1'}" for c in CASES])
def test_an_hf_model_trains_with_transformers_loss(tmp_path, data, models, name, nproc, layout):
    path, oracle = models[name]
    rc, log = run(tmp_path, path, nproc, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                  base=BASE, port=29740, verify=False)
    assert rc == 0, log[-4000:]
    assert "loaded through the in-memory resharder (iteration 0" in log
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)


def test_biased_experts_at_ep1_on_the_local_spec_are_refused_before_megatron_fails(tmp_path, data, models):
    """GPT-OSS at EP 1 on the local spec: without the plugin Megatron-LM main fails its first step inside the
    experts ('... is a view and is being modified inplace'); with it every rank exits 1 first, saying why and what
    runs instead (the TE spec with grouped experts: TE_CASES trains it)."""
    path = models["gpt_oss"][0]
    rc, log = run(tmp_path, path, 1, *printed_flags(path), "--data-path", data, "--preflight", "auto", base=BASE,
                  port=29790, verify=False)
    assert rc != 0 and "MoE biases with the local spec's experts at EP 1" in log, log[-4000:]
    assert "is being modified inplace" not in log.split("MoE biases with the local spec")[1].split("\n", 1)[1]
    rc, log = run(tmp_path, path, 1, *printed_flags(path), "--data-path", data, "--preflight", "off", base=BASE,
                  port=29791, verify=False)
    assert rc != 0 and "is being modified inplace" in log, log[-4000:]  # (what it saves the user from)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_offline_conversion_loads_in_plain_megatron(tmp_path, data, models, fmt):
    path, oracle = models["qwen3_moe"]
    out = str(tmp_path / "converted")
    layout = ["--expert-model-parallel-size", "2"]
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", path, out, "--no-progress",
                           "--ckpt-format", fmt, "--", *layout], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rc, log = run(tmp_path, out, 2, *printed_flags(path), "--data-path", data, *layout, "--ckpt-format", fmt,
                  plugin=False, base=BASE, port=29741, verify=False)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)


def test_check_stops_the_job_megatron_would_start_from_random_weights(tmp_path, data, models):
    path, oracle = models["llama"]
    rc, log = run(tmp_path, path, 1, *printed_flags(path), "--data-path", data, "--preflight", "check", base=BASE,
                  port=29742, verify=False)
    assert rc == 1 and "--preflight auto" in log and "lm loss" not in log
    rc, log = run(tmp_path, path, 1, *printed_flags(path), "--data-path", data, plugin=False, base=BASE, port=29743,
                  verify=False)
    assert rc == 0 and "could not find the metadata file" in log  # Megatron alone: random weights, another loss
    assert abs(first_loss(log) - oracle) > 1e-3


TE_CASES = [("llama", ["--tensor-model-parallel-size", "2"]), ("llama", ["--context-parallel-size", "2"]),
            ("qwen3_moe", ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]),
            # DeepSeek-V3: MLA (built with the TE spec only), a dense first layer, grouped sigmoid routing with the
            # expert bias, a shared expert
            ("deepseek_v3", []), ("deepseek_v3", ["--expert-model-parallel-size", "2"]),
            ("deepseek_v3", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-grouped-gemm"]),
            # GPT-OSS at EP 1 (grouped experts with biases), and at TP 2 (MoE biases take ETP 1: a Megatron rule the
            # plugin states first)
            ("gpt_oss", ["--moe-grouped-gemm"]),
            ("gpt_oss", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
                         "1", "--moe-grouped-gemm"])]


@pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
@pytest.mark.parametrize("name, layout", TE_CASES, ids=[f"{c[0]}-{'-'.join(c[1]) or 'tp1'}" for c in TE_CASES])
def test_the_transformer_engine_spec_loads_it_alike(tmp_path, data, models, name, layout):
    """Under the Transformer Engine spec (through te_cpu, a CPU stand-in for TE 2.17.1, not TE), grouped experts
    included: the fused norms' names and the modules' extra state are the resharder's bridge."""
    path, oracle = models[name]
    rc, log = run(tmp_path, path, 2, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                  base=BASE, port=29744, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)


@pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
def test_deepseek_rotating_halves_and_its_mtp_layer(tmp_path, data):
    """A DeepSeek-V3 whose rotary rows rotate in halves (rope_interleave: false; Megatron's MLA rotates interleaved
    pairs: the rows are interleaved on the way), one whose files carry the multi-token prediction layer the hub's
    do (--mtp-num-layers 1, printed; transformers ignores it, so the lm loss is still its own)."""
    from tests.helpers import hf_data, hf_models

    halves = hf_models.write("deepseek_v3", str(tmp_path / "halves"), rope_interleave=False)
    mtp = hf_models.add_mtp(hf_models.write("deepseek_v3", str(tmp_path / "mtp")))
    assert "--mtp-num-layers" in printed_flags(mtp)
    for path, layout in ((halves, ["--expert-model-parallel-size", "2"]),
                         (mtp, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        rc, log = run(tmp_path, path, 2, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                      base=BASE, port=29745, verify=False, te=True)
        assert rc == 0, log[-4000:]
        assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)
        assert ("mtp_1 loss" in log) == (path == mtp)


@pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
def test_glm_with_its_mtp_layer(tmp_path, data):
    """A GLM-4.5 whose files carry the multi-token prediction layer the hub's do (--mtp-num-layers 1, printed);
    transformers ignores the layer, so the lm loss is still its own, and Megatron computes an MTP loss from the loaded
    layer. Under the Transformer Engine spec (through te_cpu, a CPU stand-in, not TE): Megatron-LM main builds an MTP
    layer only with Transformer Engine installed (its inference-linear check names TE's classes)."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.add_mtp(hf_models.write("glm4_moe", str(tmp_path / "mtp")))
    assert "--mtp-num-layers" in printed_flags(path)
    rc, log = run(tmp_path, path, 2, *printed_flags(path), "--data-path", data, "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--preflight", "auto", base=BASE, port=29748, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)
    assert "mtp_1 loss" in log


NEMOTRON_H = [(1, []), (2, ["--tensor-model-parallel-size", "2"]),
              (2, ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "M*|M-"])]


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine and mamba_ssm)")
@pytest.mark.parametrize("nproc, layout", NEMOTRON_H, ids=["tp1", "tp2", "pp2"])
def test_nemotron_h_trains_with_transformers_loss(tmp_path, data, nproc, layout):
    """NemotronH (Mamba-2, attention without RoPE, squared-ReLU MLPs) started by pretrain_hybrid.py with the printed
    flags (the hybrid stack spec: its Mamba mixers through mamba_cpu and its layers through te_cpu, CPU stand-ins for
    mamba_ssm and Transformer Engine, not those packages): transformers' own loss on the same tokens."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write("nemotron_h", str(tmp_path / "nemotron_h"))
    flags = run_flags(path, layout)
    rc, log = run(tmp_path, path, nproc, *flags, "--data-path", data, *layout, "--preflight", "auto",
                  script="pretrain_hybrid.py", base=BASE, port=29749, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


# NemotronH's MoE layers (Nemotron 3): at each layout, and with its experts in a latent width (Nemotron 3 Super)
NEMOTRON_H_MOE = [("nemotron_h_moe", 1, []),
                  ("nemotron_h_moe", 2, ["--expert-model-parallel-size", "2"]),
                  ("nemotron_h_moe", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                  ("nemotron_h_moe", 2, ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "ME|*E"]),
                  ("nemotron_h_latent", 2, ["--expert-model-parallel-size", "2"]),
                  ("nemotron_h_latent", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])]


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine and mamba_ssm)")
@pytest.mark.parametrize("name, nproc, layout", NEMOTRON_H_MOE,
                         ids=[f"{c[0]}-{'-'.join(c[2][:2]) or 'tp1'}" for c in NEMOTRON_H_MOE])
def test_nemotron_h_moe_trains_with_transformers_loss(tmp_path, data, name, nproc, layout):
    """NemotronH with MoE layers (a sigmoid router with its expert bias, groups and scaling, squared-ReLU experts,
    shared experts; latent projections) started by pretrain_hybrid.py with the printed flags (te_cpu and mamba_cpu,
    CPU stand-ins, not TE or mamba_ssm): transformers' own loss on the same tokens."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write(name, str(tmp_path / name))
    flags = run_flags(path, layout)
    rc, log = run(tmp_path, path, nproc, *flags, "--data-path", data, *layout, "--preflight", "auto",
                  script="pretrain_hybrid.py", base=BASE, port=29754, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


HYBRID_OFFLINE = [("nemotron_h_moe", "torch_dist", ["--expert-model-parallel-size", "2"]),
                  ("nemotron_h_latent", "torch", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                  ("qwen3_5_moe-hub", "torch_dist", ["--expert-model-parallel-size", "2"])]


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine, mamba_ssm and fla)")
@pytest.mark.parametrize("name, fmt, layout", HYBRID_OFFLINE, ids=[f"{c[0]}-{c[1]}" for c in HYBRID_OFFLINE])
def test_the_offline_conversion_of_a_hybrid_loads_in_plain_megatron(tmp_path, data, name, fmt, layout):
    """NemotronH's MoE layers (latent too) and Qwen3.5 as the hub publishes it, converted offline (`reshard`) and
    loaded by plain pretrain_hybrid.py (no plugin; te_cpu and mamba_cpu, CPU stand-ins): transformers' loss, as the
    in-memory load gives it."""
    from tests.helpers import hf_data, hf_models

    path = (hf_models.write_vlm("qwen3_5_moe", str(tmp_path / "hub")) if name.endswith("-hub")
            else hf_models.write(name, str(tmp_path / name)))
    out = str(tmp_path / "converted")
    # (after --: the run's flags, as printed — its vocab padding among them — with its layout)
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", path, out, "--no-progress",
                           "--ckpt-format", fmt, "--", *printed_flags(path), *layout], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rc, log = run(tmp_path, out, 2, *printed_flags(path), "--data-path", data, *layout, "--ckpt-format", fmt,
                  plugin=False, script="pretrain_hybrid.py", base=BASE, port=29755, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


QWEN3_NEXT = [(1, []), (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
              (2, ["--expert-model-parallel-size", "2"])]


QWEN_HYBRIDS = [(name, *case) for name in ("qwen3_next", "qwen3_5_moe") for case in QWEN3_NEXT] + [
    ("qwen3_5", *case) for case in QWEN3_NEXT[:2]] + [
    ("qwen3_5", 2, ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "G-G-|G-*-"])]


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine, mamba_ssm and fla)")
@pytest.mark.parametrize("name, nproc, layout", QWEN_HYBRIDS,
                         ids=[f"{c[0]}-{'-'.join(c[2][:2]) or 'tp1'}" for c in QWEN_HYBRIDS])
def test_qwen3_next_trains_with_transformers_loss(tmp_path, data, nproc, layout, name):
    """Qwen3-Next (gated delta nets, gated attention, zero-centred norms, MoE with a gated shared expert) started by
    pretrain_hybrid.py with the printed flags, two Megatron layers per HF layer (its gated delta nets through
    mamba_cpu's fla stand-in and its layers through te_cpu, CPU stand-ins, not those packages): transformers' loss."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write(name, str(tmp_path / name))
    rc, log = run(tmp_path, path, nproc, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                  script="pretrain_hybrid.py", base=BASE, port=29752, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


HUB_QWEN3_5 = [("qwen3_5_moe", 2, ["--expert-model-parallel-size", "2"]),
               ("qwen3_5_moe", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
               ("qwen3_5", 2, ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "G-G-|G-*-"])]


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine, mamba_ssm and fla)")
@pytest.mark.parametrize("name, nproc, layout", HUB_QWEN3_5,
                         ids=[f"{c[0]}-{'-'.join(c[2][:2])}" for c in HUB_QWEN3_5])
def test_qwen3_5_as_the_hub_publishes_it_trains_with_its_language_models_loss(tmp_path, data, nproc, layout, name):
    """Qwen3.5 as the hub publishes it (the vision-language model: text_config, the language model under
    model.language_model., a vision encoder) started by pretrain_hybrid.py with the printed flags (te_cpu and
    mamba_cpu, CPU stand-ins): the loss of the language model transformers reads from the same dir
    (AutoModelForCausalLM, as users load it)."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write_vlm(name, str(tmp_path / name))
    flags = run_flags(path, layout)
    rc, log = run(tmp_path, path, nproc, *flags, "--data-path", data, *layout, "--preflight", "auto",
                  script="pretrain_hybrid.py", base=BASE, port=29753, verify=False, te=True)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


HYBRID_EXPORTS = [("nemotron_h", ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]),
                  ("nemotron_h_moe", ["--expert-model-parallel-size", "2", "--ckpt-format", "torch_dist"]),
                  ("nemotron_h_latent", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt-format",
                                         "torch"]),
                  ("qwen3_next", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt-format",
                                  "torch_dist"]),
                  # (Megatron's save does not say which of Qwen3-Next and Qwen3.5 it came from: named on export)
                  ("qwen3_5_moe", ["--expert-model-parallel-size", "2", "--ckpt-format", "torch_dist"]),
                  ("qwen3_5", ["--pipeline-model-parallel-size", "2", "--ckpt-format", "torch"])]
EXPORT_AS = {"qwen3_5_moe": ["--hf-architecture", "Qwen3_5MoeForCausalLM"]}


@pytest.mark.skipif(not (TE_CPU and MAMBA_CPU), reason="needs MEGATRON_LM_TE_CPU and MEGATRON_LM_MAMBA_CPU (the CPU "
                                                       "stand-ins for Transformer Engine, mamba_ssm and fla)")
@pytest.mark.parametrize("name, layout", HYBRID_EXPORTS, ids=[e[0] for e in HYBRID_EXPORTS])
def test_a_trained_hybrid_model_handed_back_as_hf_computes_megatrons_loss(tmp_path, data, name, layout):
    """NemotronH and Qwen3-Next trained two steps by pretrain_hybrid.py from their HF start at TP2, saved torch_dist,
    exported (--ckpt-format hf; Qwen3-Next's gated delta net norms back from Megatron's zero-centred form):
    transformers' loss on the tokens equals the loss Megatron computes on reloading the save."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write(name, str(tmp_path / name))
    save = str(tmp_path / "saved")
    common = dict(script="pretrain_hybrid.py", base=BASE, verify=False, te=True)
    rc, log = run(tmp_path, path, 2, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                  "--save", save, "--save-interval", "2", "--train-iters", "2", port=29750, **common)
    assert rc == 0 and os.path.isdir(save), log[-4000:]
    out = str(tmp_path / "exported")
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", save, out, "--no-progress",
                           "--ckpt-format", "hf", "--dtype", "fp32", "--verify", *EXPORT_AS.get(name, [])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["architectures"] == [type(hf_models.configs()[name]).__name__.replace(
            "TextConfig", "Config").replace("Config", "ForCausalLM")]
    rc, log = run(tmp_path, save, 2, *printed_flags(path), "--data-path", data, *layout, "--finetune",
                  "--no-load-rng", plugin=False, port=29751, **common)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(out, SEQ, VOCAB), abs=1e-5)


# A model trained by real Megatron-LM from an HF start and saved in each form, then exported back (--ckpt-format
# hf): transformers' loss on the tokens equals the loss Megatron computes when the saved model is loaded again (its
# first iteration after a --finetune load: the saved weights, before any update).
EXPORTS = [
    ("llama", 2, ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch"], False),
    ("qwen2", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tL",
                  "--ckpt-format", "torch"], False),
    ("qwen3_moe", 2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--ckpt-format",
                      "torch_dist"], False),
    ("qwen3_moe", 2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--ckpt-format", "torch_dist"],
     True),
    ("deepseek_v3", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt-format", "torch"], True),
    ("glm4_moe", 2, ["--expert-model-parallel-size", "2", "--ckpt-format", "torch_dist"], True),
    ("gpt_oss", 2, ["--expert-model-parallel-size", "2", "--ckpt-format", "torch_dist"], False),
    ("gpt_oss", 2, ["--moe-grouped-gemm", "--ckpt-format", "torch"], True),
]


@pytest.mark.parametrize("name, nproc, layout, te", EXPORTS,
                         ids=[f"{e[0]}-{'-'.join(e[2][:2])}-{e[2][-1]}{'-te' if e[3] else ''}" for e in EXPORTS])
def test_a_trained_model_handed_back_as_hf_computes_megatrons_loss(tmp_path, data, models, name, nproc, layout, te):
    if te and not TE_CPU:
        pytest.skip("MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
    from tests.helpers import hf_data, hf_models

    path = models[name][0]
    if name in ("deepseek_v3", "glm4_moe"):  # (the MTP layer trained and handed back too)
        path = hf_models.add_mtp(hf_models.write(name, str(tmp_path / f"{name}_mtp")))
    save = str(tmp_path / "saved")
    rc, log = run(tmp_path, path, nproc, *printed_flags(path), "--data-path", data, *layout, "--preflight", "auto",
                  "--save", save, "--save-interval", "2", "--train-iters", "2", base=BASE, port=29746, verify=False,
                  te=te)
    assert rc == 0 and os.path.isdir(save), log[-4000:]
    out = str(tmp_path / "exported")
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", save, out, "--no-progress",
                           "--ckpt-format", "hf", "--dtype", "fp32", "--verify"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rc, log = run(tmp_path, save, nproc, *printed_flags(path), "--data-path", data, *layout, "--finetune",
                  "--no-load-rng", plugin=False, base=BASE, port=29747, verify=False, te=te)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(out, SEQ, VOCAB), abs=1e-5)


def test_llama3_rope_scaling(tmp_path, data):
    """Llama 3.1's RoPE scaling (factor, low / high frequency factors 1 and 4, an original context of 8,192: what
    Megatron's --use-rope-scaling applies, only the factor a flag): the printed flags train with transformers' own
    loss. The control: the same weights without the scaling give another loss (the scaling is seen at this length)."""
    from tests.helpers import hf_data, hf_models

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
    path = hf_models.write("llama", str(tmp_path / "llama3"), rope_parameters=llama3)
    plain = hf_models.write("llama", str(tmp_path / "plain"), rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0})
    oracle = hf_data.hf_loss(path, SEQ, VOCAB)
    assert abs(oracle - hf_data.hf_loss(plain, SEQ, VOCAB)) > 1e-4
    flags = printed_flags(path)
    assert flags[flags.index("--rope-scaling-factor") + 1] == "8.0" and "--use-rope-scaling" in flags
    rc, log = run(tmp_path, path, 1, *flags, "--data-path", data, "--preflight", "auto", base=BASE, port=29749,
                  verify=False)
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)


@pytest.mark.skipif(not TE_CPU, reason="MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
def test_deepseek_yarn(tmp_path, data):
    """DeepSeek-V3's own RoPE, YaRN with both attention scales (--rope-type yarn --rotary-scaling-factor --mscale
    --mscale-all-dim, printed). Megatron's YarnRotaryEmbedding needs an accelerator: on the CPU runner it cannot be
    built ('Cannot access accelerator device'), so there this test says so and skips; on a GPU runner it compares."""
    from tests.helpers import hf_data, hf_models

    path = hf_models.write("deepseek_v3", str(tmp_path / "yarn"), rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})
    flags = printed_flags(path)
    assert flags[flags.index("--rope-type") + 1] == "yarn" and "--rotary-scaling-factor" in flags
    rc, log = run(tmp_path, path, 1, *flags, "--data-path", data, "--preflight", "auto", base=BASE, port=29748,
                  verify=False, te=True)
    if rc != 0 and "Cannot access accelerator device" in log:
        pytest.skip("Megatron's YarnRotaryEmbedding cannot be built without an accelerator (CPU runner)")
    assert rc == 0, log[-4000:]
    assert first_loss(log) == pytest.approx(hf_data.hf_loss(path, SEQ, VOCAB), abs=1e-5)


# (a model, its published quantized form, the layout): FP8 with block scales (float8_e4m3fn weights, a float32 scale
# per 24x20 block), GPT-OSS's MXFP4 experts (e2m1 blocks, e8m0 scales), llm-compressor's FP8 (compressed-tensors
# float-quantized: a scale per channel; per 24x20 block), ModelOpt's FP8 (a scale per tensor, static input scales),
# llm-compressor's INT4 (pack-quantized, a scale per 16 columns: Kimi K2 Thinking's experts' form), Kimi K2.5's
# (its language model under language_model., INT4 per 8 columns)
QUANTIZED = [("llama", "fp8", ["--tensor-model-parallel-size", "2"]),
             ("qwen3_moe", "fp8", ["--expert-model-parallel-size", "2"]),
             ("gpt_oss", "mxfp4", ["--expert-model-parallel-size", "2"]),
             ("llama", "compressed-channel", ["--tensor-model-parallel-size", "2"]),
             ("qwen3_moe", "compressed-block", ["--expert-model-parallel-size", "2"]),
             ("llama", "modelopt", ["--pipeline-model-parallel-size", "2"]),
             ("qwen3_moe", "compressed-int4", ["--expert-model-parallel-size", "2"]),
             ("deepseek_v3", "kimi-k25-int4", ["--expert-model-parallel-size", "2"])]


def _quantized(name: str, scheme: str, src: str, where: str) -> tuple[str, str]:
    """(the model at ``src`` in the published form ``scheme``, its dequantized twin: the oracle's model)."""
    from tests.helpers import hf_models

    if scheme == "fp8":
        return hf_models.write_fp8(src, where, (24, 20))
    if scheme == "mxfp4":
        return hf_models.write_mxfp4(src, where)
    if scheme == "compressed-channel":
        return hf_models.write_compressed_fp8(src, where, "channel")
    if scheme == "compressed-block":
        return hf_models.write_compressed_fp8(src, where, "block", [24, 20])
    if scheme == "compressed-int4":
        return hf_models.write_compressed_int(src, where, 4, 16)
    if scheme == "kimi-k25-int4":  # (Kimi K2.5 as Moonshot publishes it, test-built: write_kimi_k25)
        int4, deq = hf_models.write_compressed_int(src, where + "_text", 4, 8)
        return hf_models.write_kimi_k25(int4, where), deq
    return hf_models.write_modelopt_fp8(src, where)


@pytest.mark.parametrize("name, scheme, layout", QUANTIZED, ids=[f"{c[0]}-{c[1]}" for c in QUANTIZED])
def test_a_quantized_model_as_published_trains_with_transformers_loss_of_it_dequantized(tmp_path, data, models, name,
                                                                                        scheme, layout):
    """The model quantized as the hub publishes it (tests/helpers/hf_models.write_fp8 / write_mxfp4 /
    write_compressed_fp8 / write_modelopt_fp8 / write_compressed_int), loaded at job
    start with the printed flags: iteration 1's loss is transformers' own on the same model dequantized (by the test
    for FP8, by transformers' convert_moe_packed_tensors for MXFP4); its offline conversion, loaded by plain Megatron,
    the same. DeepSeek-V3's MLA is built under the Transformer Engine spec only: through te_cpu (a CPU stand-in)."""
    from tests.helpers import hf_data

    te = name == "deepseek_v3"
    if te and not TE_CPU:
        pytest.skip("MEGATRON_LM_TE_CPU is not set (the CPU stand-in for Transformer Engine)")
    where = str(tmp_path / f"{name}_{scheme}")
    quantized, deq = _quantized(name, scheme, models[name][0], where)
    oracle = hf_data.hf_loss(deq, SEQ, VOCAB)
    flags = printed_flags(quantized)
    rc, log = run(tmp_path, quantized, 2, *flags, "--data-path", data, *layout, "--preflight", "auto", base=BASE,
                  port=29786, verify=False, te=te)
    assert rc == 0, log[-4000:]
    assert "loaded through the in-memory resharder (iteration 0" in log
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)
    out = str(tmp_path / "converted")
    done = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", quantized, out, "--no-progress",
                           "--", *flags, *layout], capture_output=True, text=True, timeout=300)  # (the run's flags)
    assert done.returncode == 0, done.stderr
    rc, log2 = run(tmp_path, out, 2, *flags, "--data-path", data, *layout, "--ckpt-format", "torch", plugin=False,
                   base=BASE, port=29787, verify=False, te=te)
    assert rc == 0, log2[-4000:]
    assert first_loss(log2) == first_loss(log)


def test_an_hf_model_on_object_storage_trains_with_transformers_loss(tmp_path, data, models):
    """The Qwen3-MoE model dir on a real S3-compatible server (SeaweedFS, tests/helpers/s3_server.py), a TP2 job with
    ``--load msc://... --enable-msc --preflight auto``: each rank fetches its own rows into its node's staged mirror,
    and the first loss is transformers' own on the same tokens (as from the local dir)."""
    python, env = megatron_env(ROOT)
    if subprocess.run([python, "-c", "import multistorageclient, boto3"], env=env).returncode != 0:
        pytest.skip("multi-storage-client[boto3] is not installed in MEGATRON_LM_PYTHON")
    from tests.helpers import s3_server

    path, oracle = models["qwen3_moe"]
    store = s3_server.server()
    store.upload_dir(path, "hf/qwen3_moe")
    rc, log = run(tmp_path, path, 2, *printed_flags(path), "--data-path", data, "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--preflight", "auto", "--load", "msc://store/hf/qwen3_moe", "--enable-msc",
                  base=BASE, port=29748, verify=False, env_extra={"MSC_CONFIG": store.config("hf.yaml")})
    assert rc == 0, log[-4000:]
    assert "loaded through the in-memory resharder (iteration 0" in log and "msc://store/hf/qwen3_moe" in log
    assert first_loss(log) == pytest.approx(oracle, abs=1e-5)
