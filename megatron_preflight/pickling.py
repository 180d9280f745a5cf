"""Write pickles that name Megatron's classes again: placeholders are saved as the globals they stand for.

Used by ``torch.save(..., pickle_module=placeholder_pickle)`` when writing resharded checkpoints, so Megatron (which
has those classes) loads the args exactly as it saved them, while megatron-preflight never imported them.
"""

from __future__ import annotations

import pickle
from typing import Any

from megatron_preflight.placeholders import Placeholder


class Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be extended
    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Placeholder) and obj is not Placeholder:
            module, qualname = obj._module, obj._name
            if self.proto >= 4:
                self.save(module)
                self.save(qualname)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)



Unpickler = pickle.Unpickler
load = pickle.load
dump = pickle.dump
loads = pickle.loads
dumps = pickle.dumps
