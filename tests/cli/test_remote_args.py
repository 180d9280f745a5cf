"""Every command with ``msc://`` arguments, against a real S3-compatible server (SeaweedFS, tests/helpers/s3_server.py)
through multi-storage-client: a reshard from and to the store equals the same reshard on disk, tensor for tensor; the
destination is published tracker last and never over another checkpoint; every fault is one clear error naming the
object, with a non-zero exit and no traceback (run in fresh processes: the client caches a profile per process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import main
from tests.conftest import fixture_path
from tests.helpers import s3_server

GQA = "bf16_gqa_tp2_torch_dist"


@pytest.fixture
def store(s3):
    s3.upload_dir(fixture_path(GQA), "cli/gqa")
    s3.upload_dir(fixture_path("tp2_torch"), "cli/legacy")
    return s3


def _keys(store, prefix: str) -> list[str]:
    got = store.client().list_objects_v2(Bucket=s3_server.BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for o in got.get("Contents", []))


def test_a_reshard_from_and_to_the_store_is_the_one_on_disk(store, tmp_path, capsys):
    local = str(tmp_path / "tp1")
    assert main(["reshard", fixture_path(GQA), local, "--tensor-model-parallel-size", "1", "--ckpt-format",
                 "torch_dist", "--no-progress"]) == 0
    assert main(["reshard", "msc://store/cli/gqa", "msc://store/cli/gqa_tp1", "--tensor-model-parallel-size", "1",
                 "--no-progress"]) == 0  # torch_dist: what Megatron-LM loads from msc://
    err = capsys.readouterr().err
    assert "published" in err and "the tracker last" in err
    assert sorted(_keys(store, "cli/gqa_tp1")) == sorted(
        os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/") for d, _s, fs in os.walk(local) for f in fs)
    assert main(["diff", "msc://store/cli/gqa_tp1", local]) == 0
    assert "EQUAL" in capsys.readouterr().out
    # and to disk
    out = str(tmp_path / "from_store")
    assert main(["reshard", "msc://store/cli/gqa", out, "--tensor-model-parallel-size", "1", "--no-progress"]) == 0
    assert main(["diff", out, fixture_path(GQA)]) == 0
    # never over another checkpoint
    capsys.readouterr()
    assert main(["reshard", "msc://store/cli/gqa", "msc://store/cli/gqa_tp1", "--tensor-model-parallel-size",
                 "1"]) == 2
    assert "the destination holds" in capsys.readouterr().err


def test_a_legacy_checkpoint_on_the_store_is_answered_and_its_printed_fix_runs(store, capsys):
    assert main(["inspect", "msc://store/cli/legacy"]) == 2
    err = capsys.readouterr().err
    assert "legacy (--ckpt-format torch)" in err
    fix = re.search(r"`megatron-preflight (reshard [^`]+)`", err).group(1).split()
    assert main(fix + ["--no-progress"]) == 0
    capsys.readouterr()
    assert main(["inspect", fix[2]]) == 0
    assert "torch_dist" in capsys.readouterr().out
    assert main(["reshard", "msc://store/cli/gqa", "msc://store/cli/legacy_out", "--ckpt-format", "torch"]) == 2
    assert "cannot load" in capsys.readouterr().err and not _keys(store, "cli/legacy_out")


def _run(config: str, *argv: str, block_client: bool = False) -> subprocess.CompletedProcess:
    code = ("import sys\n" + ("sys.modules['multistorageclient'] = None\n" if block_client else "") +
            "from megatron_preflight.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, MSC_CONFIG=config)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("fault, expect", [
    ("secret", "wrong or missing credentials"),
    ("endpoint", "could not connect to the store"),
    ("bucket", "does not exist"),
    ("profile", "is not defined"),
    ("prefix", "no objects under this prefix"),
    ("client", "needs NVIDIA's multi-storage-client"),
])
def test_each_fault_is_one_clear_error(store, fault, expect):
    config = store.config(f"{fault}.yaml", secret="wrong" if fault == "secret" else s3_server.SECRET,
                          endpoint="http://127.0.0.1:9" if fault == "endpoint" else None,
                          bucket="nobucket" if fault == "bucket" else s3_server.BUCKET)
    url = {"profile": "msc://nostore/cli/gqa", "prefix": "msc://store/cli/nothere"}.get(fault, "msc://store/cli/gqa")
    done = _run(config, "check", url, block_client=fault == "client")
    assert done.returncode in (1, 2), done.stderr
    assert expect in done.stderr and "Traceback" not in done.stderr and "Fix:" in done.stderr, done.stderr
    assert done.stderr.count("\n") <= 2  # one paragraph
    if fault == "endpoint":
        assert "attempts" in done.stderr  # the retries said


@pytest.mark.parametrize("mode, expect", [
    ("cut", "response was cut short"),
    ("error", "the store failed the request"),
    ("stall", "did not answer in time"),
])
def test_a_response_cut_short_an_error_or_a_stall_is_one_clear_error_naming_the_object(store, mode, expect):
    """Through a proxy that spoils the GETs of the data file (tests/helpers/s3_proxy.py): the client's retries run
    out (2 attempts, said), the error names the object, no traceback, nothing hangs."""
    import time

    from tests.helpers.s3_proxy import Proxy

    with Proxy(store.endpoint, mode, "__0_0.distcp", stall_s=4) as proxy:
        config = store.config(f"proxy_{mode}.yaml", endpoint=proxy.endpoint, read_timeout=1)
        t = time.monotonic()
        done = _run(config, "inspect", "msc://store/cli/gqa")
        took = time.monotonic() - t
    assert done.returncode == 1, done.stderr
    assert expect in done.stderr and "msc://store/cli/gqa/iter_0000002/__0_0.distcp" in done.stderr, done.stderr
    assert "2 attempts" in done.stderr and "Traceback" not in done.stderr
    assert proxy.spoiled >= 2 and took < 60


def test_a_throttled_store_is_retried_and_the_command_answers(store):
    from tests.helpers.s3_proxy import Proxy

    with Proxy(store.endpoint, "throttle", "__0_0.distcp", times=1) as proxy:
        done = _run(store.config("throttle.yaml", endpoint=proxy.endpoint, attempts=3), "inspect",
                    "msc://store/cli/gqa")
    assert done.returncode == 0, done.stderr
    assert proxy.spoiled >= 2  # the 503 SlowDown, then the retry that got through


def test_fingerprints_of_a_checkpoint_on_the_store_are_stored_beside_it_and_prove_its_content(store, capsys):
    store.upload_dir(fixture_path("tp2_torch_dist"), "cli/fp")
    before = _keys(store, "cli/fp")
    assert main(["fingerprint", "msc://store/cli/fp", "--weights-only"]) == 0
    added = sorted(set(_keys(store, "cli/fp")) - set(before))
    assert len(added) == 1 and "fingerprint" in added[0], added
    assert "msc://store/cli/fp/" + added[0] in capsys.readouterr().err
    assert main(["inspect", "msc://store/cli/fp", "--verify-content"]) == 0
    assert "equal" in capsys.readouterr().out.lower()


def test_a_publish_that_fails_midway_leaves_no_checkpoint_behind(store):
    """The store refuses the upload of the destination's .metadata (a 500 from the proxy, after the client's retries):
    the data files already uploaded are deleted again, no tracker was ever written, the command exits 1 naming the
    object."""
    from tests.helpers.s3_proxy import Proxy

    with Proxy(store.endpoint, "error", "cli/half/iter_0000002/.metadata", methods=("PUT",)) as proxy:
        done = _run(store.config("publish_fail.yaml", endpoint=proxy.endpoint), "reshard", "msc://store/cli/gqa",
                    "msc://store/cli/half", "--tensor-model-parallel-size", "1", "--no-progress")
    assert done.returncode == 1 and "msc://store/cli/half/iter_0000002/.metadata" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and proxy.spoiled >= 1
    assert _keys(store, "cli/half") == []
