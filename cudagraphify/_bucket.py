"""Bucketing a leading dimension (serving): :func:`bucketed`.

A server that sees every batch size from 1 to 64 would need 64 graphs. Bucketed, a call of
batch ``n`` is padded to the next size that has a graph (``sizes``), the graph runs, and the
outputs are sliced back to ``n`` rows. That is only right where rows do not interact: no
reduction or normalisation over the batch, no attention across it, nothing computed from the
batch size, nothing written. Nothing can prove that for a forward, so each batch size of each
bucket is checked on its first call: the call runs eagerly on its own rows (that result is
returned), then padded twice, once with its last row repeated and once with zero rows. Where
rows do not interact, the real rows' outputs are the same bit for bit in both padded runs (the
same kernels on the same shape; only the padding's values differ), and close to eager's (other
kernels on another shape: within a few units of the dtype's precision, relative to the
output's largest magnitude). Outputs must keep the batch in the same dimension. The check sees
one call's data: an interaction that neither padding shows on that data (a maximum over the
batch of positive values, a threshold the data does not reach) is not seen.

A bucket and size that fail run unpadded from then on (graphed at their own size by
``graphify``, or eagerly), with one warning. A forward that writes memory it did not make (its
arguments, parameters, buffers, captured tensors) or returns its argument is never bucketed;
nor is one that reads on the host a value computed from module state no guard watches (a
buffer, a tensor kept in an attribute: ``if self.center:``), which may change in place after
the check, nor a call with an argument that is neither a tensor nor a constant. A module the
check ran that is switched to train mode afterwards, or a submodule replaced, is checked again.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable, Hashable, Iterable

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import _capture, _watch, _writes
from ._errors import CudagraphifyUsageError, CudagraphifyWarning
from ._explain import _own_state
from ._guards import StateGuard
from ._hooks import HookWatch
from ._nested import Nested
from ._policy import host_read
from ._probe import _Mode as _ProbeMode, own_file
from ._signature import is_constant, leaf_kind, repeated, storage_of, strict_key
from ._state import tensors_in
from ._statics import REGISTRIES, _WatchedDict, watch

__all__ = ["Bucketed", "bucketed"]


class Bucketed:
    """A callable that pads the ``dim`` of its tensor arguments to the next of ``sizes`` and
    slices the outputs back (see :func:`bucketed`).

    ``verified``: the checked keys (a batch size, its bucket, the other dimensions of the
    arguments, their other values, grad mode); ``refused``: keys that run unpadded, and why."""

    def __init__(self, target: Callable, sizes: list[int], dim: int):
        self._target = target
        self.sizes = sizes
        self.dim = dim
        # key -> the modules the check ran, with their training flags, and the module-state
        # epoch they were read at (a module switched to train mode is checked again)
        self.verified: dict[Hashable, _Ran] = {}
        self.refused: dict[Hashable, str] = {}
        # a function target's refusals (its key holds no training flag): the modules its check
        # ran, with their flags then; a flag changed lifts the refusal (checked again)
        self._refused_in: dict[Hashable, _State] = {}
        self.padded_calls = 0  # calls that ran padded to a bucket (checks included)
        self._set_up: set[Hashable] = set()  # keys whose check's call set up module state

    def __repr__(self) -> str:
        return f"bucketed({self._target!r}, sizes={self.sizes}, dim={self.dim})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        n = self._rows(leaves)
        bucket = next((s for s in self.sizes if s >= n), None) if n else None
        if bucket is None or bucket == n:
            return self._target(*args, **kwargs)  # its own size (or none): as it is
        opaque = next((v for v in leaves if not isinstance(v, torch.Tensor)
                       and not is_constant(v)), None)
        if opaque is not None:
            return self._opaque(opaque, args, kwargs)
        # (n itself: a forward may compute with the batch size, which padding changes)
        # (which tensors are one object too, each padded once: see _signature.repeated)
        key = (n, bucket, spec, tuple(_leaf_key(t, self.dim) for t in leaves), repeated(leaves),
               torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               getattr(self._target, "training", None))  # (a module's train/eval: each its own)
        if key in self.refused:
            when = self._refused_in.get(key)
            if when is None or when.flags_same():
                return self._target(*args, **kwargs)
            del self.refused[key], self._refused_in[key]
        padded = self._padded(leaves, bucket)
        ran = self.verified.get(key)
        if ran is None or not ran.same():
            if _capture.default_backend().in_capture():
                # inside a capture of the caller's own: the check's host syncs would break it
                # (and read memory no kernel wrote yet); this call is part of it, at its size
                return self._target(*args, **kwargs)
            if ran is not None and len(ran.states) >= _STATES:
                # what the check read is in none of the states checked so far: it changes from
                # call to call (a position, a counter it keeps); a check per call would cost
                # three forwards, and one left unwatched may come to make rows interact:
                # unpadded from now on
                del self.verified[key]
                what = ran.states[-1].guard._changed() or "a value it watches"
                return self._refuse(key, self._target(*args, **kwargs),
                                    f"module state its forward reads changes from call to "
                                    f"call ({what}): each call would need its own check")
            return self._check(key, bucket, n, leaves, padded, spec, ran)
        a, kw = pytree.tree_unflatten(padded, spec)
        self.padded_calls += 1
        return self._slice(self._target(*a, **kw), n)

    # -- the rows of a call ------------------------------------------------------------------

    def _rows(self, leaves: list) -> int | None:
        """The size of ``dim`` shared by every tensor argument (None: no tensor)."""
        rows = {t.shape[self.dim] for t in leaves if isinstance(t, torch.Tensor)
                and t.dim() > self.dim}
        if any(isinstance(t, torch.Tensor) and t.dim() <= self.dim for t in leaves):
            raise CudagraphifyUsageError(
                f"bucketed(dim={self.dim}): every tensor argument must have a dimension "
                f"{self.dim} (the batch), got shapes "
                f"{[tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]}")
        if len(rows) > 1:
            raise CudagraphifyUsageError(
                f"bucketed(dim={self.dim}): tensor arguments disagree on the batch size "
                f"(dimension {self.dim}): {sorted(rows)}; every tensor argument is padded")
        return next(iter(rows), None)

    def _padded(self, leaves: list, bucket: int, zeros: bool = False) -> list:
        """The call's leaves with each tensor padded (see :meth:`_pad`), a tensor passed twice
        padded once: the padded call passes one tensor there too."""
        done: dict[int, torch.Tensor] = {}
        out = []
        for t in leaves:
            if isinstance(t, torch.Tensor):
                p = done.get(id(t))
                if p is None:
                    p = done[id(t)] = self._pad(t, bucket, zeros)
                t = p
            out.append(t)
        return out

    def _pad(self, t: torch.Tensor, bucket: int, zeros: bool = False) -> torch.Tensor:
        """``t`` padded to ``bucket`` rows: its last row repeated (real values: no inf or NaN a
        zero row could make), or zero rows (the check's second padding)."""
        n = t.shape[self.dim]
        shape = list(t.shape)
        shape[self.dim] = bucket - n
        rows = t.new_zeros(shape) if zeros else t.narrow(self.dim, n - 1, 1).expand(shape)
        return torch.cat([t, rows], dim=self.dim)

    def _slice(self, out: Any, n: int) -> Any:
        leaves, spec = pytree.tree_flatten(out)
        return pytree.tree_unflatten(
            [t.narrow(self.dim, 0, n) if isinstance(t, torch.Tensor) else t for t in leaves],
            spec)

    # -- a bucket's first call ---------------------------------------------------------------

    def _check(self, key, bucket: int, n: int, leaves: list, padded: list, spec,
               ran: "_Ran | None" = None) -> Any:
        from ._probe import Probe
        from ._policy import default_policy

        args, kwargs = pytree.tree_unflatten(leaves, spec)
        probe = Probe(None, default_policy)  # the storages forward writes
        probe.known, probe.written = set(), set()
        epoch = _watch.epoch  # (before its runs: a change they make is seen on the next call)
        rec = _watch.Recorder()  # the modules it ran and the module attributes it read
        # eagerly, on the call's own rows: this call's result
        # (the host reads' mode under the probe's: the probe tells the forward's calls from
        # cudagraphify's own by the caller's frame, which is the probe's own handler for the
        # mode under it)
        reads = _HostReads(leaves)
        with Nested(), reads, probe, _watch.recording(rec), HookWatch() as hooks:
            swaps = _writes.swaps_made()
            want = self._target(*args, **kwargs)
            swaps = _writes.swaps_made() - swaps
        # (a change of what it read, a flag that makes rows interact, checks the size again)
        guard = StateGuard(list(rec.reads.values()), ran=list(rec.called.values()))
        if not isinstance(self._target, torch.nn.Module):
            # (a refusal below holds while the modules it ran keep their training flags)
            self._refused_in[key] = _State(list(rec.called.values()), guard, epoch)
        if key not in self._set_up and reads.set_up(
                _tree([self._target] if isinstance(self._target, torch.nn.Module)
                      else list(rec.called.values()))):
            # (checked on the next call, the state it set up then found from before the call)
            self._set_up.add(key)
            return want
        if reads.found:
            return self._refuse(key, want, f"forward reads on the host ({reads.found}) a value "
                                "computed from module state, not from the call's arguments "
                                "(a flag or count in a buffer or a parameter): it may change "
                                "in place after the check, unseen")
        if guard.unguardable:
            return self._refuse(key, want, f"what forward reads cannot be watched for a "
                                f"change that would make rows interact: {guard.unguardable}")
        if swaps:
            # (a padded run swapping a parameter whose AccumulateGrad this call's autograd
            # graph holds would poison it: the user's backward would raise)
            return self._refuse(key, want, "forward swaps tensors' contents "
                                "(torch.utils.swap_tensors): padded calls would swap them too, "
                                "and the check runs forward three times")
        if hooks.found:
            # (the padded runs register none, see below, but one that removes the handle this
            # call registered, kept outside the module, would leave the parameter with none)
            return self._refuse(key, want, f"forward registers a tensor hook "
                                f"({hooks.found[0].op}): padded calls would register it on "
                                "the padded batch's tensors, and the check runs forward three "
                                "times")
        if probe.written_before_made:
            return self._refuse(key, want, "forward writes memory it did not make (an "
                                "argument, a parameter, a buffer, a captured tensor): a padded "
                                "call would write it too, and the check runs forward three "
                                "times")
        mine = {storage_of(t) for t in leaves if isinstance(t, torch.Tensor)}
        if any(storage_of(t) in mine for t in pytree.tree_leaves(want)
               if isinstance(t, torch.Tensor)):
            return self._refuse(key, want, "forward returns an argument or a view of one: "
                                "padded, it would return the padded copy")
        # (the modules it ran and the containers and objects it read hold afterwards what the
        # call left: a step counter, a log the padded runs would advance; a forward that
        # changes them on every call is refused below, one that sets up an attribute once,
        # ``if self.scale is None``, is not: its padded runs leave it)
        modules = list(self._target.modules()) \
            if isinstance(self._target, torch.nn.Module) else []
        modules += [m for m in rec.called.values() if all(m is not x for x in modules)]
        attrs = [(m, _own(m)) for m in modules]
        marks = _writes.contents([r.value for r in rec.reads.values()]
                                 + [v for _, a in attrs for v in a.values()])
        runs, swapped = [], False
        try:
            # (the padded runs are not the user's: a tensor hook they register is not
            # registered, and what they swap, torch.utils.swap_tensors, is swapped back when
            # the watch ends, before anything below is compared or put back)
            # (nor are their random numbers: the random state is put back as this call left
            # it)
            device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
            with HookWatch(block=True) as watch, _writes.rng_kept(device):
                for pad in (padded, self._padded(leaves, bucket, zeros=True)):
                    a, kw = pytree.tree_unflatten(pad, spec)
                    out = self._target(*a, **kw)
                    # (a copy: with copy_outputs=False the next replay writes the same memory)
                    runs.append(pytree.tree_map_only(torch.Tensor, torch.clone, out))
                    self.padded_calls += 1
                swapped = bool(watch.swaps_seen())
        finally:
            changed = [f"{type(m).__name__}'s attributes (a step counter, a log)"
                       for m, a in attrs if _writes.differ([(_own(m), a)])] \
                or (["the containers it reads (a step counter, a log)"]
                    if _writes.differ(marks, added_ok=True) else []) \
                or (["tensors' contents (torch.utils.swap_tensors)"] if swapped else [])
            for m, a in attrs:
                d = m.__dict__
                for k in [k for k in _own(m) if k not in a]:
                    del d[k]
                d.update(a)
            _writes.put_back(marks)
        if changed:
            return self._refuse(key, want, f"forward changes {changed[0]} on every call: "
                                "padded calls would change them with the padded batch")
        why = _disagree(want, runs[0], runs[1], self.dim, bucket, n)
        if why:
            return self._refuse(key, want, why)
        # (the target's tree and the modules it ran outside it: kept in a list, a global)
        roots = ([self._target] if isinstance(self._target, torch.nn.Module) else []) \
            + list(rec.called.values())
        self._refused_in.pop(key, None)
        if ran is None:
            ran = self.verified[key] = _Ran()
        ran.states.append(_State(roots, guard, epoch))
        return want

    def _opaque(self, value: Any, args: tuple, kwargs: dict) -> Any:
        """A call with an argument that is neither a tensor nor an immutable value (an options
        object): unpadded. A check holds for what the argument held then, and nothing sees
        it change in place afterwards (a flag that makes rows interact)."""
        key = ("argument", type(value))
        if key not in self.refused:
            self._refuse(key, None, f"argument of type {type(value).__name__} is neither a "
                         "tensor nor an immutable value: what it holds may change after a "
                         "check, unseen")
        return self._target(*args, **kwargs)

    def _refuse(self, key, result: Any, why: str) -> Any:
        self.refused[key] = why
        what = "calls with such an argument run" if key[0] == "argument" else \
            f"batch {key[0]} bucket runs"
        warnings.warn(f"cudagraphify: bucketed: {what} unpadded: {why}",
                      CudagraphifyWarning, stacklevel=3)
        return result


class _HostReads(TorchFunctionMode):
    """(A bucket's check, its real call.) Whether the forward brings to the host (``bool(t)``,
    ``.item()``, ``nonzero``: :func:`~._policy.host_read`) a value computed from module state
    rather than from the call's arguments. Each tensor is one of:

    - state: memory the run did not make that is neither an argument nor a parameter (a
      buffer, a tensor kept in an attribute or a global; cudagraphify's own calls' results
      too), or what an op computed from any of it;
    - data: the arguments, and what an op computed from them (with parameters or not);
    - weights: the parameters, and what an op computed from them alone.

    (And constants: what an op made from no tensor, ``torch.arange(4)``; weights with them
    are weights alone.) A host read of state, or of weights alone (a flag kept in a
    parameter, frozen or not), reads what may change in place (``fill_``,
    ``load_state_dict``) with no attribute written:
    the check, which saw one value, cannot stand for later calls. A host read of data is the
    check's data (see the module docs). ``found``: the first such read's name ("": none)."""

    def __init__(self, leaves: list):
        super().__init__()
        self.clean = {storage_of(t) for t in leaves if isinstance(t, torch.Tensor)}
        self.args = {id(t) for t in leaves if isinstance(t, torch.Tensor)}  # (alive: leaves)
        self.made: set[int] = set()  # storages the run wrote from data
        self.fixed: set[int] = set()  # storages it wrote from weights alone
        self.state: set[int] = set()  # storages it wrote from state
        self.const: set[int] = set()  # storages it made from no tensor (``torch.arange(4)``)
        self.fresh: set[int] = set()  # storages it allocated (its ops' results, no views)
        # id -> kind of the tensors without storage it made (by id, not held: a weak
        # reference would make torch.utils.swap_tensors refuse them; an id a dead one had is
        # labelled again by the op that makes the next one there)
        self.objects: dict[int, int] = {}
        self.found = ""
        self.reads: list[str] = []  # the host reads of data

    def _kind(self, t: torch.Tensor) -> int:
        p = storage_of(t)
        if not p:  # (no storage, a wrapper subclass, or empty: by the object itself)
            if id(t) in self.args:
                return _DATA
            kind = self.objects.get(id(t))
            if kind is not None:
                return kind
            return _WEIGHTS if isinstance(t, torch.nn.Parameter) else _STATE
        if p in self.state:
            return _STATE
        if p in self.clean or p in self.made:
            return _DATA
        if p in self.fixed or isinstance(t, torch.nn.Parameter):
            return _WEIGHTS
        return _NOTHING if p in self.const else _STATE

    def _label(self, t: torch.Tensor, kind: int, fresh: bool) -> None:
        """``t`` holds values of ``kind`` (a fresh result: only those; else besides what its
        storage held: state wins, then what it held)."""
        p = storage_of(t)
        if not p:
            self.objects[id(t)] = kind
            return
        if fresh:  # (memory a dead tensor had, handed on: its labels are not this one's)
            for labels in (self.made, self.fixed, self.state, self.const):
                labels.discard(p)
            self.fresh.add(p)
        elif p in self.state:
            return
        if kind == _STATE:
            self.fixed.discard(p)
        if kind != _DATA:
            self.made.discard(p)
        (self.state if kind == _STATE else self.fixed if kind == _WEIGHTS
         else self.made if kind == _DATA else self.const).add(p)

    def set_up(self, modules: list[torch.nn.Module]) -> bool:
        """After the run: whether it read a value on the host and left in module state a
        tensor it made (a buffer set up on first use, ``if self.flag is None``): later calls
        find that tensor there, state that may change in place, which this run counted as
        its own values. (A view it made of a module's tensor, ``self.w.t()``, is not one.)"""
        if self.found or not self.reads:
            return False
        return any(storage_of(t) in self.fresh for m in modules for t in _tensors_of(m))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1)
        if caller.f_code is _PROBE_HANDLER:  # (the probe's mode, above this one, passed it on)
            caller = caller.f_back
        if caller is not None and own_file(caller.f_code.co_filename):
            # cudagraphify's own call (a guard's look, a graphed piece's output), or the
            # probe's bookkeeping: not the forward's. What it allocates is state (no label
            # a dead tensor left at its address stands)
            with torch._C.DisableTorchFunction():
                mine = {storage_of(t) for t in pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}
            out = func(*args, **kwargs)
            with torch._C.DisableTorchFunction():
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and storage_of(t) not in mine:
                        self._label(t, _STATE, True)
            return out
        with torch._C.DisableTorchFunction():  # (its own looks: no mode's calls)
            ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            # (from what its results' values come: not a tensor that gives only a dtype,
            # device or shape, ``self.p.to(x)``, ``zeros_like(x)``)
            sources = _sources(func, args, kwargs)
            kind = _combined({self._kind(t) for t in sources})
            if not self.found and ins and host_read(func, args, kwargs):
                name = getattr(func, "__qualname__", None) or repr(func)
                if kind in (_STATE, _WEIGHTS):
                    self.found = name
                else:  # (see set_up)
                    self.reads.append(name)
            written = _written(func, args, kwargs)
            # (what an overwrite puts there is its sources' alone: ``h.copy_(self.p)`` or
            # ``h[0] = self.p`` leave weights in h; state or weights written into data, in
            # place, are what they are)
            source = _combined({self._kind(t) for t in sources
                                if all(t is not w for w in written)}) if written else kind
            mine = {}
            for t in ins:
                mine.setdefault(storage_of(t), set()).add(self._kind(t))
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and all(t is not w for w in written):
                    shared = mine.get(storage_of(t))
                    if shared is None:  # (a fresh result)
                        self._label(t, kind, True)
                    else:  # (a view of an input, or the input itself: what it views, unless
                        # state chose which part, ``narrow(x, 0, self.start, 1)``)
                        self._label(t, _STATE if kind == _STATE else _combined(shared), False)
            outs = pytree.tree_leaves(kwargs.get("out"))
            for t in written:  # (an ``out=`` tensor is overwritten)
                k = source if _overwrites(func) or any(t is o for o in outs) else kind
                if k in (_STATE, _WEIGHTS) or (k == _DATA and self._kind(t) == _NOTHING):
                    self._label(t, k, False)
        return out


def _combined(kinds: set) -> int:
    """What an op computes from tensors of ``kinds``: state wins, then data; weights alone (or
    with constants) stay weights; constants alone, constants."""
    return _STATE if _STATE in kinds else _DATA if _DATA in kinds \
        else _WEIGHTS if _WEIGHTS in kinds else _NOTHING


_OVERWRITES = frozenset({"copy_", "fill_", "__setitem__", "index_copy_", "index_put_",
                         "index_fill_", "masked_fill_", "masked_scatter_", "scatter_", "put_",
                         "set_"})


def _overwrites(func) -> bool:
    """Whether ``func`` puts its sources' values in place of what it writes (not ``add_``,
    which computes from both)."""
    name = _name(func)
    return name in _OVERWRITES or name.startswith("_foreach_copy")


# functions whose tensor arguments past the first give only a dtype, device or shape
# (``self.p.to(x)``: p's values), and those whose first gives only those (``zeros_like(x)``,
# ``x.new_zeros(2)``: constants; ``full_like(x, self.p[0])``, ``x.new_tensor(self.p)``: p's)
_META_AFTER_FIRST = frozenset({"to", "type_as", "view_as", "expand_as", "reshape_as"})
_META_FIRST = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                         "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty",
                         "new_full", "new_tensor"})


def _sources(func, args: tuple, kwargs: dict) -> list:
    """The tensor arguments whose values ``func``'s results are computed from."""
    name = _name(func)
    if name in _META_AFTER_FIRST and args and isinstance(args[0], torch.Tensor):
        return [args[0]]
    if name in _META_FIRST:
        if args and isinstance(args[0], torch.Tensor):
            args = args[1:]
        else:  # (``zeros_like(input=x)``)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("input", "self")}
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


_NOTHING, _DATA, _WEIGHTS, _STATE = range(4)
_PROBE_HANDLER = _ProbeMode.__torch_function__.__code__


def _tensors_of(m: torch.nn.Module) -> list:
    """The tensors a module keeps: its buffers, parameters and plain tensor attributes, and
    the tensors in the containers and plain objects it keeps (``self.cache = [k, v]``, a
    ``SimpleNamespace``), a few levels deep (:func:`._state.tensors_in`)."""
    d = m.__dict__
    seen: dict[int, int] = {}  # (objects that hold each other: each walked once)
    return [*d.get("_buffers", {}).values(), *d.get("_parameters", {}).values(),
            *(t for k, v in d.items() if k not in REGISTRIES for t in tensors_in(v, 0, seen))]


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors ``func`` writes in place: an ``out=``, and its first argument (a tensor, or
    a ``_foreach_*_``'s list) where its name says in place; an operator overload's (``torch.ops.
    aten.copy_.default``), the arguments its schema marks written."""
    out = [t for t in pytree.tree_leaves(kwargs.get("out")) if isinstance(t, torch.Tensor)]
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                out += [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
        return out
    name = _name(func)
    if args and (name.endswith("_") and not name.endswith("__")
                 or name in _IN_PLACE_DUNDERS):
        out += [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
    return out


def _name(func) -> str:
    """``func``'s name, an operator overload's without namespace and overload."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(func, "__name__", "")


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__",
                               "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _own(m: torch.nn.Module) -> dict:
    """A module's own attributes (a step counter, a cache), not its registries and hooks
    (dicts of torch's) nor cudagraphify's state and call."""
    return {k: v for k, v in m.__dict__.items()
            if not (k.startswith("_") and isinstance(v, dict)) and not _own_state(k, v)}


_STATES = 4  # module states a size is checked in before state that keeps changing refuses it


class _Ran:
    """The module states a size's check passed in (a flag toggled back and forth: each checked
    once), the last found first."""

    __slots__ = ("states",)

    def __init__(self):
        self.states: list[_State] = []

    def same(self) -> bool:
        states = self.states
        for k in range(len(states) - 1, -1, -1):
            if states[k].same():
                if k != len(states) - 1:
                    states.append(states.pop(k))
                return True
        return False


class _State:
    """The modules of a bucket's check (the target's tree, or the trees of the modules a
    function's check ran) and their training flags (BatchNorm, dropout: a module switched to
    train mode computes across the batch), and the module state its forward read (a flag that
    makes it compute across rows), re-read only after a module attribute was written
    (``_watch.epoch``; mutable values the guard watches, every call). After a write to a
    module's registries or its hooks (``_watch.tree_epoch``: every module of the trees is
    watched for it) the trees are walked again: a submodule replaced (a head that normalises
    over the batch) or a hook registered is another tree, checked again. A tree with a module
    whose submodules are not watched (a registry kept elsewhere too) is walked again on every
    epoch move."""

    __slots__ = ("roots", "modules", "types", "flags", "epoch", "guard", "hooks", "tree",
                 "loose")

    def __init__(self, roots: list[torch.nn.Module], guard: StateGuard, epoch: int):
        self.roots = roots
        self.modules = _tree(roots)
        self.types = [type(m) for m in self.modules]  # (``m.__class__ = Other``: another tree)
        self.flags = [m.training for m in self.modules]
        self.epoch = epoch
        self.guard = guard
        self.hooks = _watch.hook_fingerprint([weakref.ref(m) for m in self.modules])
        for m in self.modules:
            watch(m)  # (its registries' writes and its hooks' registrations move tree_epoch)
        self.loose = _kept_registries(self.modules)
        self.tree = _watch.tree_epoch()  # (after the watch, which moves it)

    def _same_tree(self, tree: tuple[int, int]) -> bool:
        """The same modules in the trees, with the same hooks (theirs and the global ones: a
        hook registered since may compute across rows); ``tree``: ``_watch.tree_epoch()``."""
        if tree == self.tree and self._kept_same() and self._globals_same():
            return True
        now = _tree(self.roots)
        if len(now) == len(self.modules) and all(a is b for a, b in zip(now, self.modules)) \
                and all(type(a) is t for a, t in zip(now, self.types)) \
                and _watch.hook_fingerprint([weakref.ref(m) for m in now]) == self.hooks:
            self.tree = tree
            self.loose = _kept_registries(now)
            return True
        return False

    def _kept_same(self) -> bool:
        """Whether the submodule registries kept elsewhere too (not watched: a write to one
        moves no epoch) are the ones they were, with the same versions (an ``append``)."""
        for m, d, version in self.loose:
            if m.__dict__.get("_modules") is not d or _dict_version(d) != version:
                return False
        return True

    def _globals_same(self) -> bool:
        """The global module hooks as they were (a few dicts: one registered through a name
        bound before cudagraphify patched the registration functions moves no epoch)."""
        return not _watch.global_hooks_present() \
            or _watch.hook_fingerprint(())[1] == self.hooks[1]

    def flags_same(self) -> bool:
        """Whether the modules keep the training flags they had (module writes move the
        epochs: compared again only after one)."""
        now, tree = _watch.epoch, _watch.tree_epoch()
        if now == self.epoch and tree == self.tree and self._kept_same() \
                and self._globals_same():
            return True
        if not self._same_tree(tree) or [m.training for m in self.modules] != self.flags:
            return False
        self.epoch = now
        return True

    def same(self) -> bool:
        now, tree = _watch.epoch, _watch.tree_epoch()
        if now == self.epoch and tree == self.tree and not self.guard.volatile \
                and self._kept_same() and self._globals_same():
            return True
        # (a submodule added to a container, ``layers.append``, moves the tree epoch only)
        if not self._same_tree(tree) or [m.training for m in self.modules] != self.flags \
                or not self.guard.valid():
            return False
        self.epoch = now
        return True


_dict_version = torch._C._dynamo.guards.dict_version


def _kept_registries(modules: list[torch.nn.Module]) -> list[tuple]:
    """(module, its submodule registry, the registry's version) for the modules whose registry
    is not watched (kept elsewhere too: ``copy.copy`` of a ModuleList shares it)."""
    return [(m, d, _dict_version(d)) for m in modules
            for d in (m.__dict__.get("_modules"),)
            if isinstance(d, dict) and type(d) is not _WatchedDict]


def _tree(roots: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``roots``' trees, each once, in walk order."""
    seen: dict[int, torch.nn.Module] = {}
    for root in roots:
        for m in root.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _leaf_key(leaf: Any, dim: int) -> Hashable:
    """What a bucket's check holds for, of one argument: a tensor's other dimensions, dtype,
    device, grad and kind (its class, whether it carries Python attributes: the padded tensor
    is a plain one without; see _signature.leaf_kind); a constant by its value (no other value
    is keyed: see :meth:`Bucketed._opaque`)."""
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape[:dim] + leaf.shape[dim + 1:], leaf.dtype, leaf.device,
                leaf.requires_grad, leaf_kind(leaf))
    return strict_key(leaf)  # (``0.0`` and ``-0.0`` apart, as the signature keeps them)


def _disagree(want: Any, got: Any, other: Any, dim: int, bucket: int, n: int) -> str:
    """Why the padded calls' outputs ``got`` and ``other`` (``bucket`` rows, two paddings) do
    not stand for the unpadded ``want`` (``n`` rows) ("" when they do): the same structure,
    the batch kept in ``dim``, and the real rows the same, bit for bit, whatever the padding."""
    w, wspec = pytree.tree_flatten(want)
    g, gspec = pytree.tree_flatten(got)
    o, ospec = pytree.tree_flatten(other)
    if not wspec == gspec == ospec:
        return "the padded calls return another structure"
    for i, (a, b, c) in enumerate(zip(w, g, o)):
        if not isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor) \
                == isinstance(c, torch.Tensor):
            return f"output {i} is a tensor in some calls only"
        if not isinstance(a, torch.Tensor):
            if not a == b == c:
                return f"output {i} differs ({a!r} unpadded, {b!r} and {c!r} padded)"
            continue
        if b.dim() <= dim or b.shape[dim] != bucket or c.shape != b.shape \
                or a.shape[dim:dim + 1] != (n,):
            return (f"output {i} does not keep the batch in dimension {dim} (shape "
                    f"{tuple(a.shape)}, padded {tuple(b.shape)}): rows interact")
        b, c = b.narrow(dim, 0, n), c.narrow(dim, 0, n)
        if b.shape != a.shape or b.dtype != a.dtype:
            return (f"output {i} is {tuple(b.shape)} {b.dtype} padded, {tuple(a.shape)} "
                    f"{a.dtype} unpadded")
        same = (b == c) | (b != b) & (c != c) if b.is_floating_point() or b.is_complex() \
            else b == c
        if not bool(same.all()):
            return (f"output {i}'s real rows change with the padding rows' values: rows "
                    "interact")
        if not _near(b, a):
            return (f"output {i} differs from eager's on the call's own rows by more than "
                    "other kernels would (forward computes with the batch size?)")
    return ""


# How far a padded output may be from eager's, relative to eager's largest magnitude: padded
# shapes pick other kernels (other summation orders, TF32 convolutions); what changes with the
# batch size itself (a mean over it, a branch on it) is far larger.
_RTOL = {torch.bfloat16: 2**-4, torch.float16: 2**-7, torch.float32: 2**-10}


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not (want.is_floating_point() or want.is_complex()):
        return torch.equal(got, want)
    if want.numel() == 0:
        return True
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(
            want[~finite], got[~finite]) and not bool((want[~finite] != want[~finite]).all()):
        return False  # an inf or NaN where eager has none, or another one
    w, g = want[finite], got[finite]
    if w.numel() == 0:
        return True
    scale = float(w.abs().max())
    # (relative to the output's own size, whatever it is: an absolute floor let outputs of
    # 1e-5 that changed by a quarter with the batch size pass; the smallest normal number
    # stands for all-zero outputs)
    return float((g - w).abs().max()) <= _RTOL.get(want.dtype, 2**-20) * scale \
        + torch.finfo(want.dtype).tiny


def bucketed(target: Callable, sizes: Iterable[int], *, dim: int = 0) -> Bucketed:
    """Call ``target`` (a graphified module or function) through buckets of a leading
    dimension: a call whose tensor arguments have ``n`` rows in ``dim`` is padded (the last row
    repeated) to the smallest of ``sizes`` that is at least ``n``, and every tensor output is
    sliced back to ``n`` rows. A call of a size in ``sizes``, or larger than all, runs as it is.

    Valid only where rows do not interact (each output row depends on its input row alone,
    not on the batch size): each batch size's first call in a bucket checks it, running the
    call eagerly on its own rows (its result is the one returned), then padded with its last
    row repeated and with zero rows: the real rows' outputs must be the same bit for bit, and
    close to eager's (padded shapes may pick other kernels: padded outputs are close to eager's,
    not equal). The check sees that call's data only (see the module docs). A size that fails,
    a forward that writes memory it did not make, one that returns its argument or reads module
    state on the host, and a call with an argument that is neither a tensor nor a constant run
    unpadded from then on, with a warning (``.refused`` says why). An empty batch runs as it
    is. Every tensor argument is padded: pass other tensors as attributes or close over them.

    Use :func:`capture_sizes` with the same ``sizes`` to capture the buckets up front.
    """
    if not callable(target):
        raise CudagraphifyUsageError(f"bucketed: target must be callable, got "
                                     f"{type(target).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise CudagraphifyUsageError(f"bucketed: dim must be a non-negative int, got {dim!r}")
    from ._sizes import _sizes

    return Bucketed(target, sorted(_sizes(sizes)), dim)
