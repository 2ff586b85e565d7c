"""Copies of tensors on a graph's memory, as eager would have handed them out.

A graph's outputs live in its memory, which the next replay overwrites: what the caller gets is
a copy. ``clone()`` alone is eager's tensor only for one dense tensor without conj/neg bits: it
makes a strided view contiguous, resolves a ``conj()``, and two outputs that view one another
(``y`` and ``y[0]``) come back as two unrelated tensors. Here the bytes the tensors of one
storage reach are copied once, and each tensor is made again on that copy with its own dtype,
size, strides, offset and bits: one that is no view in eager as a tensor of its own, the views
as views of it (they alias it and share its version counter, as eager's do). Subclasses and
tensors with autograd history keep ``clone()`` (or run eagerly: see ``plan_outputs``).
"""

from __future__ import annotations

import torch

__all__ = ["copies_of", "copy_of", "span_of", "span_view", "recipes", "rebuild", "clone_keeps",
           "copyable", "overlaps"]

_ALIGN = 16  # bytes: a copy starts here, so every element size divides each view's offset


def overlaps(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (an ``expand``-ed view); gaps are fine."""
    verdict = torch._debug_has_internal_overlap(t)  # 0 no, 1 yes, 2 "too hard to tell"
    if verdict != 2:
        return verdict == 1
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz > 1)
    reach = 0  # the furthest element offset the smaller strides reach
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def clone_keeps(t: torch.Tensor) -> bool:
    """Whether ``t.clone()`` is eager's tensor: dense and non-overlapping (its strides kept),
    without conj/neg bits (resolved by a clone)."""
    if t.is_conj() or t.is_neg():
        return False
    if t.is_contiguous():
        return True
    return t.numel() == 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) \
        and not overlaps(t)


def copy_of(t: torch.Tensor, ptr: int) -> torch.Tensor:
    """A copy of ``t``, a plain strided tensor on a graph's memory (its storage at ``ptr``), as
    eager has it: its clone where that keeps it, else made again on a copy of its bytes."""
    return t.clone() if clone_keeps(t) else copies_of([t], {ptr})[0]


def span_of(ts: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of their one storage that non-empty tensors ``ts`` reach, ``lo``
    aligned down to :data:`_ALIGN`."""
    lo = min(t.storage_offset() * t.element_size() for t in ts)
    hi = max((t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1)
             * t.element_size() for t in ts)
    return lo - lo % _ALIGN, hi


def span_view(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes ``[lo, hi)`` of ``t``'s storage, as a one-dimensional uint8 tensor on them."""
    with torch.no_grad():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage(), lo, (hi - lo,), (1,))


def recipes(ts: list[torch.Tensor], lo: int) -> list[tuple]:
    """What :func:`rebuild` needs of non-empty tensors ``ts`` of one storage, whose bytes are
    copied from ``lo``: for each, its element size, dtype, size, strides, offset (in its
    elements), conj/neg bits, and how it is made: 0 a tensor of its own on the copy (it is no
    view in eager), 1 a view of the first of those (whose version counter eager's views
    share), 2 a view of the copy's bytes (no such tensor, or no view of it has this dtype)."""
    base = next((t for t in ts if not t._is_view()), None)
    out = []
    for t in ts:
        size = t.element_size()
        if t is base or not t._is_view():
            how = 0
        else:
            how = 2
            if base is not None:
                try:
                    base.view(t.dtype)
                    how = 1
                except RuntimeError:  # (another element size, and base's last dim strided)
                    pass
        out.append((size, t.dtype, t.size(), t.stride(), (t.storage_offset() * size - lo) // size,
                    t.is_conj(), t.is_neg(), how))
    return out


def copyable(t: torch.Tensor) -> bool:
    """Whether a copy of ``t`` made here is eager's tensor: a plain tensor (a subclass comes
    back through its own ``clone()``, which keeps its type) without autograd history (a clone
    keeps it, a copy of bytes would not)."""
    return type(t) is torch.Tensor and not t.requires_grad


def rebuild(mem: torch.Tensor, hows: list[tuple]) -> list[torch.Tensor]:
    """The tensors of :func:`recipes` ``hows`` on ``mem`` (the bytes copied, uint8), with
    their dtypes, sizes, strides and conj/neg bits, as eager has them: the ones that are no
    view there are tensors of their own on that memory, the views are views of the first of
    those (sharing its version counter, as eager's do), or of ``mem``."""
    out: list = [None] * len(hows)
    base = storage = None
    for j, (size, dtype, shape, stride, offset, conj, neg, how) in enumerate(hows):
        if how == 0:
            if storage is None:
                storage = mem.untyped_storage()
            t = torch.empty(0, dtype=dtype, device=mem.device).set_(storage, offset, shape,
                                                                    stride)
            if conj:
                torch._C._set_conj(t, True)
            if neg:
                torch._C._set_neg(t, True)
            out[j] = t
            if base is None:
                base = t
    for j, (size, dtype, shape, stride, offset, conj, neg, how) in enumerate(hows):
        if how:
            src = (base if base.dtype == dtype else base.view(dtype)) if how == 1 \
                else mem[:mem.numel() // size * size].view(dtype)
            v = src.as_strided(shape, stride, offset)
            if conj:  # (the memory holds the values under the bit: flipped back on, a view)
                v = v.conj()
            if neg:
                v = torch._neg_view(v)
            out[j] = v
    return out


def copies_of(leaves: list, ptrs: set[int]) -> list:
    """``leaves`` with the tensors on memory at ``ptrs`` (graph memory) replaced by copies, as
    eager's would be: a tensor met twice is copied once; tensors on one storage are made again
    on one copy of the bytes they reach (:func:`rebuild`)."""
    on: dict[int, list[int]] = {}  # storage address -> the leaves on it
    for k, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.layout is torch.strided:
            ptr = t.untyped_storage().data_ptr()
            if ptr in ptrs:
                on.setdefault(ptr, []).append(k)
    out = list(leaves)
    for ks in on.values():
        ts = list({id(leaves[k]): leaves[k] for k in ks}.values())  # (each tensor once)
        made: dict[int, torch.Tensor] = {}
        reach = [t for t in ts if t.numel()]
        if len(ts) == 1 and (not reach or clone_keeps(ts[0])) \
                or not all(copyable(t) for t in ts):
            for t in ts:
                made[id(t)] = t.clone()
        else:
            lo, hi = span_of(reach)
            mem = span_view(reach[0], lo, hi).clone()
            for t, c in zip(reach, rebuild(mem, recipes(reach, lo))):
                made[id(t)] = c
            for t in ts:
                if not t.numel():
                    made[id(t)] = t.clone()
        for k in ks:
            out[k] = made[id(leaves[k])]
    return out
