"""A restricted unpickler for Megatron checkpoints: resolves only an allow-list of globals, never runs code.

A Megatron ``model_optim_rng.pt`` is a pickle. ``pickle`` resolves every ``GLOBAL`` it meets and calls whatever
``REDUCE`` names, so loading an untrusted file runs the author's code. This module resolves:

* plain containers and value types that Megatron's ``args`` and state hold (``argparse.Namespace``,
  ``OrderedDict``, torch dtypes and sizes, numpy arrays for RNG state, ``signal.Signals``);
* torch's tensor-rebuild functions, swapped for hooks supplied by the caller (so tensors can stay on disk);
* torch.distributed.checkpoint's metadata dataclasses, always as inert :class:`Record` s (their fields as attributes:
  importing torch.distributed.checkpoint costs ~1.3 s, and nothing here needs the real classes);
* any class from Megatron / Transformer Engine / ModelOpt modules as an inert :class:`Placeholder`, whether or not
  that package is installed (versions differ: ``InferenceCudaGraphScope`` exists only in newer Megatron-LM).

Anything else raises :class:`UnsafePickleError`, unless the caller passes ``trust=True`` (``--trust-checkpoint``).
"""

from __future__ import annotations

import _compat_pickle
import argparse
import codecs
import collections
import gc
import io
import pickle
import signal
import types
from collections.abc import Callable
from typing import Any

from megatron_preflight import dtypes, pickle_limits
from megatron_preflight.dtypes import torch_loaded
from megatron_preflight.errors import UnsafePickleError
from megatron_preflight.placeholders import Placeholder, placeholder_class, record_class

# Module prefixes whose classes become inert placeholders (their data is kept, their code never imported).
PLACEHOLDER_PREFIXES = ("megatron.", "megatron_", "transformer_engine.", "modelopt.", "nvidia_resiliency_ext.")


def _guarded_reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` limited to placeholder classes (never calls foreign ``__new__``)."""
    if isinstance(cls, type) and issubclass(cls, Placeholder):
        return cls()
    raise UnsafePickleError(f"copyreg._reconstructor called on non-allow-listed class {cls!r}")


def _base_allow_list() -> dict[tuple[str, str], Any]:
    """Plain Python types and values (no torch, no numpy)."""
    return {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "defaultdict"): collections.defaultdict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        ("builtins", "range"): range,
        ("builtins", "int"): int,
        ("builtins", "float"): float,
        ("builtins", "str"): str,
        ("builtins", "bytes"): bytes,
        ("builtins", "tuple"): tuple,
        ("builtins", "list"): list,
        ("builtins", "dict"): dict,
        ("builtins", "bool"): bool,
        ("copyreg", "_reconstructor"): _guarded_reconstructor,
        # Transformer Engine's _extra_state (FP8 metadata) is a BytesIO of torch.save bytes: an inert buffer here.
        ("_io", "BytesIO"): io.BytesIO,
        ("_codecs", "encode"): codecs.encode,
        ("signal", "Signals"): signal.Signals,
    }


_TORCH_VALUES = ("Size", "device", "layout", "strided", "contiguous_format", "preserve_format", "memory_format")


def _torch_allow_list() -> dict[tuple[str, str], Any]:
    """torch's value types and numpy's array rebuilders, as the real objects (only once torch is loaded)."""
    import torch  # deferred: torch only where tensors are made (metadata paths run without it)

    allowed: dict[tuple[str, str], Any] = {("torch", name): getattr(torch, name) for name in _TORCH_VALUES}
    for name in dtypes.NAMES:
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    try:
        import numpy  # deferred: numpy only for a pickle that holds arrays
    except Exception:  # pragma: no cover - numpy is a torch dependency in practice
        return allowed
    try:
        from numpy._core import multiarray as core_ma  # deferred: numpy only for a pickle that holds arrays
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray as core_ma  # deferred: numpy only for a pickle that holds arrays
    for mod in _NUMPY_MULTIARRAY:
        allowed[(mod, "_reconstruct")] = core_ma._reconstruct
        allowed[(mod, "scalar")] = core_ma.scalar
    allowed[("numpy", "ndarray")] = numpy.ndarray
    allowed[("numpy", "dtype")] = numpy.dtype
    for name in dir(numpy.dtypes):
        if name.endswith("DType"):
            allowed[("numpy.dtypes", name)] = getattr(numpy.dtypes, name)
    return allowed


_NUMPY_MULTIARRAY = ("numpy.core.multiarray", "numpy._core.multiarray")


def _torch_free_global(module: str, name: str) -> Any:
    """What an allow-listed torch / numpy / DCP global stands for while torch is not loaded (see
    :mod:`megatron_preflight.dtypes`): dtypes by name, ``torch.Size`` as a tuple, DCP metadata classes as
    :class:`Record` classes, the rest (devices, layouts, numpy arrays of RNG state) as inert placeholders. None for
    a name that is not allow-listed."""
    if module == "torch":
        if name in dtypes.NAMES:
            return dtypes.dtype(name)
        if name == "Size":
            return _SIZE
        if name in _TORCH_VALUES:
            return placeholder_class(module, name)
        return None
    if (module, name) in _DCP_CLASSES:
        return record_class(module, name)
    if (module in _NUMPY_MULTIARRAY and name in ("_reconstruct", "scalar")) or (
            module == "numpy" and name in ("ndarray", "dtype")) or (
            module == "numpy.dtypes" and name.endswith("DType")) or (module, name) in _DCP_VALUES:
        return placeholder_class(module, name)
    return None


# torch.Size without torch: its pickle is ``Size(tuple)`` (``Size.__reduce__``), and ``().__add__`` gives back an exact
# tuple itself, at C speed, unguarded (a .metadata makes ~10^5 of them); anything else is refused (TypeError)
_SIZE = ().__add__

_DCP = "torch.distributed.checkpoint"
# torch.distributed.checkpoint's metadata dataclasses (read as Records without torch) ...
_DCP_CLASSES = frozenset(
    [(f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                      "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta")]
    + [(f"{_DCP}.filesystem", "_StorageInfo")]
    + [(f"{_DCP}.planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem", "ReadItem")])
# ... and the enums and functions their pickles name (inert placeholders without torch)
_DCP_VALUES = frozenset([(f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"), (f"{_DCP}.planner", "WriteItemType"),
                         (f"{_DCP}.planner", "LoadItemType"), ("torch.serialization", "_get_layout")])

# path objects (DCP's StorageMeta.checkpoint_id, as Megatron-FSDP's fsdp_dtensor save pickles it): inert placeholders,
# never the real classes; the module is "pathlib._local" under Python 3.13
_PATH_CLASSES = frozenset((mod, cls) for mod in ("pathlib", "pathlib._local")
                          for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path",
                                      "PurePath"))

_ALLOWED: dict[tuple[str, str], Any] | None = None


def allowed_globals(module: str = "") -> dict[tuple[str, str], Any]:
    """The allow-list as real objects: plain Python always; torch's and numpy's once torch is loaded."""
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = _base_allow_list()
    if not torch_loaded():
        return _ALLOWED
    if ("torch", "Size") not in _ALLOWED:
        _ALLOWED.update(_torch_allow_list())
    return _ALLOWED


class SafeUnpickler(pickle.Unpickler):
    """Unpickler with an allow-list. ``overrides`` maps (module, name) to caller hooks (e.g. tensor rebuild)."""

    def __init__(
        self,
        file: io.BufferedIOBase,
        *,
        source: str,
        overrides: dict[tuple[str, str], Any] | None = None,
        persistent_load: Callable[[Any], Any] | None = None,
        trust: bool = False,
        budget: pickle_limits.CallBudget | None = None,
    ) -> None:
        super().__init__(file)
        self._budget = budget
        self._source = source
        self._overrides = overrides or {}
        self._persistent = persistent_load
        self._trust = trust

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle protocol
        if self._persistent is None:
            raise UnsafePickleError(
                "the pickle refers to external storage but none was expected", path=self._source
            )
        return self._persistent(pid)

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle protocol
        # Protocol 0-2 pickles (torch.save writes protocol 2) may name Python 2 modules: map them as pickle does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        if key in self._overrides:
            return self._overrides[key]
        allowed = allowed_globals(module)
        value = allowed.get(key)
        if value is None and module.startswith(("torch", "numpy")) and not torch_loaded():
            value = _torch_free_global(module, name)
        elif value is None and key in _DCP_CLASSES:  # Records with torch loaded too (the module docstring says why)
            value = record_class(module, name)
        elif value is None and (key in _DCP_VALUES or key in _PATH_CLASSES):
            value = placeholder_class(module, name)
        if value is not None:
            if self._budget is not None and key in _BUILDERS and value is not _SIZE:
                return self._budget.guard(f"{module}.{name}", value)
            return value
        if module.startswith(PLACEHOLDER_PREFIXES) or module in ("megatron",):
            return placeholder_class(module, name)
        if self._trust:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refused to load: the pickle references `{module}.{name}`, which is not on the allow-list of types "
            "a Megatron checkpoint contains; loading it could run code from the file",
            path=self._source,
            fix="if you trust where this checkpoint came from, rerun with --trust-checkpoint",
            code="unsafe_pickle",
        )


# Allow-listed callables whose cost grows with their argument (charged to the pickle's CallBudget); classes that
# pickles instantiate with NEWOBJ (Namespace, OrderedDict, ...) are not wrapped.
_BUILDERS = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"),
    ("builtins", "bytes"), ("builtins", "bytearray"), ("builtins", "str"), ("builtins", "range"),
    ("_codecs", "encode"), ("torch", "Size"),
})


def bounded_load(data: bytes, *, source: str, trust: bool = False,
                 check: Callable[[Any, int, str], None] = pickle_limits.check_shape, **kwargs: Any) -> Any:
    """Unpickle ``data`` with :class:`SafeUnpickler` inside the bounds of :mod:`megatron_preflight.pickle_limits`:
    the stream is scanned first, allow-listed builders are charged to a budget, and the result's shape is checked
    (by ``check``: the generic walk, or one that proves the same bound for a pickle of known shape)."""
    pickle_limits.scan(data, source)
    budget = pickle_limits.CallBudget(len(data), source)
    collecting = gc.isenabled()
    if collecting:  # building ~10^6 objects (a large .metadata) sets off collections that walk all of them again
        gc.disable()  # and again, finding nothing: all are reachable until the load (and its check) returns
    try:
        obj = SafeUnpickler(io.BytesIO(data), source=source, trust=trust, budget=budget, **kwargs).load()
        check(obj, len(data), source)
    finally:
        if collecting:
            gc.enable()
    return obj


def safe_loads(data: bytes, *, source: str, trust: bool = False, **kwargs: Any) -> Any:
    """Unpickle ``data`` with :class:`SafeUnpickler`, bounded (see :func:`bounded_load`)."""
    return bounded_load(data, source=source, trust=trust, **kwargs)
