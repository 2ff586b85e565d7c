"""A signature's first call, phase 3 (see :mod:`._first_call`), before its capture: the extra
warm-ups, runs of the forward beyond the real call (``num_warmup_iters``; in training, one for the
backward at least). They run on copies of the inputs; what they write in memory the user sees is
put back afterwards, so only the real call's effect remains."""

from __future__ import annotations

import torch

from . import _writes
from ._nested import Nested
from ._replay import StaticInputs
from ._signature import storage_of, unflatten_call
from ._training import saved_by_backward, warmup_backward
from ._watch import Recorder, recording

__all__ = ["extra_warmups", "version_of"]


def extra_warmups(first) -> None:
    """Warm-up runs beyond the real call: on copies of the inputs; what the real call
    wrote in parameters and buffers is restored after them, and the tensors it reads from
    outside, so only its effect remains."""
    n = first.state.options.num_warmup_iters - 1
    if first.training:
        n = max(n, 1)  # the backward needs a warm-up of its own
    if n == 0:
        return
    written = [first.watchable[j] for j in first.wrote_statics]
    with torch.no_grad():
        saved = [t.clone() for t in written]
    rec = Recorder()
    try:
        # (the tensors it reads from outside, put back before the capture too: ``verify``
        # compares a small CPU one by value; around the whole capture: see ``capture``)
        with _writes.kept(first._left(), first.held_tensors()), recording(rec):
            for _ in range(n):
                _warm_up_again(first)
    finally:  # a failed extra run leaves no trace in the buffers either
        first._put_back(rec)  # (nor in module attributes: ``self.n += 1``)
        with torch.no_grad():
            for t, v in zip(written, saved):
                # through .data: the real call's autograd graph saved these buffers
                # (BatchNorm's backward takes its running statistics) and checks versions
                t.data.copy_(v)


def _warm_up_again(first) -> None:
    """One extra warm-up, on copies of the inputs (in training, with its backward)."""
    statics, leaves, fn = first.statics, first.leaves, first.fn
    copies = StaticInputs(leaves, [False] * len(leaves))
    for i, buf in copies.copy:
        buf.requires_grad_(first.training and leaves[i].requires_grad)
    a, kw = unflatten_call(copies.leaves, first.sig)
    with Nested():
        if first.training:
            wrt = statics.grad_params() + [b for _, b in copies.copy]
            with saved_by_backward() as packed:
                first.backend.warmup(lambda: warmup_backward(
                    lambda: fn(*a, **kw), wrt, statics.stand_ins), first.device)
            first.saved = _saved_indices(packed, copies, first.tensor_idx, statics)
            storages = {storage_of(t) for t in packed} - {0}
            # (and the tensors read from outside it saves, plain attributes: their versions
            # are checked at backward as a buffer's are)
            first.saved_statics = [t for t in (*statics.tensors, *first.held_tensors())
                                   if not t.requires_grad and storage_of(t) in storages
                                   and version_of(t) is not None]
        else:
            first.backend.warmup(lambda: fn(*a, **kw), first.device)


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or None where it has none (an inference tensor, a wrapper subclass)."""
    try:
        return None if t.is_inference() else t._version
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _saved_indices(packed: list[torch.Tensor], copies: StaticInputs, tensor_idx: list[int],
                   statics) -> set[int]:
    """Which tensors of a graphed training call autograd saves for backward (by storage):
    positions among the autograd Function's inputs (the user's tensors, then the parameters
    that require grad)."""
    storages = {storage_of(t) for t in packed} - {0}
    out = set()
    by_leaf = dict(copies.copy)
    for pos, i in enumerate(tensor_idx):
        buf = by_leaf.get(i)
        if buf is not None and storage_of(buf) in storages:
            out.add(pos)
    n = len(tensor_idx)
    for k, p in enumerate(statics.grad_params()):
        if storage_of(p) in storages:
            out.add(n + k)
    return out
