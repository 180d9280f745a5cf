"""Write pickles that name Megatron's (and torch's) classes again: placeholders are saved as the globals they stand
for, and so are torch dtypes read without torch (:class:`~megatron_preflight.dtypes.DType`: ``torch.bfloat16``).

Used when writing resharded checkpoints, so Megatron (which has those classes) loads the args exactly as it saved
them, while megatron-preflight never imported them (nor, for a legacy output, torch itself).
"""

from __future__ import annotations

import pickle
from typing import Any

from megatron_preflight.dtypes import DType
from megatron_preflight.placeholders import Placeholder

_ONE_PER_NAME: dict[str, DType] = {}


class Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be extended
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj) is DType:  # a torch dtype read without torch: the global it stands for (one per name, as
            obj = _ONE_PER_NAME.setdefault(obj.name, obj)  # torch's dtypes are: each written once, then recalled)
            if id(obj) in self.memo:
                self.write(self.get(self.memo[id(obj)][0]))
                return
            self._named_global(obj, "torch", obj.name)
            return
        super().save(obj, save_persistent_id)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Placeholder) and obj is not Placeholder:
            self._named_global(obj, obj._module, obj._name)
            return
        super().save_global(obj, name)

    def _named_global(self, obj: Any, module: str, qualname: str) -> None:
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
        self.memoize(obj)



Unpickler = pickle.Unpickler
load = pickle.load
dump = pickle.dump
loads = pickle.loads
dumps = pickle.dumps
