"""Which tensors a run wrote: version counters, and copies where counters cannot tell.

A warm-up's writes decide what a graph must copy back (inputs) and what the extra warm-ups must
restore (parameters and buffers). Version counters miss writes made without bumping them
(BatchNorm's running statistics, inference tensors), so those are compared by value; the probe
adds the writes made through other tensor objects on the same memory (see :mod:`._probe`).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["marks", "written", "same_values", "inputs_alias", "undone", "versions_kept"]


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
    """Inside the block ``tensors`` may be written; afterwards each holds what it held before,
    and has the version it had. For the runs beyond the real call (extra warm-ups, a
    rehearsal, the capture) over tensors a forward reads from outside its arguments,
    parameters and buffers (plain tensor attributes, closures, globals): only the real call's
    writes remain. Copied and put back by storage, bytes for bytes (a write through ``.data``
    or by a kernel outside torch's Python API moves no version counter; a view, an expanded
    one included, is put back with the memory it views; of a storage, the bytes from the first
    its tensors view to the last, not more); tensors without memory of their own
    (meta, sparse, wrapper subclasses: a guard refuses the last two) are left alone."""
    spans: dict[int, list] = {}  # storage address -> [storage, first byte, end]
    for t in tensors:
        if t.layout is not torch.strided or t.device.type == "meta" or not t.numel():
            continue
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # (a wrapper tensor subclass: a guard refuses it, see _no_address)
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size
        span = spans.get(ptr)
        if span is None:
            spans[ptr] = [st, lo, hi]
        else:
            span[1], span[2] = min(span[1], lo), max(span[2], hi)
    saved = []
    with torch.no_grad():
        for st, lo, hi in spans.values():
            # (only the bytes the tensors view: a view of a large cache copies its own part)
            hi = min(hi, st.nbytes())
            view = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, lo, (hi - lo,),
                                                                            (1,))
            saved.append((view, view.clone()))
    try:
        with versions_kept([t for t in tensors if t.layout is torch.strided]):
            yield
    finally:
        with torch.no_grad():
            for view, copy in saved:
                view.copy_(copy)


@contextlib.contextmanager
def versions_kept(tensors: list[torch.Tensor]):
    """Afterwards each of ``tensors`` has the version counter it had before the block, for a
    block that leaves their values as it found them (runs beyond the real call, whose writes
    are undone, and a capture, which runs no kernel): the real call's autograd graph checks
    the versions of the tensors it saved (``self.lin(x) * self.acc``, ``acc`` written in place
    by forward), and would refuse a backward that eager's runs."""
    versions = [None if t.is_inference() else t._version for t in tensors]
    try:
        yield
    finally:
        for t, version in zip(tensors, versions):
            if version is not None and t._version != version:
                _set_version(t, version)


def _set_version(t: torch.Tensor, version: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # (an older torch: one tensor and one version)
        torch._C._autograd._unsafe_set_version_counter(t, version)
