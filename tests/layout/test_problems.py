"""Every checkpoint problem gets a named code, the file it concerns, and a fix (real fixtures, damaged in tmp)."""

import os
import shutil

import pytest
import torch

from megatron_preflight.layout.discover import discover
from tests.conftest import fixture_path


def codes(layout):
    return [p.code for p in layout.problems]


def one(layout, code):
    found = [p for p in layout.problems if p.code == code]
    assert found, f"no {code} in {codes(layout)}"
    j = found[0].to_json()
    assert j["path"] and "Fix:" in j["message"]
    return found[0]


def test_missing_shard(real_fixture):
    root = real_fixture("tp2_torch")
    shutil.rmtree(os.path.join(root, "iter_0000002", "mp_rank_01"))
    layout = discover(root)
    p = one(layout, "missing_shard")
    assert p.path.endswith("mp_rank_01") and layout.missing_shards == ["mp_rank_01"]
    assert not layout.ok


def test_missing_ep_shard_of_3d_checkpoint(real_fixture):
    root = real_fixture("moe_ep2_torch")
    shutil.rmtree(os.path.join(root, "iter_0000002", "mp_rank_00_001"))
    layout = discover(root)
    assert layout.ep == 2 and layout.missing_shards == ["mp_rank_00_001"]


def test_stray_shard(real_fixture):
    root = real_fixture("tp2_torch")
    it = os.path.join(root, "iter_0000002")
    shutil.copytree(os.path.join(it, "mp_rank_01"), os.path.join(it, "mp_rank_05"))
    shutil.copytree(os.path.join(it, "mp_rank_01"), os.path.join(it, "mp_rank_01_001"))
    layout = discover(root)
    assert sorted(layout.stray_shards) == ["mp_rank_01_001", "mp_rank_05"]
    one(layout, "stray_shard")


def test_shards_with_disagreeing_args(real_fixture):
    root = real_fixture("tp2_torch")
    shutil.copy(fixture_path("tp1_torch") + "/iter_0000002/mp_rank_00/model_optim_rng.pt",
                os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt"))
    p = one(discover(root), "args_disagree")
    assert "tensor_model_parallel_size" in p.message and "mp_rank_01" in p.path


def test_tracker_points_to_missing_iteration(real_fixture):
    root = real_fixture("tp2_torch")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("5")
    p = one(discover(root), "missing_iteration")
    assert "iter_0000005" in p.path and "2" in p.fix


def test_bad_tracker(real_fixture):
    root = real_fixture("tp2_torch")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("garbage")
    layout = discover(root)
    one(layout, "bad_tracker")
    assert layout.iteration == 2  # still inspects the newest iteration


def test_no_tracker(real_fixture):
    root = real_fixture("tp2_torch")
    os.remove(os.path.join(root, "latest_checkpointed_iteration.txt"))
    layout = discover(root)
    assert "starts from random" in one(layout, "no_tracker").message
    assert layout.tp == 2


def test_explicit_iteration(real_fixture):
    root = real_fixture("tp2_torch")
    assert discover(root, iteration=2).ok
    one(discover(root, iteration=3), "missing_iteration")


def test_truncated_file(real_fixture):
    root = real_fixture("tp2_torch")
    path = os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    p = one(discover(root), "corrupt_file")
    assert p.path == path and "truncated" in p.message


def test_zero_byte_file(real_fixture):
    root = real_fixture("tp2_torch")
    path = os.path.join(root, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    open(path, "w").close()
    assert one(discover(root), "empty_file").path == path


def test_garbage_file(real_fixture):
    root = real_fixture("tp2_torch")
    path = os.path.join(root, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    with open(path, "wb") as fh:
        fh.write(b"this is not a torch file" * 10)
    assert one(discover(root), "corrupt_file").path == path


def test_unreadable_file(real_fixture, monkeypatch):
    """FAKE permission error (tests run as root, where chmod 000 does not stop reads)."""
    import builtins

    root = real_fixture("tp2_torch")
    path = os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    real_open = builtins.open

    def guarded(file, *a, **k):
        if os.fspath(file) == path:
            raise PermissionError(13, "Permission denied")
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    p = one(discover(root), "unreadable_file")
    assert p.path == path and "Permission denied" in p.message


def test_shard_dir_without_model_file(real_fixture):
    root = real_fixture("tp2_torch")
    os.remove(os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt"))
    assert one(discover(root), "missing_file").path.endswith("mp_rank_01/model_optim_rng.pt")


def test_missing_distrib_optim(real_fixture):
    root = real_fixture("tp2_distopt_torch")
    os.remove(os.path.join(root, "iter_0000002", "mp_rank_01", "distrib_optim.pt"))
    p = one(discover(root), "missing_file")
    assert p.path.endswith("mp_rank_01/distrib_optim.pt") and "--no-load-optim" in p.fix


def test_iteration_mismatch(real_fixture):
    root = real_fixture("tp2_torch")
    os.rename(os.path.join(root, "iter_0000002"), os.path.join(root, "iter_0000004"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    assert "iteration 2" in one(discover(root), "iteration_mismatch").message


def test_mixed_formats(real_fixture):
    root = real_fixture("tp2_torch")
    src = fixture_path("tp2_torch_dist") + "/iter_0000002"
    for f in os.listdir(src):
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(root, "iter_0000002", f))
    one(discover(root), "mixed_formats")


def test_dist_missing_data_file(real_fixture):
    root = real_fixture("tp2_torch_dist")
    os.remove(os.path.join(root, "iter_0000002", "__1_0.distcp"))
    layout = discover(root)
    assert one(layout, "missing_shard").path.endswith("__1_0.distcp")


def test_dist_truncated_data_file(real_fixture):
    root = real_fixture("tp2_torch_dist")
    path = os.path.join(root, "iter_0000002", "__1_0.distcp")
    with open(path, "r+b") as fh:
        fh.truncate(100)
    assert one(discover(root), "corrupt_file").path == path


@pytest.mark.parametrize("kind, expect", [
    ("deepspeed", "DeepSpeed"), ("empty", "empty directory"), ("other", "without a Megatron"),
])
def test_not_megatron(tmp_path, kind, expect):
    d = tmp_path / kind
    d.mkdir()
    if kind == "hf":
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"x")
    elif kind == "deepspeed":
        (d / "latest").write_text("global_step10")
        (d / "global_step10").mkdir()
        (d / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    elif kind == "other":
        (d / "notes.txt").write_text("hi")
    layout = discover(str(d))
    assert layout.format is None and not layout.ok
    p = one(layout, "not_megatron")
    assert "not a Megatron checkpoint" in p.message and expect in p.message


def test_a_hugging_face_dir_is_read_as_one_and_an_unknown_model_named(tmp_path):
    """An HF model dir is a checkpoint of format hf (layout/hf); a config naming no supported architecture is one
    problem that names what is supported."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    (d / "model.safetensors").write_bytes(b"x")
    layout = discover(str(d))
    assert layout.format is not None and layout.format.value == "hf" and not layout.ok
    p = one(layout, "hf_unsupported")
    assert "GPTNeoXForCausalLM" in p.message and "LlamaForCausalLM" in p.fix


def test_unsafe_pickle_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root = tmp_path / "ckpt"
    shard = root / "iter_0000001" / "mp_rank_00"
    shard.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": None, "iteration": 1, "model": {"w": torch.zeros(2)}, "x": Evil()},
               shard / "model_optim_rng.pt")
    layout = discover(str(root))
    p = one(layout, "unsafe_pickle")
    assert "system" in p.message and "--trust-checkpoint" in p.fix
    assert not marker.exists()


def test_unknown_type_allowed_only_when_trusted(tmp_path):
    import collections

    root = tmp_path / "ckpt"
    shard = root / "iter_0000001" / "mp_rank_00"
    shard.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"iteration": 1, "model": {"w": torch.zeros(2)}, "c": collections.Counter("ab")},
               shard / "model_optim_rng.pt")
    assert "unsafe_pickle" in codes(discover(str(root)))
    assert "unsafe_pickle" not in codes(discover(str(root), trust_checkpoint=True))


def _snapshot(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("name", ["tp2_torch", "moe_ep2_torch", "tp2_torch_dist", "tp2_distopt_torch"])
def test_inspection_writes_nothing(real_fixture, name):
    root = real_fixture(name)
    before = _snapshot(root)
    discover(root)
    assert _snapshot(root) == before


def test_a_fifo_tracker_is_a_problem_not_a_hang(real_fixture):
    root = real_fixture("tp2_torch")
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    os.remove(tracker)
    os.mkfifo(tracker)
    layout = discover(root)  # would block forever reading a FIFO
    assert [p.code for p in layout.problems] == ["not_regular"] and "FIFO" in layout.problems[0].message


def test_a_fifo_shard_file_is_a_problem_not_a_hang(real_fixture):
    root = real_fixture("tp2_torch")
    f = os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    os.remove(f)
    os.mkfifo(f)
    layout = discover(root)
    assert any(p.code == "not_regular" and p.path == f for p in layout.problems)


def test_a_binary_tracker_is_a_bad_tracker_not_an_internal_error(real_fixture):
    root = real_fixture("tp2_torch")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "wb") as fh:
        fh.write(b"\x00\xff\xfe" * 5000)
    layout = discover(root)
    assert [p.code for p in layout.problems] == ["bad_tracker"]


@pytest.mark.parametrize("name,remove,says", [
    ("tp2_torch_dist", "metadata.json", "Megatron does not recognize the dir as a distributed checkpoint"),
    ("v14_tp2_torch_dist", "common.pt", "the common state (args, iteration, RNG, ...) is missing"),
])
def test_incomplete_torch_dist_is_not_sound(real_fixture, name, remove, says):
    root = real_fixture(name)
    os.remove(os.path.join(root, "iter_0000002", remove))
    layout = discover(root)
    assert not layout.ok and any(says in p.message for p in layout.problems)
