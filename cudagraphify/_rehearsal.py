"""The captured path of capture-aware code: a rehearsal.

Code that asks ``torch.cuda.is_current_stream_capturing()`` (HF transformers' mask building)
takes another path while captured. Where the code that asks is trusted to compute the same on
that path (``OpPolicy.trusts_captured_path``), one more eager run answers the question "yes", on
copies of the inputs, with the parameters, buffers and random state restored afterwards; its
probe then stands in for the warm-up's (see :mod:`._first_call`).

Under :func:`~cudagraphify.capture_sizes` a size's rehearsal is lent to the later sizes whose
real call looked the same (:func:`lend`, :func:`borrow`); each capture then shows whether it
took that path (:func:`confirms`), else the size is rehearsed after all.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from ._opinfo import writes_unseen
from ._piecewise import new_probe, probed
from ._probe import Probe
from ._replay import StaticInputs
from ._signature import storage_of, unflatten_call
from ._state import tensors_in as _tensors_in
from . import _writes
from ._nested import Nested, sizes_log
from ._watch import Recorder, recording

__all__ = ["rehearse", "rehearsing", "restored", "snapshot_states", "lend", "borrow", "mark",
           "confirms"]


def rehearse(first) -> Probe | None:
    """The probe of an eager run on which ``torch.cuda.is_current_stream_capturing()``
    answers "yes", when that path is safe and writes what the real call wrote (else None).

    Code that asks (HF transformers' mask building) takes another path while captured;
    where the code that asks is trusted to compute the same on it
    (``OpPolicy.trusts_captured_path``), the warm-up's findings (a host sync on the eager
    path) do not apply to the graph. The run reads copies of the inputs; the buffers and
    parameters it writes and the random state are restored, so only the real call's
    effect remains. The capture must then take the same path, op for op."""
    if first.sig.static_objects:
        return None  # objects passed as they are: another run would change them
    states = _copies_of_states(first)  # (static states: the run reads and writes copies)
    if states is None:
        return None
    statics, buffers = first.statics.watchable()
    # (and the tensors it reads from outside, plain attributes, closures, globals, hold again
    # what the real call left in them)
    held = first.held_tensors()
    with contextlib.ExitStack() as stack:
        # (their versions too, once ``restored`` found by them what it wrote: the real call's
        # autograd graph checks those of the buffers it saved)
        stack.enter_context(_writes.versions_kept(statics))
        try:
            wrote = stack.enter_context(restored(statics, buffers, first.wrote_statics,
                                                 first.device))
            stack.enter_context(_writes.kept(first._left(), held))
        except torch.OutOfMemoryError:
            return None  # (no room for the copies: no rehearsal, the warm-up's plan stands)
        copies = StaticInputs(first.leaves, [False] * len(first.leaves))
        copy_marks = _writes.marks([b for _, b in copies.copy])
        held_marks = _writes.marks(held)
        rehearsal = _rehearsal_probe(first.state)
        # (what it writes outside the known memory, a global only its path touches, is put
        # back by bytes: only the real call's effects remain)
        rehearsal.written = set()
        rehearsal.saved = {storage_of(t): None for t in held}  # (those: _writes.kept's)
        rehearsal.versions = {}  # (and the versions of what it writes through)
        tracked = first.probe.written is not None  # (what it writes: a family's proof asks)
        rehearsal.states_written = {storage_of(t) for obj in states.values()
                                    for t in _tensors_in(obj)}
        # tensors it reads from outside (a global): seen as the warm-up's are (see screen)
        rehearsal.known = {storage_of(x) for x in copies.leaves if isinstance(x, torch.Tensor)} \
            | first.statics.storage_ptrs() \
            | {storage_of(t) for obj in states.values() for t in _tensors_in(obj)}
        ran = False
        rec = Recorder()
        try:
            leaves = [states.get(i, x) for i, x in enumerate(copies.leaves)]
            a, kw = unflatten_call(leaves, first.sig)
            with Nested(), recording(rec):
                first.backend.warmup(probed(rehearsal, lambda: first.fn(*a, **kw)),
                                    first.device)
            ran = True
        except Exception:  # noqa: BLE001 - that path fails eagerly: keep the warm-up's plan
            pass
        finally:  # (not a call: the module attributes it set go, ``self.n += 1``)
            first._put_back(rec)
            _writes.put_storages_back(rehearsal.saved)
            rehearsal.saved = None
        wrote_held = {storage_of(held[j]) for j in _writes.written(held, held_marks)}
        if tracked:
            wrote_held |= rehearsal.written & {storage_of(t) for t in held}
        else:
            rehearsal.written = None  # (as the real call's probe: not tracked)
    _writes.put_versions_back(rehearsal.versions)
    rehearsal.versions = None
    # A path that writes what the eager one does not (or a parameter: restored only where
    # the real call wrote it too) is not the same computation.
    wrote_inputs = {copies.copy[k][0]
                    for k in _writes.written([b for _, b in copies.copy], copy_marks)}
    if not ran or rehearsal.findings or not set(wrote) <= set(first.wrote_statics) \
            or wrote_inputs != set(first.mutated) or _held_differ(first, held, wrote_held):
        return None
    return rehearsal


def _held_differ(first, held: list[torch.Tensor], wrote: set[int]) -> bool:
    """Whether the rehearsal wrote other tensors read from outside (plain attributes,
    closures, globals) than the real call did: by their versions (and as its probe saw),
    against what the real call's probe saw (any written where no probe looked)."""
    if not held:
        return False
    outside = {storage_of(t) for t in held}
    probe = first.warm_probe
    if probe is None or probe.written is None:
        return bool(wrote)
    return wrote != (probe.written & outside)


def rehearsing(state, fn):
    """``fn`` run as a rehearsal runs it (``torch.cuda.is_current_stream_capturing()``
    answers "yes"): the path a rehearsed capture took, run eagerly."""
    return probed(_rehearsal_probe(state), fn)


def _rehearsal_probe(state) -> Probe:
    """A probe of ``state``'s callable that answers "yes" to whether it is captured."""
    probe = new_probe(state)
    probe.rehearse = True
    return probe


def snapshot_states(leaves: list, idx: list[int], device: torch.device) -> dict | None:
    """Deep copies of the static states at leaves ``idx`` (an HF StaticCache), taken before
    the real call writes them: a rehearsal, or a family's proof, runs the call again on copies
    of these (on the states the call left, a prefill would write again after what it wrote,
    past the end of a cache it filled more than half). None where one cannot be copied or the
    copies would take more than a quarter of the free device memory (then neither is made)."""
    if not idx:
        return {}
    nbytes = sum(t.untyped_storage().nbytes() for i in idx for t in _tensors_in(leaves[i]))
    if device.type == "cuda" and nbytes > torch.cuda.mem_get_info(device)[0] // 4:
        return None
    try:
        with torch.no_grad():
            return {i: copy.deepcopy(leaves[i]) for i in idx}
    except Exception:  # noqa: BLE001 - an object deepcopy cannot copy: no rehearsal
        return None


def _copies_of_states(first) -> dict | None:
    """Copies of the states as the call found them, for a rehearsal to read and write."""
    if first.states_before is None:
        return None
    try:
        with torch.no_grad():
            return {i: copy.deepcopy(v) for i, v in first.states_before.items()}
    except torch.OutOfMemoryError:
        return None


@contextlib.contextmanager
def restored(statics: list[torch.Tensor], buffers: list[bool], wrote_before: list[int],
              device: torch.device):
    """Inside the block, the statics and the random state may change; afterwards they are as
    before. Yields the list (filled on exit) of the statics the block wrote."""
    marks = _writes.marks(statics, buffers)  # buffers by value: the copies restore them
    # (and their layouts: a forward that grows a buffer with ``resize_`` grows it here too)
    layouts = _writes.layouts_of(statics)
    with torch.no_grad():
        saved = {j: statics[j].clone() for j in wrote_before}
    wrote: list[int] = []
    try:
        with _writes.rng_kept(device):
            yield wrote
    finally:
        _writes.unswap()  # (a run's swaps: swapped back before anything is put back)
        wrote.extend(_writes.written(statics, marks))
        _writes.put_layouts_back(layouts)
        with torch.no_grad():
            for j in wrote:
                if isinstance(marks[j], torch.Tensor):
                    statics[j].data.copy_(marks[j])
            for j, v in saved.items():
                statics[j].data.copy_(v)


# -- one rehearsal for many sizes (capture_sizes) -------------------------------------------

class Lent:
    """A rehearsal that made a graph, lent to the later sizes of one capture_sizes run (the
    run's log, by identity): to calls whose :func:`fingerprint` is the lender's, while what
    the lender's real call read (its guard) and the global flags hold."""

    __slots__ = ("log", "sign", "probe", "guard", "flags")

    def __init__(self, log: list, sign: tuple, probe: Probe, guard, flags):
        self.log, self.sign, self.probe, self.guard, self.flags = log, sign, probe, guard, flags


def fingerprint(first) -> tuple | None:
    """What a rehearsal's verdict is measured against, as the real call showed it, sizes left
    out; None where no rehearsal is lent or borrowed: outside capture_sizes, a call that
    records autograd or may (grad mode), objects passed as they are (a rehearsal runs on
    copies of a cache), a graph_region's or share_graph's call, Thunder's tags (the capture's
    probe has none), tensors read from outside or module attributes set by the call (their
    writes are checked by version and value, which a capture cannot show), inference mode or
    inference tensors among the parameters and buffers (no version counters: a rehearsal tells
    their writes by value, which a capture cannot show either)."""
    state, warm = first.state, first.warm_probe
    if sizes_log.get() is None or warm is None or warm.written is None or first.training \
            or torch.is_grad_enabled() or first.sig.state.inference or first.opaque \
            or first.region is not None or state.share is not None \
            or state.options.probe == "thunder" or first.recorder.writes \
            or first.held_tensors() or any(t.is_inference() for t in first.watchable):
        return None
    names, sig = warm.names, first.sig
    return (
        # the eager path, op for op, with its unsafe ops where they were made, and the code
        # that asked whether it is captured (what a rehearsal is for)
        tuple((p, tuple(ops)) for p, ops in sorted(warm.sequences.items())),
        frozenset(warm.called),
        tuple((f.path, f.op, f.tags, f.where) for f in warm.findings),
        frozenset(warm.askers),
        # what the rehearsal's writes are compared with
        tuple(first.mutated), tuple(first.wrote_statics),
        # the call without its sizes: nesting, dtypes, devices, constants, grad mode
        sig.spec, tuple(m[2:8] + (len(m) > 8,) for m in sig.tensors), sig.constants, sig.state,
        # which module attributes it read (a module made by the forward: by its class)
        tuple((names.get(id(m), type(m).__qualname__), name)
              for m, name, _ in first.warm_guard.reads),
    )


# the states that lent in a capture_sizes run (id of its log -> the states): all forgotten at
# its end (``forget``), not only its target's (a piece, a callable its inputs() called)
_lenders: dict[int, list] = {}


def forget(log: list) -> None:
    """The end of a capture_sizes run (``log``): nothing it lent stays lent."""
    for ref in _lenders.pop(id(log), ()):
        state = ref()
        if state is not None and state.rehearsed is not None and state.rehearsed.log is log:
            state.rehearsed = None


def lend(first, rehearsal: Probe) -> None:
    """After ``rehearsal`` made ``first``'s graph: lent to the later sizes of this
    capture_sizes run (the first one lent stays). Not where its path runs an op that may write
    unseen (:func:`~._opinfo.writes_unseen`): a rehearsal finds such a write in a buffer by its
    value, a capture cannot (one of the same ops that writes a buffer at another size only)."""
    state, log = first.state, sizes_log.get()
    held = state.rehearsed
    if log is None or (held is not None and held.log is log):
        return
    if any(writes_unseen(op) for ops in rehearsal.sequences.values() for op in ops):
        return
    sign = fingerprint(first)
    if sign is not None:
        state.rehearsed = Lent(log, sign, rehearsal, first.warm_guard, first.flags)
        _lenders.setdefault(id(log), []).append(weakref.ref(state))


def borrow(first) -> Probe | None:
    """The rehearsal lent to this call (None: it is rehearsed itself)."""
    held = first.state.rehearsed
    if held is None or held.log is not sizes_log.get():
        return None
    sign = fingerprint(first)
    if sign is None or sign != held.sign or not held.flags.check() or not held.guard.valid():
        return None
    return held.probe


def mark(first, inputs: StaticInputs) -> None:
    """Before a capture that may confirm a lent rehearsal: the version counters of the
    parameters and buffers, and of the tensors the capture reads its inputs from (``inputs``),
    by which a rehearsal tells what it wrote (see :func:`confirms`)."""
    held = first.state.rehearsed
    if first.may_borrow and held is not None and held.log is sizes_log.get():
        first.marked = ([_version(t) for t in first.watchable], inputs,
                        [_version(t) for t in inputs.leaves])


def confirms(first, lent: Probe, second: Probe | None) -> bool:
    """Whether the capture's run (probed by ``second``) showed what a rehearsal of this call
    would have: ``lent``'s path op for op, no unsafe op, no parameter or buffer written but
    those the real call wrote, its inputs written as the real call wrote them (by their
    versions, as a rehearsal tells; and as the probe saw), no tensor read from outside."""
    if second is None or second.written is None or second.findings or first.marked is None \
            or dict(second.sequences) != dict(lent.sequences) or second.called != lent.called:
        return False
    written, (statics, inputs, before) = second.written, first.marked
    allowed = set(first.wrote_statics)
    if any(j not in allowed and (_inside(written, t) or _version(t) != v)
           for j, (t, v) in enumerate(zip(first.watchable, statics))):
        return False
    tensors = [(i, t, v) for i, (t, v) in enumerate(zip(inputs.leaves, before))
               if isinstance(t, torch.Tensor)]
    mutated = set(first.mutated)
    if {i for i, t, v in tensors if _version(t) != v} != mutated \
            or not {i for i, t, _ in tensors if _inside(written, t)} <= mutated:
        return False
    known = first.static_storages | {storage_of(t) for _, t, _ in tensors} \
        | {storage_of(t) for t in first.warm_guard.tensors}
    return all(p in known for p in second.outside)


def _inside(written: set[int], t: torch.Tensor) -> bool:
    """Whether a storage written (by its address) lies in ``t``'s memory: its own, or another
    storage object on part of it (a row exposed through DLPack or ``__cuda_array_interface__``
    and taken back by ``torch.as_tensor``: a storage and version counter of its own)."""
    lo = storage_of(t)
    if not lo:
        return False
    try:
        hi = lo + t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return lo in written
    return any(lo <= w < hi for w in written)


def _version(t) -> int | None:
    """A tensor's version counter (None for an inference tensor, which has none, or no
    tensor)."""
    return t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None
