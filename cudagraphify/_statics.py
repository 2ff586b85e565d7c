"""Static state of a module: parameters and buffers read in place, and the guard that keeps them valid.

A captured graph reads parameters and buffers at the addresses they had at capture. On each call
the guard compares the addresses of the scanned tensors with the capture's (one C++ call on CUDA
builds) and the shapes and strides of the buffers (they can be resized or ``set_`` in place).
Address equality means storage identity here because the guard keeps the captured storages
alive: their memory cannot be freed and handed to another tensor while the guard holds them, so
a new storage always shows a new address. Structural edits bump a generation counter and force a
full re-scan that compares every tensor's address, shape, stride and dtype: every write into a
scanned module's ``_parameters``/``_buffers``/``_modules`` (``setattr`` of a submodule,
parameter or buffer as ``load_state_dict(assign=True)`` or ``self.w = self.w[:4]`` do, and
direct writes as ``.to()`` makes for buffers), because the guard replaces those dicts by watched
ones. Modules no graph depends on never bump it (HF models build a new ``ModuleList`` by
slicing ``self.layers`` on every forward). A replaced submodule invalidates too, even without
parameters. Modules a graphed *function* runs are adopted (:meth:`StaticState.adopt`) and
guarded the same way.

Not detected per call: in-place layout changes of parameters (``p.set_(...)``/``p.t_()`` under
``no_grad``, ``p.data = view`` at the same address); only their addresses are checked per call.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import threading
import types
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["KEPT_MARK", "MAPPING_VIEWS", "REGISTRIES", "StaticState", "generation",
           "generation_bump", "no_one_layout", "rewatch", "watch", "watched"]

_generation = 0
_lock = threading.Lock()


def _bump(*_args) -> None:
    global _generation
    with _lock:
        _generation += 1


def generation_bump() -> None:
    """Bump the generation by hand (a registry written past its report: ``dict`` methods)."""
    _bump()


def generation() -> int:
    """Counter bumped whenever a watched module (one a graph depends on) registers, replaces or
    deletes a submodule, parameter or buffer."""
    return _generation


# ``ptrs_equal(tensors, ptrs, indices)``: whether ``tensors[i].data_ptr() == ptrs[i]`` for each i
# in indices, in one C call (CUDA builds only; None elsewhere)
ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# up to this many statics, their addresses are read one by one: on the H200's host, for 2,
# 8 and 16 of them, 202, 663 and 1269 ns against 331, 739 and 1265 ns for one call of the C
# check above (its arguments' conversion)
_FEW = 8
_TensorGuards = torch._C._dynamo.guards.TensorGuards


class _WatchedDict(dict):
    """A module's ``_parameters``/``_buffers``/``_modules`` dict that reports every write.

    ``Module._apply`` (``.to()``, ``.half()``...) writes buffers straight into ``_buffers``,
    bypassing the registration hooks; with these dicts every structural write bumps the
    generation, so the per-call guard only has to compare addresses. Pickles and copies as a
    plain dict.
    """

    __slots__ = ()

    # each bumps after the write: a check in between still sees the old generation
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _bump()

    def __delitem__(self, key):
        super().__delitem__(key)
        _bump()

    def _mutator(name):  # noqa: N805 - builds methods below
        def method(self, *args, **kwargs):
            try:
                return getattr(dict, name)(self, *args, **kwargs)
            finally:
                _bump()

        method.__name__ = name
        return method

    pop = _mutator("pop")
    popitem = _mutator("popitem")
    clear = _mutator("clear")
    update = _mutator("update")
    setdefault = _mutator("setdefault")
    __ior__ = _mutator("__ior__")
    del _mutator

    def __reduce__(self):
        return (dict, (dict(self),))


# set in a module's ``__dict__`` whose registries are watched in place (kept elsewhere too:
# their dict versions are checked instead, see ``StaticState.same``)
KEPT_MARK = "_cudagraphify_kept"
_dict_version = torch._C._dynamo.guards.dict_version


def watched(module: torch.nn.Module) -> bool:
    """Whether a graph depends on ``module`` (its registries report writes, or are checked)."""
    d = module.__dict__
    return type(d.get("_parameters")) is _WatchedDict or KEPT_MARK in d


REGISTRIES = ("_parameters", "_buffers", "_modules")
# registries made watched (an ``OrderedDict``: a model pickled by an older torch, or code that
# sets ``self._modules = OrderedDict()``; ``ModuleList.__delitem__`` sets one)
_PLAIN_REGISTRIES = (dict, collections.OrderedDict)


def watch(module: torch.nn.Module) -> str | None:
    """Make ``module``'s registries report writes (``watched`` from now on). Where one is a
    mapping that is no dict: why it cannot be watched."""
    return _watch(module, [])


def _watch(module: torch.nn.Module, kept: list) -> str | None:
    """As ``watch``; a registry that something else keeps too is left in place, and goes into
    ``kept`` (its dict version is checked on every call instead)."""
    why = None
    for attr in REGISTRIES:
        d = module.__dict__.get(attr)
        if type(d) in _PLAIN_REGISTRIES:
            # (watched as a copy put in its place, unless something else keeps it, a module
            # sharing it, thunder's jitted module, a view ``self.names = self.heads.keys()``:
            # it would go on with the old one; references: the module's dict, ``d``,
            # getrefcount's argument)
            if sys.getrefcount(d) > 3 and _kept_elsewhere(d, module.__dict__):
                module.__dict__[KEPT_MARK] = True  # (its attribute writes move the epoch)
                kept.append(d)
                continue
            module.__dict__[attr] = _WatchedDict(d)
        elif type(d) is _WatchedDict:
            pass
        elif isinstance(d, dict):  # (a dict of another kind: its version, checked)
            module.__dict__[KEPT_MARK] = True
            kept.append(d)
        elif d is not None:
            why = why or (f"{type(module).__name__}.{attr} is a {type(d).__name__}, whose "
                          "writes cannot be watched (a changed parameter, buffer or submodule "
                          "would not be seen)")
    return why


# what refers to a registry for a moment: an iteration under way over it (a ``for layer in
# self.layers`` the capture happens inside of, ``named_parameters()``'s generator and the view
# it holds) goes on over the old one, which holds the same
_PASSING = tuple({type(it) for d in ({}, collections.OrderedDict())
                  for view in (d, d.keys(), d.values(), d.items())
                  for it in (iter(view), reversed(view))}) + (
    types.FrameType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
MAPPING_VIEWS = (types.MappingProxyType, type({}.keys()), type({}.values()), type({}.items()))


def _kept_elsewhere(d: dict, owner: dict) -> bool:
    """Whether something keeps ``d`` (a registry of the module whose ``__dict__`` is
    ``owner``) beyond an iteration under way: another module sharing it (``copy.copy``), an
    attribute, a container, a closure, a view kept (``self.names = self.heads.keys()``). (A
    local of a running function is no referrer gc knows: not seen.)"""
    # (no closure over ``d`` here: its cell would refer to it)
    found = gc.get_referrers(d)
    here = sys._getframe(1)
    for r in found:
        if r is owner:  # (kept under a second name too: ``self.table = self._modules``)
            names = 0
            for v in owner.values():
                names += v is d
            if names > 1:
                return True
            continue
        if r is here or isinstance(r, _PASSING):
            continue
        if isinstance(r, MAPPING_VIEWS):  # a view: kept, unless only an iteration holds it
            held = gc.get_referrers(r)
            for h in held:
                if h is not found and not isinstance(h, _PASSING):
                    return True
            continue
        return True
    return False


def rewatch(module: torch.nn.Module, name: str) -> None:
    """A watched module's registry ``name`` was just set to a new mapping (``self._modules =
    OrderedDict(...)``, as ``ModuleList.__delitem__`` does): watch the new one, and count the
    change as a structural write."""
    if type(module.__dict__.get(name)) in _PLAIN_REGISTRIES:
        module.__dict__[name] = _WatchedDict(module.__dict__[name])
    _bump()


class StaticState:
    """The parameters and buffers of one module tree (plus the modules a graphed function
    runs), and the guard on their identity and layout."""

    def __init__(self, root: torch.nn.Module | None):
        self.root = root
        self.roots: list[torch.nn.Module] = [root] if root is not None else []
        self.modules: list[torch.nn.Module] = []
        self._slots: list[tuple[dict, str]] = []
        self.tensors: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        self._indices: list[int] = []
        self._pairs: tuple | None = ()  # (tensor, address) where they are few (see same)
        self._held: list = []
        self._is_buffer: list[bool] = []
        self._layout: list[tuple] = []
        self._buffers: list[torch.Tensor] = []
        self._buffer_layout: list[tuple] = []
        self._buffer_guard = None
        self._kept: list | None = None  # (registry, dict version) watched in place
        self._generation = -1
        # rescans so far: a graph that keeps some of ``tensors`` (the version counters it
        # moves and checks, see _versions) finds them again after one
        self.scans = 0
        self.rescan()

    def adopt(self, modules) -> bool:
        """Guard ``modules`` (and their submodules) too: modules a graphed function ran, or
        that a forward reached outside its own tree. Returns whether any was new."""
        known = {id(m) for m in self.modules}
        new = [m for m in modules if id(m) not in known]
        if not new:
            return False
        self.roots.extend(new)
        self.rescan()
        return True

    def rescan(self) -> None:
        """Re-read the module trees (after a structural change)."""
        self._generation = _generation
        self.scans += 1
        modules, seen_m = [], set()
        for root in self.roots:
            for m in root.modules():
                if id(m) not in seen_m:
                    seen_m.add(id(m))
                    modules.append(m)
        self.modules = modules
        unwatched = None
        kept: list = []
        for m in self.modules:
            why = _watch(m, kept)
            if unwatched is None:
                unwatched = why
        # registries watched in place, and their versions now (see same)
        self._kept = [(d, _dict_version(d)) for d in kept] or None
        # which submodule each name of each module holds: one module of the tree put behind
        # another name (``self.use = self.b`` where it was ``self.a``) leaves the set of
        # modules and parameters as it was, but not what forward runs
        self._edges = [(id(m), name, id(c)) for m in modules for name, c in m._modules.items()]
        slots = []
        seen = set()
        self.lazy = False  # an uninitialized parameter or buffer (a LazyModule's) in the tree
        # why calls run eagerly: a parameter or buffer with no one address and layout to guard
        # (a nested or sparse tensor), None where there is none
        self.opaque: str | None = unwatched
        for m in self.modules:
            for d in (m._parameters, m._buffers):
                for name, t in d.items():
                    if t is None or id(t) in seen:
                        continue
                    if is_lazy(t):  # (no memory yet: its module's first forward makes it)
                        self.lazy = True
                        continue
                    if no_one_layout(t):
                        if self.opaque is None:
                            kind = "nested" if t.is_nested else str(t.layout).replace(
                                "torch.", "")
                            self.opaque = (f"parameter or buffer {name!r} of a "
                                           f"{type(m).__name__} is a {kind} tensor, whose memory "
                                           "has no one address and layout to guard")
                        continue
                    seen.add(id(t))
                    slots.append((d, name))
        self._slots = slots
        self.tensors = [d[n] for d, n in slots]
        self._is_buffer = [any(d is m._buffers for m in self.modules) for d, _ in slots]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self._layout = [_layout(t) for t in self.tensors]
        # Holding the storages (not only the tensors, whose ``.data`` can be swapped) is what
        # makes an equal address mean the same memory.
        self._held = [t.untyped_storage() for t in self.tensors]
        self._indices = list(range(len(self.tensors)))
        # (the fast path's inline check: not where registries are watched in place, whose
        # versions ``same`` checks)
        self._pairs = tuple(zip(self.tensors, self.ptrs)) \
            if len(self.tensors) <= _FEW and self._kept is None else None
        self._buffers = [t for t, b in zip(self.tensors, self._is_buffer) if b]
        self._buffer_layout = [_layout(t) for t in self._buffers]
        # Buffers can change shape or stride in place (resize_, set_): checked on every call,
        # in C where it can be (falls back to Python when thread-local dispatch state, such as
        # inference mode or autocast, differs from the scan's).
        self._buffer_guard = _TensorGuards(
            *self._buffers, dynamic_dims_sizes=[list(t.shape) for t in self._buffers],
            dynamic_dims_strides=[list(t.stride()) for t in self._buffers]) \
            if self._buffers else None

    def grad_params(self) -> list[torch.Tensor]:
        """The parameters and buffers that require grad now (as of the last ``changed()``)."""
        return [t for t in self.tensors if t.requires_grad]

    @contextlib.contextmanager
    def stand_ins(self) -> Iterator[dict[int, torch.Tensor]]:
        """Inside the block, each parameter (or buffer) that requires grad is replaced, in every
        module that holds it, by a detached alias of the same memory that requires grad; yields
        ``{id(original): alias}``.

        Our warm-up and capture backwards differentiate with respect to the aliases. The real
        parameters' AccumulateGrad nodes stay out of them: DDP keeps those nodes alive with the
        stream they were made on, and an engine sync with that (legacy) stream breaks a capture.
        The dicts are written directly, so the statics' guard sees no change.
        """
        aliases = {id(t): (nn.Parameter(t.detach()) if isinstance(t, nn.Parameter)
                           else t.detach().requires_grad_(True))
                   for t in self.tensors if t.requires_grad}
        swapped = [(d, name, t) for m in self.modules for d in (m._parameters, m._buffers)
                   for name, t in d.items() if t is not None and id(t) in aliases]
        for d, name, t in swapped:
            dict.__setitem__(d, name, aliases[id(t)])
        try:
            yield aliases
        finally:
            for d, name, t in swapped:
                dict.__setitem__(d, name, t)
            if self._kept is not None:  # (put back as they were: their versions now)
                self._kept = [(d, _dict_version(d)) for d, _ in self._kept]

    def grad_pattern(self) -> tuple[bool, ...]:
        return tuple([t.requires_grad for t in self.tensors])

    def watchable(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The statics a forward may write: buffers, and parameters unless they are inference
        tensors (whose writes could only be seen by copying every weight); and which of them
        are buffers."""
        pairs = [(t, buf) for t, buf in zip(self.tensors, self._is_buffer)
                 if buf or not t.is_inference()]
        return [t for t, _ in pairs], [buf for _, buf in pairs]

    def devices(self) -> set[torch.device]:
        return {t.device for t in self.tensors}

    def storage_ptrs(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.tensors}

    def weight_ptrs(self) -> set[int]:
        """The storages of the parameters that no buffer shares."""
        ptrs = [(t.untyped_storage().data_ptr(), buf) for t, buf in zip(self.tensors,
                                                                         self._is_buffer)]
        return {p for p, buf in ptrs if not buf} - {p for p, buf in ptrs if buf}

    def let_go(self) -> None:
        """Hold none of the tensors' storages any more (no graph of this callable reads them);
        the next check rescans."""
        self._held = []
        self.tensors = []  # (a Parameter replaced later, load_state_dict(assign=True))
        self._pairs = ()
        self._generation = -1

    def same(self) -> bool:
        """Whether the statics are as scanned: no structural write since (the dicts are
        watched), the same addresses (``.data`` swaps move them) and the same buffer layouts
        (``resize_``, ``set_``). No side effects: the fast path's check."""
        if self._generation != _generation:
            return False
        kept = self._kept
        if kept is not None:
            for d, version in kept:
                if _dict_version(d) != version:
                    return False
        pairs = self._pairs
        if pairs is not None:
            for t, ptr in pairs:
                if t.data_ptr() != ptr:
                    return False
        elif ptrs_equal is not None:
            if not ptrs_equal(self.tensors, self.ptrs, self._indices):
                return False
        elif [t.data_ptr() for t in self.tensors] != self.ptrs:
            return False
        if self._buffer_guard is not None and not self._buffer_guard.check(*self._buffers):
            return [_layout(t) for t in self._buffers] == self._buffer_layout
        return True

    def changed(self) -> str | None:
        """Why the statics differ from the last scan, or None. Cheap: called on every call."""
        if self._generation != _generation:
            old_layout, old_modules, old_slots = self._layout, self.modules, self._slots
            old_edges = self._edges
            self.rescan()
            if self._layout != old_layout:
                return f"parameter or buffer {_first_moved(old_slots, self._layout, old_layout)}" \
                    " was replaced, moved or changed shape"
            if len(self.modules) != len(old_modules) or any(
                    a is not b for a, b in zip(self.modules, old_modules)) \
                    or self._edges != old_edges:
                return "a submodule was replaced"
            return None
        if self.same():
            return None
        old_slots, old_layout = self._slots, self._layout
        old_modules, old_edges = self.modules, self._edges
        self.rescan()
        if self._layout == old_layout and self._edges == old_edges \
                and len(self.modules) == len(old_modules) \
                and all(a is b for a, b in zip(self.modules, old_modules)):
            return None  # (a registry watched in place was written: the same memory, layouts)
        return f"parameter or buffer {_first_moved(old_slots, self._layout, old_layout)} " \
            "moved to new memory or changed shape in place"


def no_one_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory has no one shape and strides over one storage to guard: a sparse
    (or other non-strided) tensor, a nested one."""
    return t.layout is not torch.strided or t.is_nested


def _layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _first_moved(slots: Sequence[tuple[dict, str]], now: list[tuple], then: list[tuple]) -> str:
    for (d, name), a, b in zip(slots, now, then):
        if a != b:
            return repr(name)
    return repr(slots[len(then)][1]) if len(slots) > len(then) else "?"
