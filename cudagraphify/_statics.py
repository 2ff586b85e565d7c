"""Static state of a module: parameters and buffers read in place, and the guard that keeps them valid.

A captured graph reads parameters and buffers at the addresses they had at capture. On each call
the guard compares the addresses of the scanned tensors with the capture's (one C++ call on CUDA
builds). Address equality means storage identity here because the guard keeps the captured
storages alive: their memory cannot be freed and handed to another tensor while the guard holds
them, so a new storage always shows a new address. Structural edits bump a global generation
counter and force a full re-scan: ``setattr`` of a submodule, parameter or buffer (as
``load_state_dict(assign=True)`` does) through PyTorch's module registration hooks, and direct
writes into ``_parameters``/``_buffers``/``_modules`` (as ``.to()`` does for buffers) because the
guard replaces those dicts by watched ones. A replaced submodule invalidates too, even without
parameters.

Not detected: ``p.data = t`` where ``t`` reuses ``p``'s exact memory with another shape or
stride, and tensors a forward reads that are neither parameters, buffers nor arguments (plain
tensor attributes, globals). Register such tensors as buffers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module_mod

__all__ = ["StaticState", "generation"]

_generation = 0
_hooks_installed = False
_hooks_lock = threading.Lock()


def _bump(*_args) -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """Counter bumped whenever any module registers or replaces a submodule, parameter or buffer."""
    return _generation


def _install_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        _module_mod.register_module_parameter_registration_hook(_bump)
        _module_mod.register_module_buffer_registration_hook(_bump)
        _module_mod.register_module_module_registration_hook(_bump)
        _hooks_installed = True


_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class _WatchedDict(dict):
    """A module's ``_parameters``/``_buffers``/``_modules`` dict that reports every write.

    ``Module._apply`` (``.to()``, ``.half()``...) writes buffers straight into ``_buffers``,
    bypassing the registration hooks; with these dicts every structural write bumps the
    generation, so the per-call guard only has to compare addresses. Pickles and copies as a
    plain dict.
    """

    __slots__ = ()

    def __setitem__(self, key, value):
        _bump()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _bump()
        super().__delitem__(key)

    def _mutator(name):  # noqa: N805 - builds methods below
        def method(self, *args, **kwargs):
            _bump()
            return getattr(dict, name)(self, *args, **kwargs)

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


def _watch(module: torch.nn.Module) -> None:
    for attr in ("_parameters", "_buffers", "_modules"):
        d = module.__dict__.get(attr)
        if type(d) is dict:
            module.__dict__[attr] = _WatchedDict(d)


class StaticState:
    """The parameters and buffers of one module tree, and the guard on their identity."""

    def __init__(self, root: torch.nn.Module | None):
        _install_hooks()
        self.root = root
        self.modules: list[torch.nn.Module] = []
        self._slots: list[tuple[dict, str]] = []
        self.tensors: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        self._indices: list[int] = []
        self._held: list = []
        self._is_buffer: list[bool] = []
        self._generation = -1
        self.rescan()

    def rescan(self) -> None:
        """Re-read the module tree (after a structural change)."""
        self._generation = _generation
        if self.root is None:
            return
        self.modules = list(self.root.modules())
        for m in self.modules:
            _watch(m)
        slots = []
        seen = set()
        for m in self.modules:
            for d in (m._parameters, m._buffers):
                for name, t in d.items():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    slots.append((d, name))
        self._slots = slots
        self.tensors = [d[n] for d, n in slots]
        self._is_buffer = [any(d is m._buffers for m in self.modules) for d, _ in slots]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        # Holding the storages (not only the tensors, whose ``.data`` can be swapped) is what
        # makes an equal address mean the same memory.
        self._held = [t.untyped_storage() for t in self.tensors]
        self._indices = list(range(len(self.tensors)))

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

    def changed(self) -> str | None:
        """Why the statics differ from the last scan, or None. Cheap: called on every call."""
        if self._generation != _generation:
            old_ptrs, old_modules = self.ptrs, self.modules
            self.rescan()
            if self.ptrs != old_ptrs:
                return "a parameter or buffer was replaced or moved"
            if len(self.modules) != len(old_modules) or any(
                    a is not b for a, b in zip(self.modules, old_modules)):
                return "a submodule was replaced"
            return None
        # No structural write since the scan (the dicts are watched): the scanned tensor objects
        # are still the module's; only ``.data`` swaps can have moved them.
        current = self.tensors
        if _ptrs_equal is not None:
            same = _ptrs_equal(current, self.ptrs, self._indices)
        else:
            same = [t.data_ptr() for t in current] == self.ptrs
        if same:
            return None
        names = _first_moved(self._slots, current, self.ptrs)
        self.rescan()
        return f"parameter or buffer {names} moved to new memory"


def _first_moved(slots: Sequence[tuple[dict, str]], current: list, ptrs: list[int]) -> str:
    for (d, name), t, p in zip(slots, current, ptrs):
        if t is None or t.data_ptr() != p:
            return repr(name)
    return "?"
