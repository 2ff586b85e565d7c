"""Which tensors a run wrote: version counters, and copies where counters cannot tell.

A warm-up's writes decide what a graph must copy back (inputs) and what the extra warm-ups must
restore (parameters and buffers). Version counters miss writes made without bumping them
(BatchNorm's running statistics, inference tensors), so those are compared by value; the probe
adds the writes made through other tensor objects on the same memory (see :mod:`._probe`).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["marks", "written", "same_values", "inputs_alias", "undone"]


def marks(tensors: list[torch.Tensor], by_value: list[bool] | None = None) -> list:
    """What tells, after a call, whether it wrote each tensor: its version counter, or a copy
    of its contents for inference tensors (they have no counter) and where ``by_value`` says so
    (buffers: BatchNorm's kernels update running statistics without bumping the counter)."""
    flags = by_value if by_value is not None else [False] * len(tensors)
    return [t.clone() if v or t.is_inference() else t._version for t, v in zip(tensors, flags)]


def written(tensors: list[torch.Tensor], marks: list) -> list[int]:
    return [j for j, (t, m) in enumerate(zip(tensors, marks))
            if (not same_values(t, m) if isinstance(m, torch.Tensor) else t._version != m)]


def same_values(t: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether ``t`` holds what a copy made earlier holds (NaN equals NaN here)."""
    if t.shape != before.shape or t.dtype != before.dtype:
        return False
    if torch.equal(t, before):
        return True
    if t.is_floating_point() or t.is_complex():
        return bool(((t == before) | (t.isnan() & before.isnan())).all())
    return False


def inputs_alias(leaves) -> bool:
    """Whether two non-empty tensor leaves share memory."""
    ptrs = [x.untyped_storage().data_ptr() for x in leaves
            if isinstance(x, torch.Tensor) and x.numel()]
    return len(set(ptrs)) != len(ptrs)


@contextlib.contextmanager
def undone(tensors: list[torch.Tensor]):
    """Inside the block ``tensors`` may be written; afterwards each holds what it held before
    (compared by value: a write through ``.data`` or a kernel launched outside torch's Python
    API moves no version counter). For the runs beyond the real call (extra warm-ups, a
    rehearsal) over tensors a forward reads from outside its arguments, parameters and buffers
    (plain tensor attributes, closures, globals): only the real call's writes remain."""
    with torch.no_grad():
        saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, v in zip(tensors, saved):
                if not same_values(t, v):
                    t.data.copy_(v)  # (through .data: see _capturing's restore of statics)
