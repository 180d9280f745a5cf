import argparse
import os
import pickle

import pytest

from megatron_preflight.errors import UnsafePickleError
from megatron_preflight.placeholders import Placeholder
from megatron_preflight.safe_pickle import safe_loads


def test_plain_megatron_args_roundtrip():
    ns = argparse.Namespace(a=1, b=[1, 2], c={"x": (1, 2.5)}, d=None)
    assert safe_loads(pickle.dumps(ns), source="t") == ns


def test_missing_megatron_class_becomes_inert_placeholder():
    # GLOBAL megatron...NoSuchEnum; MARK; INT 3; TUPLE; REDUCE; STOP  (a class no Megatron version has)
    blob = b"cmegatron.core.transformer.enums\nNoSuchEnum\n(I3\ntR."
    obj = safe_loads(blob, source="t")
    assert isinstance(obj, Placeholder) and obj.value == 3 and "NoSuchEnum(3)" in obj.describe()


def test_os_system_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(UnsafePickleError) as exc:
        safe_loads(pickle.dumps(Evil()), source="evil.pt")
    assert "evil.pt" in str(exc.value) and "--trust-checkpoint" in str(exc.value)
    assert not marker.exists()


def test_builtins_eval_refused():
    class Evil:
        def __reduce__(self):
            return (eval, ("1+1",))

    with pytest.raises(UnsafePickleError):
        safe_loads(pickle.dumps(Evil()), source="e")


def test_a_path_object_loads_inert_and_a_path_method_stays_refused():
    """DCP's StorageMeta.checkpoint_id, as Megatron-FSDP's save pickles it (fixture fsdp_dp2): a ``PosixPath`` is
    read as an inert placeholder, never built; a path method a pickle could call (reading or writing files) is
    not on the list."""
    import pathlib

    obj = safe_loads(pickle.dumps({"checkpoint_id": pathlib.PurePosixPath("ckpt", "iter_0000002")}), source="t")
    assert isinstance(obj["checkpoint_id"], Placeholder) and "iter_0000002" in repr(obj["checkpoint_id"])
    assert isinstance(safe_loads(b"cpathlib\nPosixPath\n(S'x'\ntR.", source="t"), Placeholder)
    for name in ("write_text", "unlink", "Path.write_text"):
        with pytest.raises(UnsafePickleError):
            safe_loads(f"cpathlib\n{name}\n(S'x'\ntR.".encode(), source="t")


def test_dcp_records_get_their_fields_from_the_unpickler_and_hash_by_value():
    """A DCP dataclass (MetadataIndex keys storage_data) is a Record: its fields put into ``__dict__`` by the C
    unpickler (no Python call per record), equal records equal and hashing alike, usable as dict keys."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def load(fqn, offset, index):
        return safe_loads(pickle.dumps(MetadataIndex(fqn, torch.Size(offset), index), protocol=4), source="t")

    a, b, c = load("w", (0, 4), 1), load("w", (0, 4), 1), load("w", (2, 4), 1)
    assert isinstance(a, Placeholder) and (a.fqn, tuple(a.offset), a.index) == ("w", (0, 4), 1)
    assert a == b and hash(a) == hash(b) and a != c and {a: 1}[b] == 1
    assert a._state is a.__dict__ and a._state["fqn"] == "w"

    # a record whose state is no field dict (the class, EMPTY_TUPLE NEWOBJ, BININT1 5, BUILD): refused as corrupt
    forged = pickle.dumps(MetadataIndex, protocol=4)[:-1] + b")\x81K\x05b."
    with pytest.raises(pickle.UnpicklingError, match="state is not a dictionary"):
        safe_loads(forged, source="t")
