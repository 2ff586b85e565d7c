"""A signature's first call, phase 3 (see :mod:`._first_call`), before its capture: the extra
warm-ups, runs of the forward beyond the real call (``num_warmup_iters``; in training, one for the
backward at least). They run on copies of the inputs; what they write in memory the user sees is
put back afterwards, so only the real call's effect remains."""

from __future__ import annotations

import torch

from . import _writes
from ._nested import Nested
from ._piecewise import probed, write_tracker
from ._replay import StaticInputs
from ._signature import storage_of, unflatten_call
from ._training import saved_by_backward, warmup_backward
from ._versions import sharing
from ._watch import Recorder, recording

__all__ = ["extra_runs", "extra_warmups", "version_of"]


def extra_runs(first) -> int:
    """How many extra warm-ups ``first`` makes: none where objects are passed as they are."""
    if first.opaque:
        return 0
    n = first.state.options.num_warmup_iters - 1
    if first.training:
        n = max(n, 1)  # the backward needs a warm-up of its own
    return n


def extra_warmups(first) -> str:
    """Warm-up runs beyond the real call, on copies of the inputs. Afterwards what the user sees
    is what the real call left, whatever they wrote: the parameters and buffers (values,
    layouts, versions), the tensors the forward reads from outside or bound to attributes, and
    other memory from before the call (a global only a later path writes). Returns why a write
    could not be put back ("" where all was)."""
    n = extra_runs(first)
    if n == 0:
        return ""
    written = [first.watchable[j] for j in first.wrote_statics]
    with torch.no_grad():
        saved = [t.clone() for t in written]
    held = first.held_tensors()
    # Memory from before the call that they write, copied before its first write in them
    # (``Probe.saved``): a buffer written by later calls only; the whole storage of a static
    # copied above too (another part of it, a global's view, may be written by later calls
    # only). Not what ``_writes.kept`` puts back.
    copies = dict.fromkeys(first.kept_storages())
    versions: dict = {}  # (and the versions of the tensors written through)
    seen: dict = {}  # (and the layouts of the tensors from before the call its ops take)
    before = [(t, version_of(t), storage_of(t)) for t in first.watchable]
    unseen = ""
    rec = Recorder()
    try:
        # (the parameters' and buffers' layouts and versions: ``self.log.set_(...)``, which no
        # probe sees, and an in-place write moves the version a saved tensor is checked by)
        with _writes.layouts_kept(first.statics.tensors):
            try:
                # (the tensors it reads from outside, put back before the capture too:
                # ``verify`` compares a small CPU one by value; around the whole capture: see
                # ``capture``)
                with _writes.kept(first._left(), held), recording(rec), \
                        _writes.rng_kept(first.device):
                    for _ in range(n):
                        _warm_up_again(first, copies, versions, seen)
            finally:  # (before their versions are put back; the runs' swaps swapped back)
                _writes.unswap()
                unseen = _unseen_writes(first, before, copies, written)
    finally:  # a failed extra run leaves no trace in the buffers either
        first._put_back(rec)  # (nor in module attributes: ``self.n += 1``)
        _writes.put_storages_back(copies)
        _writes.put_versions_back(versions)
        _writes.put_seen_back(seen)  # (a global's ``set_``: after the versions, it moves them)
        with torch.no_grad():
            for t, v in zip(written, saved):
                # through .data: the real call's autograd graph saved these buffers
                # (BatchNorm's backward takes its running statistics) and checks versions
                t.data.copy_(v)
            for t, v in first.by_value:  # (no probe: the buffers' copies from the real call)
                if not _writes.same_values(t, v):
                    t.data.copy_(v)
        first.by_value = []
    return unseen


def _unseen_writes(first, before: list, copies: dict, written: list) -> str:
    """Why a parameter or buffer the extra warm-ups wrote cannot be put back: its version moved
    (its layout as it was) and no copy of it was taken (no probe saw the write: ``probe=False``
    for a parameter, a C++ extension's in-place op). "" where none."""
    # (``written``: the statics the real call wrote, put back from their copies)
    covered = set(copies) | {storage_of(t) for t, _ in first.by_value} | \
        {storage_of(t) for t in written}
    for t, version, ptr in before:
        if version is not None and ptr not in covered and version_of(t) != version \
                and storage_of(t) == ptr:
            return (f"an extra warm-up wrote {_name_of(first, t)} in place, which the real "
                    "call did not write, where no probe saw the write (probe=False, or a call "
                    "outside torch's Python API): it could not be put back and keeps that "
                    "run's write; num_warmup_iters=1 (in inference) makes no extra warm-up")
    return ""


def _name_of(first, t: torch.Tensor) -> str:
    """How a message names parameter or buffer ``t``: ``parameter 'lin.weight'``."""
    root = first.statics.root
    paths = {id(m): p for p, m in root.named_modules()} if root is not None else {}
    for m in first.statics.modules:
        for kind, d in (("parameter", m._parameters), ("buffer", m._buffers)):
            for name, v in d.items():
                if v is t:
                    path = paths.get(id(m))
                    where = f"{path}.{name}" if path else name if path is not None \
                        else f"{type(m).__name__}.{name}"
                    return f"{kind} {where!r}"
    return f"a {tuple(t.shape)} parameter or buffer"


def _warm_up_again(first, saved: dict, versions: dict, seen: dict) -> None:
    """One extra warm-up, on copies of the inputs (in training, with its backward), under a
    probe that copies memory from before the call into ``saved`` before its first write (and
    the versions of the tensors written through into ``versions``, the layouts of those its
    ops take into ``seen``)."""
    statics, leaves, fn = first.statics, first.leaves, first.fn
    copies = StaticInputs(leaves, [False] * len(leaves))
    for i, buf in copies.copy:  # (as the capture's copies: see StaticInputs)
        buf.requires_grad_(leaves[i].requires_grad
                           and (first.training or not torch.is_grad_enabled()))
    a, kw = unflatten_call(copies.leaves, first.sig)
    tracker = write_tracker(first.state, {storage_of(b) for _, b in copies.copy}, saved,
                            versions, statics.weight_ptrs(), seen)
    with Nested():
        if first.training:
            wrt = statics.grad_params() + [b for _, b in copies.copy]
            with saved_by_backward() as packed:
                first.backend.warmup(probed(tracker, lambda: warmup_backward(
                    lambda: fn(*a, **kw), wrt, statics.stand_ins)), first.device)
            first.saved = _saved_indices(packed, copies, first.tensor_idx, statics)
            # (and the tensors read from outside it saves, plain attributes: their versions
            # are checked at backward as a buffer's are; those whose counter a saved tensor
            # shares, as eager's check reads it: a buffer registered as a view of another's
            # ``.data`` has a counter of its own)
            first.saved_statics = sharing(
                [t for t in (*statics.tensors, *first.held_tensors())
                 if not t.requires_grad and version_of(t) is not None],
                [t for t in packed if version_of(t) is not None])
        else:
            first.backend.warmup(probed(tracker, lambda: fn(*a, **kw)), first.device)


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
