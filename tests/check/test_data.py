"""The run's data, checked at job start from file headers, on real indexed datasets written by megatron-core's own
IndexedDatasetBuilder."""

import os

import numpy
import pytest
import torch

from megatron_preflight.check.data import check_prefix, data_findings, prefixes
from megatron_preflight.check.plan import Verdict, make_plan
from megatron_preflight.check.runtime_args import from_cli
from tests.conftest import fixture_path
from tests.helpers.tiny import FLAGS


def build(prefix, top=99, dtype=numpy.uint16, docs=5):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in range(docs):
        builder.add_item(torch.tensor([(d * 7 + i) % top for i in range(10 + d)] + [top]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_good_dataset_passes_and_blends_are_parsed(tmp_path):
    a, b = build(str(tmp_path / "a")), build(str(tmp_path / "b"))
    assert check_prefix(a, 100) is None
    assert prefixes(["0.3", a, "0.7", b]) == [a, b] and prefixes([a, b]) == [a, b]
    p = make_plan(fixture_path("tp2_torch"), from_cli(FLAGS + ["--tensor-model-parallel-size", "2",
                                                               "--data-path", "0.3", a, "0.7", b]))
    assert p.verdict == Verdict.LOAD and "data" not in [f.field for f in p.findings]


@pytest.mark.parametrize("damage, words", [
    ("no_idx", "does not exist"),
    ("truncated_bin", "truncated"),
    ("truncated_idx", "truncated"),
    ("not_an_index", "not a Megatron indexed dataset"),
])
def test_a_broken_dataset_is_fatal_at_start(tmp_path, damage, words):
    prefix = build(str(tmp_path / "d"))
    if damage == "no_idx":
        os.remove(prefix + ".idx")
    elif damage == "truncated_bin":
        os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 6)
    elif damage == "truncated_idx":
        os.truncate(prefix + ".idx", 40)
    else:
        with open(prefix + ".idx", "r+b") as fh:
            fh.write(b"NOTANIDX")
    p = make_plan(fixture_path("tp2_torch"), from_cli(FLAGS + ["--tensor-model-parallel-size", "2",
                                                               "--data-path", prefix]))
    f, = [f for f in p.fatal if f.field == "data"]
    assert words in f.message and prefix in f.message


def test_token_ids_beyond_the_vocab_are_fatal(tmp_path):
    prefix = build(str(tmp_path / "big"), top=300)
    problem = check_prefix(prefix, 100)
    assert problem and "token id 300" in problem
    assert check_prefix(prefix, 301) is None


def test_mock_data_is_not_checked(tmp_path):
    rt = from_cli(FLAGS + ["--data-path", str(tmp_path / "missing"), "--mock-data"])
    assert data_findings(rt) == []
    assert data_findings(from_cli(FLAGS + ["--data-path", str(tmp_path / "missing")]))


def test_the_index_cache_must_be_writable(tmp_path):
    prefix = build(str(tmp_path / "d"))
    base = FLAGS + ["--tensor-model-parallel-size", "2", "--data-path", prefix]
    ok = make_plan(fixture_path("tp2_torch"), from_cli(base))  # default cache: <prefix>/cache/GPTDataset_indices
    assert "data_cache_path" not in [f.field for f in ok.findings]
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = make_plan(fixture_path("tp2_torch"), from_cli(base + ["--data-cache-path", str(blocker / "cache")]))
    f, = [f for f in bad.fatal if f.field == "data_cache_path"]
    assert "Failed to write dataset materials" in f.message and "--data-cache-path" in f.fix


def test_a_per_split_args_file_is_read(tmp_path):
    import json

    a = build(str(tmp_path / "a"))
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": f"0.5 {a} 0.5 {tmp_path / 'gone'}", "valid": [a], "test": []}))
    p = make_plan(fixture_path("tp2_torch"), from_cli(FLAGS + ["--tensor-model-parallel-size", "2",
                                                               "--per-split-data-args-path", str(spec)]))
    f, = [f for f in p.fatal if f.field == "data"]
    assert "gone" in f.message and "--per-split-data-args-path" in f.message
