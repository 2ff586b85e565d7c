"""Which memory a run writes, as the dispatcher sees it (during a signature's warm-up only).

Version counters miss writes made through another tensor object on the same memory (``x.data``,
a view of ``.data``, a detached alias): the copy-back of a written input, and the restoring of
parameters and buffers around extra warm-ups, would then miss them. A ``TorchDispatchMode``
sees every aten op after autograd, with its schema: each argument the schema marks as written
(in-place ops, ``out=``, ``copy_``, ``index_put_``) names the storage written, whichever tensor
object it came through. A kernel launched outside aten (a Triton or C++ kernel called directly)
is not seen here; the engine also compares copied inputs by value around the warm-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WriteWatch", "storage_of"]


def storage_of(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for an empty one, or where it has none)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class WriteWatch(TorchDispatchMode):
    """Collects the storages that aten ops write while active (``storages``: addresses)."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()

    def _note(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            ptr = storage_of(value)
            if ptr:
                self.storages.add(ptr)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._note(v)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                info = arg.alias_info
                if info is not None and info.is_write:
                    self._note(args[i] if i < len(args) else kwargs.get(arg.name))
        return func(*args, **kwargs)
