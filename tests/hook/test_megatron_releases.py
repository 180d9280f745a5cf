"""Every Megatron-LM release users run, each in its own pretrain_gpt.py (skipped unless MEGATRON_LM_RELEASES is set).

MEGATRON_LM_RELEASES names work trees, one per release: ``0.13=/w/mlm-0.13,0.14=/w/mlm-0.14,...,main=/w/Megatron-LM``
(shared/tools/megatron-lm-cpu's README, "Other Megatron-LM releases": ``git --git-dir=<mirror> --work-tree=DIR checkout
core_r0.X.0 -- .``; releases up to 0.15 also import ``six`` and ``regex``, 0.16 ``pydantic`` for its megatron.rl).
MEGATRON_LM_PYTHON, MEGATRON_LM_PYTHONPATH (the CPU shim) and MEGATRON_LM_EXTRA_ARGS (the CPU flags) as for
test_megatron_lm.py.

For each release, with checkpoints that release writes here (a tiny GPT, 2 steps, TP2, legacy and its torch_dist twin):
the patch applies to its pretrain_gpt.py and the patched script stops every rank before the model is built on a
mismatch (`--preflight check`); the launcher's `--preflight auto` (turned into `verify`: fingerprints taken first)
reshards the legacy checkpoint to TP1 in memory and trains iterations 3 and 4 exactly as that release's own load-time
reshard of the torch_dist twin. For 0.13 and 0.14, whose distributed optimizer saves `fully_sharded_model_space`
(which megatron-core >= 0.16 no longer reads), main resumes such a checkpoint through `--preflight auto` exactly like
the release's own legacy re-save of it (`--ckpt-convert-format torch`), and `check` names the offline conversion.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.hook.test_megatron_lm import TINY, loss, megatron_env, run

RELEASES = dict(item.split("=", 1) for item in os.environ.get("MEGATRON_LM_RELEASES", "").split(",") if "=" in item)
pytestmark = pytest.mark.skipif(not RELEASES, reason="MEGATRON_LM_RELEASES is not set: no Megatron-LM release work "
                                                     "trees here (megatron.training is not on PyPI)")
PATCH = os.path.join(os.path.dirname(__file__), "..", "..", "patches", "pretrain_gpt.py.patch")
# Releases up to 0.15 draw mock-data token ids up to the document length (< 4096): a vocab that holds them. 0.14 and
# earlier know only the underscore spelling of the scheduler flag; later releases take both.
COMMON = ["--vocab-size", "4200"]
SCHED = "--use-checkpoint-opt-param-scheduler"
SCHED_OLD = "--use-checkpoint-opt_param-scheduler"
PORTS = {label: 29900 + 10 * i for i, label in enumerate(sorted(RELEASES))}


def release_run(tmp_path, label, ckpt, nproc, *flags, **kw):
    return run(tmp_path, ckpt, nproc, *COMMON, SCHED_OLD, *flags, root=RELEASES[label], drop=(SCHED,), **kw)


def save(root, out, nproc, *flags, port):
    """Two training steps of the tiny GPT with the Megatron-LM of ``root``, saved to ``out``."""
    python, env = megatron_env(root)
    argv = [a for a in TINY if a != SCHED]
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           "pretrain_gpt.py", *argv, *os.environ.get("MEGATRON_LM_EXTRA_ARGS", "").split(), *COMMON,
           "--train-iters", "2", "--save-interval", "2", "--save", str(out), *flags]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and os.path.exists(os.path.join(out, "latest_checkpointed_iteration.txt")), \
        (r.stdout + r.stderr)[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints each release writes, made once per release on first use: {(label, kind): path}."""
    made: dict = {}

    def get(label: str, kind: str) -> str:
        if (label, kind) not in made:
            out = tmp_path_factory.mktemp(f"r{label}_{kind}") / kind
            flags = {"tp2_torch": (2, ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch"]),
                     "tp2_torch_dist": (2, ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]),
                     "distopt_tp2dp2_torch_dist": (4, ["--tensor-model-parallel-size", "2", "--ckpt-format",
                                                       "torch_dist", "--use-distributed-optimizer"])}[kind]
            made[(label, kind)] = save(RELEASES[label], out, flags[0], *flags[1], port=PORTS[label] + 9)
        return made[(label, kind)]

    return get


def patched_script(tmp_path, root) -> str:
    """The release's pretrain_gpt.py with the project's patch applied by `git apply` (in a scratch repository)."""
    work = tmp_path / "patched"
    work.mkdir()
    shutil.copy(os.path.join(root, "pretrain_gpt.py"), work / "pretrain_gpt.py")
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    r = subprocess.run(["git", "-C", str(work), "apply", os.path.abspath(PATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (work / "pretrain_gpt.py").read_text()
    assert "megatron_preflight.install()" in text
    return str(work / "pretrain_gpt.py")


@pytest.mark.parametrize("label", sorted(RELEASES))
def test_the_patch_applies_and_check_stops_every_rank_before_the_build(tmp_path, written, label):
    script = patched_script(tmp_path, RELEASES[label])
    rc, log = release_run(tmp_path, label, written(label, "tp2_torch"), 2, "--preflight", "check",
                          "--tensor-model-parallel-size", "2", "--hidden-size", "64", "--ckpt-format", "torch",
                          launch=[script], port=PORTS[label])
    assert rc != 0, log[-3000:]
    assert "hidden_size" in log and "the job must not start" in log, log[-3000:]
    assert "number of parameters" not in log  # the model was never built


@pytest.mark.parametrize("label", sorted(RELEASES))
def test_auto_reshards_in_memory_like_the_releases_own_reshard(tmp_path, written, label):
    """Legacy TP2 -> TP1 through the launcher's --preflight auto (verify: the loaded state is proven against the
    checkpoint's fingerprints), weights and Adam state: iterations 3 and 4 equal the release's own load of its
    torch_dist twin at TP1."""
    common = ("--tensor-model-parallel-size", "1", "--no-load-rng", "--train-iters", "4")
    rc, log = release_run(tmp_path, label, written(label, "tp2_torch"), 1, "--preflight", "auto", "--ckpt-format",
                          "torch", *common, port=PORTS[label] + 1)
    assert rc == 0, log[-3000:]
    assert "loaded through the in-memory resharder" in log
    rc2, log2 = release_run(tmp_path, label, written(label, "tp2_torch_dist"), 1, "--ckpt-format", "torch_dist",
                            *common, plugin=False, port=PORTS[label] + 2)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


FSMS_RELEASES = sorted(label for label in RELEASES if label in ("0.13", "0.14"))


@pytest.mark.skipif("main" not in RELEASES, reason="main is not among MEGATRON_LM_RELEASES")
@pytest.mark.parametrize("label", FSMS_RELEASES)
def test_an_older_distributed_optimizer_checkpoint_resumes_in_main(tmp_path, written, label):
    """0.13/0.14 save the distributed optimizer's state as torch_dist `fully_sharded_model_space`, which main cannot
    load (its load_checkpoint fails after the build: 'ShardedTensor.flattened_range is not supported'). In main,
    `--preflight check` stops at start naming the offline conversion, and `--preflight auto` loads it through the
    in-memory resharder, and plain main loads its offline conversion (`reshard --ckpt-format torch_dist`): iterations 3
    and 4 of both equal main's resume of the release's own legacy re-save of it."""
    src = written(label, "distopt_tp2dp2_torch_dist")
    flags = ("--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--no-load-rng")
    rc, log = release_run(tmp_path, "main", src, 4, *flags, "--ckpt-format", "torch_dist", plugin=False,
                          port=PORTS["main"] + 3, verify=False)
    assert rc != 0 and "flattened_range" in log, log[-3000:]  # what a user meets without the plugin
    rc, log = release_run(tmp_path, "main", src, 4, *flags, "--ckpt-format", "torch_dist", "--preflight", "check",
                          port=PORTS["main"] + 4)
    assert rc == 1 and "fully_sharded_model_space" in log and "megatron-preflight reshard" in log, log[-3000:]
    assert "number of parameters" not in log
    resaved = tmp_path / "resaved"  # the release's own conversion: load it, save it as legacy files, stop
    rc, log = release_run(tmp_path, label, src, 4, *flags, "--ckpt-format", "torch_dist", "--ckpt-convert-format",
                          "torch", "--ckpt-convert-save", str(resaved), plugin=False, port=PORTS[label] + 5,
                          verify=False)
    assert rc == 0, log[-3000:]
    resaved_root = resaved / "torch"
    assert resaved_root.exists(), os.listdir(resaved)
    common = (*flags, "--train-iters", "4")
    rc, log = release_run(tmp_path, "main", src, 4, *common, "--ckpt-format", "torch_dist", "--preflight", "auto",
                          port=PORTS["main"] + 6)
    assert rc == 0 and "loaded through the in-memory resharder" in log, log[-3000:]
    rc2, log2 = release_run(tmp_path, "main", str(resaved_root), 4, *common, "--ckpt-format", "torch", plugin=False,
                            port=PORTS["main"] + 7)
    assert rc2 == 0, log2[-3000:]
    assert loss(log, 4, 4) is not None
    assert (loss(log, 3, 4), loss(log, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))
    converted = tmp_path / "converted"  # offline: the fix `check` names, then plain main
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", "reshard", src, str(converted), "--ckpt-format",
                        "torch_dist", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rc3, log3 = release_run(tmp_path, "main", str(converted), 4, *common, "--ckpt-format", "torch_dist",
                            plugin=False, port=PORTS["main"] + 8)
    assert rc3 == 0, log3[-3000:]
    assert (loss(log3, 3, 4), loss(log3, 4, 4)) == (loss(log2, 3, 4), loss(log2, 4, 4))


SIGNALS = """
import argparse, json
import megatron.core
from megatron_preflight.hook import runtime
args = argparse.Namespace(optimizer="adam", optimizer_cpu_offload=False, moe_grouped_gemm=True, transformer_impl="local")
print("SIGNALS " + json.dumps({"version": runtime.running_version(), "flattened": runtime.loads_flattened_range(),
                               "mtp": runtime.mtp_layer_name(), "keys": list(runtime.param_group_keys()),
                               "adam": runtime.run_adam_family(args), "grouped": runtime.builds_grouped_mlp(args)}))
"""


@pytest.mark.parametrize("label", sorted(RELEASES))
def test_the_hooks_questions_get_answers_from_every_release(label):
    """What the hook asks the running megatron.core (the optimizer forms it reads, how it names an MTP layer, how it
    pairs param groups, which Adam it built, whether its local spec builds GroupedMLP) has an answer in every release,
    and the answers are the offline table's (check --megatron-version), release by release."""
    import json

    from megatron_preflight.check import releases

    python, env = megatron_env(RELEASES[label])
    r = subprocess.run([python, "-c", SIGNALS], cwd=RELEASES[label], env=env, capture_output=True, text=True,
                       timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("SIGNALS ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
    got = json.loads(line[len("SIGNALS "):])
    assert got["version"] and (label == "main" or got["version"].startswith(label + "."))
    want = releases.facts(releases.parse_version(got["version"]))
    assert got["flattened"] == want.loads_flattened_range
    assert got["mtp"] == want.mtp_layer_name
    assert tuple(got["keys"]) == want.param_group_keys
    assert got["grouped"] == want.local_grouped_mlp
    assert got["adam"] == "torch"  # no TE or apex in the runner: torch's AdamW, said by every release


# Layouts the run cannot have (hook/early.py): each answered by the plugin at argument parsing, before Megatron's
# validate_args and its model-config build raise. (checkpoint kind, ranks, flags, the plugin's words)
IMPOSSIBLE = {
    "TP3 on 4 heads": ("tp2_torch", 3, ["--tensor-model-parallel-size", "3", "--ckpt-format", "torch"],
                       "4 attention heads are not divisible by TP3"),
    "PP3 on 4 layers": ("tp2_torch_dist", 3, ["--pipeline-model-parallel-size", "3"],
                        "4 layers are not divisible by PP3"),
    "EP3 on 8 experts": ("tp2_torch", 3, ["--num-experts", "8", "--expert-model-parallel-size", "3",
                                          "--disable-bias-linear", "--ckpt-format", "torch"],
                         "8 experts are not divisible by EP3"),
    "world 3 at TP2": ("tp2_torch_dist", 3, ["--tensor-model-parallel-size", "2"],
                       "world size 3 is not divisible by TP·PP·CP = 2"),
}


def assert_stopped_by_the_plugin(rc: int, log: str, words: str) -> None:
    """The plugin's message with its fix and the nearest layouts; every rank that ended by itself ended with 1 (the
    others were stopped by torchrun); no Megatron traceback, no model built."""
    assert rc != 0, log[-3000:]
    assert "[megatron-preflight] the run's parallel layout cannot work" in log and words in log, log[-3000:]
    assert "Fix: " in log and "nearest to the run's" in log, log[-3000:]
    assert "/megatron/" not in "".join(line for line in log.splitlines() if line.lstrip().startswith("File "))
    assert "ValueError" not in log and "AssertionError" not in log, log[-3000:]
    codes = [line.split(":", 1)[1].split()[0] for line in log.splitlines() if line.strip().startswith("exitcode")]
    assert codes and set(codes) <= {"1", "-15"} and "1" in codes, codes
    assert "number of parameters" not in log


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
@pytest.mark.parametrize("label", sorted(RELEASES))
@pytest.mark.parametrize("how", ["launcher", "patch"])
def test_an_impossible_layout_is_answered_by_the_plugin_before_megatron(tmp_path, written, label, case, how):
    kind, nproc, flags, words = IMPOSSIBLE[case]
    launch = [patched_script(tmp_path, RELEASES[label])] if how == "patch" else None
    rc, log = release_run(tmp_path, label, written(label, kind), nproc, "--preflight", "check", *flags,
                          launch=launch, port=PORTS[label] + 2, verify=False)
    assert_stopped_by_the_plugin(rc, log, words)
