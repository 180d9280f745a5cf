"""SourceFiles' table of readers names each reference type without importing it: the names must stay true."""

from __future__ import annotations

import importlib
import subprocess
import sys

from megatron_preflight.reshard.sources import files
from megatron_preflight.torch_file import TensorRef


def test_every_reader_is_named_by_a_reference_type_that_exists() -> None:
    for module, name in files.READERS:
        kind = getattr(importlib.import_module(module), name)
        assert isinstance(kind, type) and issubclass(kind, TensorRef), (module, name)


def test_a_reference_finds_its_own_formats_reader_before_its_bases() -> None:
    from megatron_preflight.reshard.sources.torch_dist_reader import RegionRef

    assert [files._name(k) in files.READERS for k in RegionRef.__mro__[:2]] == [True, True]  # RegionRef, TensorRef
    assert files.READERS[files._name(RegionRef)] is files._dist_reader


def test_a_legacy_source_imports_no_other_formats_reader() -> None:
    code = ("import sys; from megatron_preflight.reshard.sources import files; "
            "print([m for m in ('megatron_preflight.reshard.sources.torch_dist_reader', "
            "'megatron_preflight.reshard.sources.hf', 'megatron_preflight.layout.hf.safetensors') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
