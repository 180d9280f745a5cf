"""Load, change and re-save a real fixture's ``model_optim_rng.pt`` in tests (to damage a copy of it).

The fixtures' args name Megatron-LM classes that the installed megatron-core may lack, so they load with those
classes as inert placeholders and are saved back under their original names (:mod:`megatron_preflight.pickling`).
"""

from __future__ import annotations

import os
import pickle
import types
from typing import Any

import torch

from megatron_preflight import pickling
from megatron_preflight.placeholders import placeholder_class
from megatron_preflight.safe_pickle import PLACEHOLDER_PREFIXES


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(PLACEHOLDER_PREFIXES):
            return placeholder_class(module, name)
        return super().find_class(module, name)


_module = types.ModuleType("fixture_pickle")
_module.Unpickler = _Unpickler
_module.load = pickle.load


def load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_module)  # our own fixtures


def save(state: dict, path: str) -> None:
    torch.save(state, path, pickle_module=pickling)


def drop_from_dcp_metadata(iter_dir: str, suffix: str) -> list[str]:
    """Remove every tensor whose key ends with ``suffix`` from a torch_dist ``.metadata`` (its entries and their
    storage index), as a checkpoint that lost them would look; returns the keys removed."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(iter_dir).read_metadata()
    gone = [k for k in md.state_dict_metadata if k.endswith(suffix)]
    for k in gone:
        del md.state_dict_metadata[k]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn not in gone}
    with open(os.path.join(iter_dir, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)
    return gone
