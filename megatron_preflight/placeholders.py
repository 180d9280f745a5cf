"""Inert stand-ins for classes a checkpoint's pickle names but that are never imported: Megatron's own classes
(:class:`Opaque`, its arguments and state kept as data) and torch.distributed.checkpoint's metadata dataclasses
(:class:`Record`, fields as attributes, hashable by value)."""

from __future__ import annotations

import copyreg
from collections.abc import Hashable
from typing import Any


class Placeholder:
    """Inert stand-in for a class that is referenced by a pickle but deliberately not imported (the base of both kinds:
    :class:`Opaque` for Megatron's own classes, :class:`Record` for DCP's metadata dataclasses).

    Holds the constructor arguments (enums: ``Cls(value)``) and any state set by ``BUILD``.
    """

    _module = "?"
    _name = "?"
    # defaults, set on the instance only when they differ (a torch_dist .metadata builds ~2*10^5 of these)
    _new_args: tuple[Any, ...] = ()
    _args: tuple[Any, ...] = ()
    _kwargs: dict[str, Any] = {}  # never mutated: __init__ replaces it
    _state: Any = None
    _called = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE: cls(*args)
        self._args = args
        self._kwargs = kwargs
        self._called = True

    def __reduce__(self) -> Any:
        """Pickle back as the original class (see :mod:`megatron_preflight.pickling`)."""
        if self._called:
            return (type(self), self._args) if self._state is None else (type(self), self._args, self._state)
        return (copyreg.__newobj__, (type(self), *self._new_args), self._state)

    @property
    def value(self) -> Any:
        """The enum value, for enum-like placeholders (``Cls(value)``)."""
        return self._args[0] if len(self._args) == 1 else None

    def describe(self) -> str:
        if len(self._args) == 1 and self._state is None:
            return f"{self._name}({self._args[0]!r})"
        if self._state is not None and not self._args:
            return f"{self._name}({self._state!r})"
        return f"{self._name}{self._args!r}"

    def __repr__(self) -> str:
        return f"<{self._module}.{self.describe()}>"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placeholder)
            and (self._module, self._name, self._args, self._state)
            == (other._module, other._name, other._args, other._state)
        )

    def __hash__(self) -> int:
        return hash((self._module, self._name, repr(self._args)))


class Opaque(Placeholder):
    """A class of Megatron's (or TE's, ModelOpt's...): ``NEWOBJ`` arguments and ``BUILD`` state kept as data."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        obj = super().__new__(cls)
        if args:
            obj._new_args = args  # NEWOBJ: cls.__new__(cls, *args), no __init__
        return obj

    def __setstate__(self, state: Any) -> None:
        self._state = state


_placeholder_classes: dict[tuple[str, str], type] = {}


def placeholder_class(module: str, name: str) -> type:
    """The (cached) placeholder class standing for ``module.name``."""
    key = (module, name)
    if key not in _placeholder_classes:
        _placeholder_classes[key] = type(name, (Opaque,), {"_module": module, "_name": name})
    return _placeholder_classes[key]


class Record(Placeholder):
    """Inert stand-in for one of torch.distributed.checkpoint's metadata dataclasses: its fields are attributes, and
    it hashes by value (``MetadataIndex`` keys a dict).

    No ``__new__`` or ``__setstate__`` of its own: the C unpickler makes the instance and puts a dataclass's field
    dict (or ``(dict, slots)`` pair) straight into its ``__dict__`` (a torch_dist ``.metadata`` holds ~10^5 records;
    a Python call per record was most of its reading time). Any other state is refused by the unpickler as corrupt.
    """

    @property  # type: ignore[override]
    def _state(self) -> dict[str, Any]:
        return self.__dict__

    def __hash__(self) -> int:
        state = self.__dict__
        fqn = state.get("fqn")
        if type(fqn) is str:  # MetadataIndex (what keys storage_data): equal records have equal fqn and offset
            try:
                return hash((self._name, fqn, state.get("offset")))
            except TypeError:
                return hash((self._name, fqn))
        try:  # fields in any order, as dict equality has them
            return hash((self._name, frozenset(state.items())))
        except TypeError:  # an unhashable field value: hash by the others (equal records still hash equal)
            return hash((self._name, frozenset((k, v) for k, v in state.items() if isinstance(v, Hashable))))


class _TensorProperties(Record):
    """DCP's ``TensorProperties``: torch pickles it as a 5-tuple (dtype, layout, requires_grad, memory_format,
    pin_memory), older torch as its field dict."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})
        elif isinstance(state, tuple) and len(state) == 5:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


def record_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _record_classes:
        base = _TensorProperties if name == "TensorProperties" else Record
        _record_classes[key] = type(name, (base,), {"_module": module, "_name": name})
    return _record_classes[key]


_record_classes: dict[tuple[str, str], type] = {}
