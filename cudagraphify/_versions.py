"""The version counters autograd checks at backward, found by moving them.

Tensors over one memory may share a version counter (a view shares its base's, a ``detach()``
the original's) or not (a ``.data`` has a counter of its own, and so has every view of it).
Which do is found by moving one counter and looking at the others, then putting it back:
cheap, first calls only, and exact where comparing storages is not.
"""

from __future__ import annotations

import torch

from ._signature import storage_of
from ._writes import set_version

__all__ = ["sharing"]

# (torch.autograd.graph.increment_version's own call: a tuple, each tensor moved once per time
# it is in it)
_increment_version = torch._C._increment_version

def sharing(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``tensors`` whose version counter one of ``others`` shares (the buffers whose
    versions autograd checks for the tensors it saved: the buffer itself, a view of it, a
    ``detach()``; not a ``.data``, which has a counter of its own)."""
    by_storage = _by_storage(others)
    out = []
    for t in tensors:
        same = by_storage.get(storage_of(t))
        if same is not None and any(_move_with(t, [others[j] for j in same])):
            out.append(t)
    return out


def _by_storage(tensors: list[torch.Tensor]) -> dict[int, list[int]]:
    """Positions of ``tensors`` by storage: only tensors over one storage can share a counter
    (a view, a ``detach()``). (Empty ones, and those with no storage of their own, are left
    out.)"""
    out: dict[int, list[int]] = {}
    for k, t in enumerate(tensors):
        ptr = storage_of(t)
        if ptr:
            out.setdefault(ptr, []).append(k)
    return out


def _move_with(t: torch.Tensor, others: list[torch.Tensor]) -> list[bool]:
    """Whether each of ``others`` shares ``t``'s version counter: ``t``'s is moved, those whose
    version moved with it share it; then it is put back."""
    before, seen = t._version, [o._version for o in others]
    _increment_version((t,))
    try:
        return [o._version != v for o, v in zip(others, seen)]
    finally:
        set_version(t, before)
