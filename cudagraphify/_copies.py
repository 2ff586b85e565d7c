"""Copies of tensors on a graph's memory, as eager would have handed them out.

A graph's outputs live in its memory, which the next replay overwrites: what the caller gets is
a copy. ``clone()`` alone is eager's tensor only for one dense tensor without conj/neg bits: it
makes a strided view contiguous, resolves a ``conj()``, and two outputs that view one another
(``y`` and ``y[0]``) come back as two unrelated tensors. Here the bytes the tensors of one
storage reach are copied once, and each tensor is made again as a view of that copy with its
own dtype, size, strides, offset and bits: the copies alias one another as eager's outputs do,
and share one version counter, as views of one tensor do.
"""

from __future__ import annotations

import torch

__all__ = ["copies_of", "span_of", "span_view", "recipe", "rebuild", "clone_keeps"]

_ALIGN = 16  # bytes: a copy starts here, so every element size divides each view's offset


def clone_keeps(t: torch.Tensor) -> bool:
    """Whether ``t.clone()`` is eager's tensor: dense and non-overlapping (its strides kept),
    without conj/neg bits (resolved by a clone)."""
    if t.is_conj() or t.is_neg():
        return False
    if t.is_contiguous():
        return True
    return torch._debug_has_internal_overlap(t) == 0 and t.numel() == 1 + sum(
        (n - 1) * s for n, s in zip(t.shape, t.stride()))


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


def recipe(t: torch.Tensor, lo: int) -> tuple:
    """What :func:`rebuild` needs of ``t`` (its storage's bytes copied from ``lo``)."""
    size = t.element_size()
    return (size, t.dtype, t.size(), t.stride(), (t.storage_offset() * size - lo) // size,
            t.is_conj(), t.is_neg())


def rebuild(mem: torch.Tensor, how: tuple) -> torch.Tensor:
    """A tensor of :func:`recipe` ``how`` as a view of ``mem`` (the bytes copied, uint8): its
    dtype, size, strides and conj/neg bits."""
    size, dtype, shape, stride, offset, conj, neg = how
    v = mem[:mem.numel() // size * size].view(dtype).as_strided(shape, stride, offset)
    if conj:  # (the memory holds the values under the bit: flipped back on, a view)
        v = v.conj()
    if neg:
        v = torch._neg_view(v)
    return v


def copies_of(leaves: list, ptrs: set[int]) -> list:
    """``leaves`` with the tensors on memory at ``ptrs`` (graph memory) replaced by copies, as
    eager's would be: a tensor met twice is copied once; tensors on one storage are views of
    one copy of the bytes they reach, each with its own layout and bits."""
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
        if len(ts) == 1 and (ts[0].numel() == 0 or clone_keeps(ts[0])) \
                or any(t.requires_grad for t in ts):
            for t in ts:  # (a clone keeps a tensor's autograd history, a copy of bytes not)
                made[id(t)] = t.clone()
        else:
            reach = [t for t in ts if t.numel()]
            lo, hi = span_of(reach) if reach else (0, 0)
            mem = span_view(ts[0], lo, hi).clone()
            for t in ts:
                made[id(t)] = rebuild(mem, recipe(t, lo)) if t.numel() else t.clone()
        for k in ks:
            out[k] = made[id(leaves[k])]
    return out
