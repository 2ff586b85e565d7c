"""Which tensors a run wrote: version counters, and copies where counters cannot tell.

A warm-up's writes decide what a graph must copy back (inputs) and what the extra warm-ups must
restore (parameters and buffers). Version counters miss writes made without bumping them
(BatchNorm's running statistics, inference tensors), so those are compared by value; the probe
adds the writes made through other tensor objects on the same memory (see :mod:`._probe`).
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import dataclasses
import threading

import torch

from ._errors import CudagraphifyError
from ._state import tensors_in

__all__ = ["marks", "written", "same_values", "inputs_alias", "undone", "kept", "contents",
           "differ", "put_back", "refill", "slot_names", "versions_kept", "layout",
           "layouts_of", "put_layouts_back", "layouts_kept", "put_storages_back",
           "put_versions_back", "put_seen_back", "set_version"]


# -- tensors swapped by torch.utils.swap_tensors on a run beyond the real call ------------------
# (see _hooks.HookWatch, whose blocking watches open and close these logs): per thread, a stack
# of logs, the innermost noted. A swap changes which contents the caller's Python objects hold,
# so every put-back below first swaps back this thread's innermost log's pairs, last first: it
# then puts back what the real call left in the objects the caller holds, not in what a run
# swapped in (a version, a layout, bytes through ``.data``)

_swap_impl = getattr(torch._C, "_swap_tensor_impl", None)  # (the original: a watch patches it)
_swap_logs: dict[int, list["SwapLog"]] = {}


class SwapLog:
    """The pairs swapped on one thread while a blocking watch runs: ``pending`` (not swapped
    back yet) and ``seen`` (every pair, for the watch's verdict)."""

    __slots__ = ("thread", "pending", "seen")

    def __init__(self):
        self.thread = threading.get_ident()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen: list[tuple] = []  # (shape of the first tensor swapped, each swap)


def open_swap_log() -> SwapLog:
    log = SwapLog()
    _swap_logs.setdefault(log.thread, []).append(log)
    return log


def close_swap_log(log: SwapLog) -> None:
    """Swap back what ``log`` holds, and forget it."""
    try:
        _swap_back(log)
    finally:
        stack = _swap_logs.get(log.thread, [])
        if log in stack:
            stack.remove(log)
        if not stack:
            _swap_logs.pop(log.thread, None)


_swap_counts = threading.local()  # (``n``: the swaps noted on this thread, logged or not)


def swaps_made() -> int:
    """How many swaps were noted on this thread so far (while any hook watch was active)."""
    return getattr(_swap_counts, "n", 0)


def note_swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(t1, t2)`` ran on this thread: counted, and noted in its
    innermost log."""
    _swap_counts.n = getattr(_swap_counts, "n", 0) + 1
    stack = _swap_logs.get(threading.get_ident())
    if stack:
        log = stack[-1]
        log.pending.append((t1, t2))
        log.seen.append(tuple(t1.shape))


def holder(t: torch.Tensor) -> torch.Tensor:
    """The object that holds ``t``'s contents once this thread's pending swaps are swapped back
    (``t`` itself where none names it): what a record taken on ``t`` now (its version, its
    layout) is to be put back on."""
    stack = _swap_logs.get(threading.get_ident()) if _swap_logs else None
    if stack:
        for a, b in reversed(stack[-1].pending):
            if t is a:
                t = b
            elif t is b:
                t = a
    return t


def unswap() -> None:
    """Swap back the pairs of this thread's innermost log (the runs' swaps so far)."""
    stack = _swap_logs.get(threading.get_ident()) if _swap_logs else None
    if stack:
        _swap_back(stack[-1])


def _swap_back(log: SwapLog) -> None:
    failed = None
    while log.pending:
        t1, t2 = log.pending.pop()
        try:
            _unswap(t1, t2)
        except Exception as e:  # noqa: BLE001 - the others are swapped back all the same
            failed = failed or e
    if failed is not None:
        raise CudagraphifyError(
            "a tensor the forward swapped (torch.utils.swap_tensors) on a run beyond its first "
            f"could not be swapped back: {type(failed).__name__}: {failed}") from failed


def _unswap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Swap back what ``torch.utils.swap_tensors(t1, t2)`` swapped: its steps (types,
    ``__dict__``, slots, the tensors' contents), without its checks (which ask that no autograd
    graph of the run holds them: one may still, and the swap undone is the run's)."""
    def swap_attr(name):
        tmp = getattr(t1, name)
        setattr(t1, name, getattr(t2, name))
        setattr(t2, name, tmp)

    slots = set(copyreg._slotnames(t1.__class__))  # (the same for both: the swap asked)
    _swap_impl(t1, t2)  # (first: the one step that may refuse, before anything is swapped)
    swap_attr("__class__")
    swap_attr("__dict__")
    for slot in slots:
        if hasattr(t1, slot) and hasattr(t2, slot):
            swap_attr(slot)
        elif hasattr(t1, slot):
            setattr(t2, slot, getattr(t1, slot))
            delattr(t1, slot)
        elif hasattr(t2, slot):
            setattr(t1, slot, getattr(t2, slot))
            delattr(t2, slot)


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
def undone(tensors: list[torch.Tensor], host_only: bool = False):
    """Inside the block ``tensors`` may be written; afterwards each holds what it held before,
    and has the version and layout it had. For the runs beyond the real call (extra warm-ups,
    a rehearsal, the capture) over tensors a forward reads from outside its arguments,
    parameters and buffers (plain tensor attributes, closures, globals): only the real call's
    writes remain. Copied and put back by storage, bytes for bytes (a write through ``.data``
    or by a kernel outside torch's Python API moves no version counter; a view, an expanded
    one included, is put back with the memory it views; of a storage, the bytes from the first
    its tensors view to the last, not more); tensors without memory of their own
    (meta, sparse, wrapper subclasses: a guard refuses the last two) are left alone.
    ``host_only``: the bytes of CPU tensors only (around a capture that runs no kernel, whose
    in-place ops on the device are recorded, not run: their versions and layouts, which
    change on the host, are put back all the same)."""
    spans: dict[int, list] = {}  # storage address -> [storage, first byte, end]
    for t in tensors:
        if t.layout is not torch.strided or t.device.type == "meta" or not t.numel() \
                or (host_only and t.device.type != "cpu"):
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
        # (and their layouts: a forward's ``self.m.t_()`` or ``resize_`` runs again in each run)
        with layouts_kept(tensors):
            yield
    finally:
        unswap()
        with torch.no_grad():
            for view, copy in saved:
                view.copy_(copy)


@contextlib.contextmanager
def rng_kept(device: torch.device | None):
    """Afterwards the default generators' states are what they were before the block: the CPU
    one's, and ``device``'s where it is a CUDA device. Around the runs beyond the real call
    (extra warm-ups, rehearsals, a segment's checks, bucketed's padded runs): what they draw
    would otherwise put the user's random stream ahead of eager's (every later dropout mask,
    replays' too, and every ``torch.rand`` of theirs). A generator the forward keeps or is
    passed is not put back."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) \
        if device is not None and device.type == "cuda" else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


@contextlib.contextmanager
def layouts_kept(tensors: list[torch.Tensor]):
    """Afterwards each of ``tensors`` has the layout (storage, offset, size, stride) and the
    version counter it had before the block; their bytes are the caller's business. Only
    metadata is kept: around the runs beyond the real call, over every parameter and buffer
    (a forward's ``self.log.set_(...)`` or ``self.log.data = ...``, which no probe sees, runs
    again in each run; so does an in-place op that moves a version a saved tensor is checked
    by)."""
    layouts = layouts_of(tensors)
    with versions_kept([t for t in tensors if t.layout is torch.strided]):
        try:
            yield
        finally:  # (before the versions: ``set_`` moves them)
            unswap()
            put_layouts_back(layouts)


def put_storages_back(saved: dict) -> None:
    """Each (storage, copy of its bytes) among ``saved``'s values (None: kept elsewhere)
    holds those bytes again: a probe's copies taken before a storage's first write in a run
    that is not a call (see ``Probe.saved``). A storage that grew meanwhile (``resize_``) has
    its first bytes put back; its layout is :func:`layouts_kept`'s business."""
    unswap()
    with torch.no_grad():
        for kept in saved.values():
            if kept is None:
                continue
            st, copy = kept
            n = min(st.nbytes(), copy.nbytes())
            if n == st.nbytes() == copy.nbytes():
                st.copy_(copy)
            elif n:
                _bytes(st, n).copy_(_bytes(copy, n))


def put_seen_back(seen: dict) -> None:
    """Each (tensor, :func:`layout`, version) among ``seen``'s values (``Probe.layouts``)
    whose layout changed is over that storage, offset, size and stride again, at that version
    (``set_``, which no probe sees, on a tensor from before the call; an inference tensor,
    which has no version, under inference mode)."""
    unswap()
    with torch.no_grad():
        for t, lay, version in seen.values():
            if layout(t) != lay:
                if version is None:
                    with torch.inference_mode():
                        t.set_(lay[0].st, *lay[1:])
                    continue
                t.set_(lay[0].st, *lay[1:])
                set_version(t, version)


def put_versions_back(versions: dict) -> None:
    """Each (tensor, version) among ``versions``' values (``Probe.versions``: in the order of
    their first writes) has that version again. A view shares its base's counter: the earliest
    one taken of a counter is set last."""
    unswap()
    for t, version in reversed(list(versions.values())):
        if t._version != version:
            set_version(t, version)


def _bytes(st, n: int) -> torch.Tensor:
    """The first ``n`` bytes of storage ``st``, as a tensor."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,))


def layouts_of(tensors: list[torch.Tensor]) -> list[tuple]:
    """(tensor, :func:`layout`) of each of ``tensors`` that has one, for
    :func:`put_layouts_back`."""
    out = []
    for t in tensors:
        if t.layout is torch.strided and t.device.type != "meta":
            lay = layout(t)
            if lay is not None:
                out.append((t, lay))
    return out


def put_layouts_back(layouts: list[tuple]) -> None:
    """Each tensor of :func:`layouts_of`'s list over its storage, offset, size and stride
    then, where they changed (``set_``: a grown storage keeps its new memory)."""
    unswap()
    with torch.no_grad():
        for t, (st, offset, size, stride) in layouts:
            if layout(t) != (st, offset, size, stride):
                t.set_(st.st, offset, size, stride)


def layout(t: torch.Tensor) -> tuple | None:
    """(storage, offset, size, stride) of ``t``, compared by identity of the storage's memory
    (None where it has none of its own)."""
    try:
        st = t.untyped_storage()
        st.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (_Same(st), t.storage_offset(), tuple(t.shape), t.stride())


class _Same:
    """A storage, equal to another one over the same memory."""

    __slots__ = ("st",)

    def __init__(self, st):
        self.st = st

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and self.st.data_ptr() == other.st.data_ptr() \
            and self.st.nbytes() == other.st.nbytes()

    __hash__ = None


@contextlib.contextmanager
def kept(values: list, tensors: list[torch.Tensor], host_only: bool = False):
    """:func:`undone` over ``tensors`` and the tensors in ``values``, which also hold again
    the items they held (lists, dicts, a plain object's attributes, nested a few levels; put
    back where they changed): ``values`` are the objects the real call bound to module
    attributes (a rolled ring buffer, a trimmed log) and ``tensors`` those it read from
    outside, written in place by the runs that are not calls. ``host_only``: see
    :func:`undone`."""
    marks = contents(values)
    inner = [t for v in values for t in tensors_in(v)]
    try:
        with undone(list(tensors) + inner, host_only):
            yield
    finally:
        unswap()
        put_back(marks)


def contents(values: list) -> list:
    """What the containers and objects in ``values`` hold (see :func:`_contents`), for
    :func:`put_back`."""
    return _contents(values, [], set(), 0)


def differ(marks: list, added_ok: bool = False) -> bool:
    """Whether an object of :func:`contents`'s ``marks`` holds other items now (with
    ``added_ok``, a dict that only gained keys does not count: a memo)."""
    for obj, items in marks:
        if added_ok and isinstance(obj, dict) and len(obj) > len(items):
            if any(k not in obj or obj[k] is not v for k, v in items.items()):
                return True
        elif not _same_items(obj, items):
            return True
    return False


def _same_items(obj, items) -> bool:
    """Whether ``obj`` (see :func:`_contents`) holds ``items``, its snapshot: the same
    objects, in the same order (a set's by identity; a dict's keys by equality too; an
    object's fields by name)."""
    if isinstance(obj, set):
        return {id(x) for x in obj} == {id(x) for x in items}
    if isinstance(obj, (list, collections.deque)):
        return len(obj) == len(items) and all(a is b for a, b in zip(obj, items))
    if isinstance(obj, dict):
        return len(obj) == len(items) and all(k is k0 or k == k0 for k, k0 in zip(obj, items)) \
            and all(obj[k] is v for k, v in items.items())
    return all(getattr(obj, n) is v for n, v in items.items())


def put_back(marks: list) -> None:
    """Each object of :func:`contents`'s ``marks`` holds what it held then, where it holds
    other items now."""
    for obj, items in marks:
        _put_items(obj, items)


def _put_items(obj, items) -> None:
    """``obj`` (see :func:`_contents`) holds ``items`` again, where it holds other ones now."""
    if _same_items(obj, items):
        return
    if isinstance(obj, list):
        list.__setitem__(obj, slice(None), items)
    elif isinstance(obj, collections.deque):
        obj.clear()
        obj.extend(items)
    elif isinstance(obj, set):
        set.clear(obj)
        set.update(obj, items)
    elif isinstance(obj, dict):
        _fill(obj, items)
    else:  # (a dataclass or a plain class with slots: its fields)
        for name, value in items.items():
            if getattr(obj, name) is not value:
                object.__setattr__(obj, name, value)


def refill(d: dict, items: dict) -> None:
    """``d`` holds ``items`` again, in their order, where it holds other ones now, through
    the base type's own methods (an ``OrderedDict`` keeps its order links; a subclass that
    refuses ``update``, HF's ``ModelOutput``, is filled all the same)."""
    if not _same_items(d, items):
        _fill(d, items)


def _fill(d: dict, items: dict) -> None:
    base = collections.OrderedDict if isinstance(d, collections.OrderedDict) else dict
    try:
        base.clear(d)
        for k, v in items.items():
            base.__setitem__(d, k, v)
    except TypeError:  # (an immutable mapping: nothing could have changed it)
        pass


def _contents(values, out: list, seen: set, depth: int) -> list:
    """(object, a shallow copy of what it holds) for the lists, deques, sets, dicts (and the
    attributes of a dict subclass that keeps its items as attributes too, HF's
    ``ModelOutput``), plain objects and dataclasses with slots in ``values`` (modules aside:
    their attribute writes are recorded)."""
    if depth > 4:
        return out
    for v in values:
        if id(v) in seen or isinstance(v, (torch.Tensor, torch.nn.Module, type)):
            continue
        if isinstance(v, (list, collections.deque)):
            seen.add(id(v))
            out.append((v, list(v)))
            _contents(v, out, seen, depth + 1)
        elif isinstance(v, set):
            seen.add(id(v))
            out.append((v, set(v)))
        elif isinstance(v, dict):
            seen.add(id(v))
            out.append((v, dict(v)))
            _contents(v.values(), out, seen, depth + 1)
            extra = getattr(v, "__dict__", None)
            if isinstance(extra, dict) and extra:
                out.append((extra, dict(extra)))
                _contents(extra.values(), out, seen, depth + 1)
        elif isinstance(v, tuple):
            _contents(v, out, seen, depth + 1)
        elif callable(v):
            continue
        elif isinstance(getattr(v, "__dict__", None), dict):
            seen.add(id(v))
            out.append((v.__dict__, dict(v.__dict__)))
            _contents(v.__dict__.values(), out, seen, depth + 1)
        elif dataclasses.is_dataclass(v) or slot_names(type(v)):
            seen.add(id(v))
            names = [f.name for f in dataclasses.fields(v)] if dataclasses.is_dataclass(v) \
                else slot_names(type(v))
            fields = {n: getattr(v, n) for n in names if hasattr(v, n)}
            out.append((v, fields))
            _contents(fields.values(), out, seen, depth + 1)
    return out


def slot_names(cls: type) -> list[str]:
    """The ``__slots__`` names of ``cls`` and its bases (a plain class with slots: no
    ``__dict__`` to copy)."""
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n != "__weakref__"]
    return names


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
        unswap()
        for t, version in zip(tensors, versions):
            if version is not None and t._version != version:
                set_version(t, version)


def set_version(t: torch.Tensor, version: int) -> None:
    """Set ``t``'s version counter (shared with its views) to ``version``."""
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # (an older torch: one tensor and one version)
        torch._C._autograd._unsafe_set_version_counter(t, version)
