"""A checkpoint on a real S3-compatible server (SeaweedFS, tests/helpers/s3_server.py) through multi-storage-client:
a verdict's staging fetches exactly the metadata — the small files and the torch_dist non-tensor items the
``.metadata`` locates, or a safetensors file's header — and the commands answer as they do on the local copy."""

from __future__ import annotations

import json
import os

import pytest

from megatron_preflight.cli.main import main
from megatron_preflight.layout.dist import object_index, read_dcp_metadata
from megatron_preflight.remote.mirror import Mirror, _is_tensor_file, staged
from tests.conftest import fixture_path

MOE = "distopt_dpr_moe_ep2dp2_torch_dist"


@pytest.fixture
def store(s3):
    s3.upload_dir(fixture_path(MOE), "mirror/moe")
    return s3


def _metadata_bytes(root: str) -> int:
    """What a verdict may read of the local checkpoint ``root``: its non-tensor files whole, and the non-tensor
    items of its torch_dist iteration where its .metadata says they lie."""
    total = 0
    for dirpath, _d, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
            if not _is_tensor_file(rel):
                total += os.path.getsize(os.path.join(dirpath, f))
    md = read_dcp_metadata(os.path.join(root, "iter_0000002"))
    return total + sum(int(i.length) for i in object_index(md).values())


def test_a_verdict_fetches_the_metadata_and_nothing_else(store):
    with staged("msc://store/mirror/moe", "metadata") as m:
        assert m.store.counters.fetched == _metadata_bytes(fixture_path(MOE))
        assert m.store.counters.fetched < m.size / 5
        # every object is there at its size; the tensor bytes are holes
        for rel, size in m.objects.items():
            assert os.path.getsize(m.path(rel)) == size
        # the staged dir reads as the checkpoint: the same report as the local copy's
        assert main(["inspect", m.local, "--json"]) == 0


def test_inspect_of_the_url_reports_what_the_local_copy_does(store, capsys):
    url = "msc://store/mirror/moe"
    assert main(["inspect", fixture_path(MOE), "--json"]) == 0
    local = json.loads(capsys.readouterr().out.replace(fixture_path(MOE), url))
    assert main(["inspect", url, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == local
    assert "preflight-msc-" not in captured.out + captured.err  # the mirror's temp paths never shown
    assert f"{url}:" in captured.err and "fetched of" in captured.err


def test_an_hf_model_on_the_store_fetches_headers_only(store, tmp_path, capsys):
    from tests.helpers import hf_models

    hf = hf_models.write("qwen3", str(tmp_path / "qwen3"))
    store.upload_dir(hf, "mirror/qwen3")
    assert main(["flags", hf]) == 0
    local = capsys.readouterr().out
    with Mirror("msc://store/mirror/qwen3") as m:
        m.stage_metadata()
        head = 0
        for f in os.listdir(hf):
            p = os.path.join(hf, f)
            if f.endswith(".safetensors"):
                with open(p, "rb") as fh:
                    head += 8 + int.from_bytes(fh.read(8), "little")
            else:
                head += os.path.getsize(p)
        assert m.store.counters.fetched == head  # the config, the tokenizer files, each header: no tensor byte
    assert main(["flags", "msc://store/mirror/qwen3"]) == 0
    assert capsys.readouterr().out.replace("msc://store/mirror/qwen3", hf) == local


def test_a_mirror_is_staged_in_memory_when_it_fits_twice_else_on_disk(monkeypatch, tmp_path):
    import tempfile

    from megatron_preflight.remote import mirror

    monkeypatch.delenv(mirror.STAGING_ENV, raising=False)
    if os.path.isdir(mirror.SHM):
        assert mirror.staging_root(2**20) == mirror.SHM
    assert mirror.staging_root(2**62) == tempfile.gettempdir()
    monkeypatch.setenv(mirror.STAGING_ENV, str(tmp_path))
    assert mirror.staging_root(2**20) == str(tmp_path)


def test_staging_a_checkpoint_where_it_does_not_fit_is_refused_before_a_byte_is_fetched(store, monkeypatch):
    from megatron_preflight.errors import PreflightError
    from megatron_preflight.remote import mirror as mirror_mod

    with Mirror("msc://store/mirror/moe") as m:
        real = os.statvfs

        class Full:
            f_bavail, f_frsize = 1, 4096

        monkeypatch.setattr(mirror_mod.os, "statvfs", lambda p: Full() if p == m.root else real(p))
        with pytest.raises(PreflightError, match="needs that much free space") as exc:
            m.fetch_all()
        assert mirror_mod.STAGING_ENV in exc.value.fix and m.store.counters.fetched == 0
