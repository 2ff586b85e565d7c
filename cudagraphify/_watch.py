"""What a forward reads and writes in modules, and the epoch that tells when any of it changed.

- **The epoch**: one global counter, bumped by every write to a module a graph depends on (a
  *watched* one, see :mod:`._statics`) that no per-call check can see:
  ``nn.Module.__setattr__``/``__delattr__`` (patched once, on first use), and module hook
  registration and removal. Modules no graph reads never bump it.
- **Recording**: while a :class:`Recorder` is active on a thread, ``nn.Module.__getattribute__``
  records every instance attribute a module's code reads (``self.scale``, ``self.training``,
  ``self.config``) with the value read, module pre-hooks record which modules ran, and the
  patched ``__setattr__`` records the attributes the run changes.
- **Hooks**: which modules have hooks, the process's global module hooks (cudagraphify's own
  probes' excepted).

:mod:`._guards` turns what a run read into per-graph guards.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.utils import hooks as _torch_hooks

from ._signature import is_constant, strict_key
from ._statics import KEPT_MARK, REGISTRIES, _WatchedDict, generation, rewatch, watched

__all__ = ["epoch", "bump", "tree_epoch", "install", "Read", "Recorder", "recording", "hooked",
           "hook_fingerprint", "global_hooks", "global_hooks_present", "own_global_hook",
           "From", "INTERNAL_ATTRS", "MISSING", "same", "short", "setting", "set_again"]

_counter = itertools.count(1)
epoch = 0  # read as ``_watch.epoch``: bumped by every module write the per-call path cannot see


def bump(*_args: Any) -> None:
    """Something a graph may depend on changed: every state guard checks itself again."""
    global epoch
    epoch = next(_counter)  # unique per bump, so two threads bumping never look unchanged


_hooks_epoch = 0  # bumped by module hook registration and removal only (see tree_epoch)


def tree_epoch() -> tuple[int, int]:
    """What moves when a watched module's registries are written (a submodule set, replaced or
    removed: :func:`._statics.generation`), a module hook is registered or removed, a watched
    module's hooks dict is set anew, or any module's class is set through ``nn.Module``'s
    ``__setattr__``; a plain attribute write moves ``epoch`` only. For a guard on module trees
    and their hooks, compared once ``epoch`` moved: it walks the trees again only when this
    moved too."""
    return generation(), _hooks_epoch


_installed = False
_install_lock = threading.Lock()
_HOOK_METHODS = ("register_forward_hook", "register_forward_pre_hook", "register_backward_hook",
                 "register_full_backward_hook", "register_full_backward_pre_hook")
_GLOBAL_HOOK_FUNCTIONS = ("register_module_forward_hook", "register_module_forward_pre_hook",
                          "register_module_backward_hook", "register_module_full_backward_hook",
                          "register_module_full_backward_pre_hook")


def _bumping(fn: Callable, watched_only: bool = False) -> Callable:
    """``fn`` (a hook's registration or removal) that bumps the epoch and the hooks' epoch
    after it ran (for a module method with ``watched_only``: only when a graph depends on the
    module)."""
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if not watched_only or (args and watched(args[0])):
                global _hooks_epoch
                _hooks_epoch = next(_counter)  # (first: who sees the new epoch sees this)
                bump()

    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def _noting(register: Callable) -> Callable:
    """``register_buffer``/``register_parameter`` called by a forward (not inside the patched
    ``nn.Module.__setattr__`` of that module, whose write is noted already) noting the write
    to this thread's recorder, as ``__setattr__`` does: a forward that registers its argument
    anew on every call is a write a replay cannot repeat (its capture's run would leave the
    static copy registered)."""
    registry, keyword = ("_buffers", "tensor") if register.__name__ == "register_buffer" \
        else ("_parameters", "param")

    @functools.wraps(register)
    def wrapper(self, *args, **kwargs):
        d = self.__dict__
        rec = _recorders.get(threading.get_ident()) if _recorders else None
        if rec is None or rec.setting is self or (
                type(d.get("_parameters")) is not _WatchedDict and KEPT_MARK not in d):
            return register(self, *args, **kwargs)
        name = args[0] if args else kwargs.get("name")
        value = args[1] if len(args) > 1 else kwargs.get(keyword)
        if not isinstance(name, str) or name not in d.get(registry, ()):
            return register(self, *args, **kwargs)
        return _noted(rec, self, name, value, register, self, *args, **kwargs)
    return wrapper


def _noted(rec: "Recorder", module: nn.Module, name: str, value: Any, write: Callable,
           *args, **kwargs) -> Any:
    """``write(*args, **kwargs)``, the write of ``module.name = value``, noted to ``rec``
    first; the note forgotten where the write raises (a registry write that did not happen)."""
    undo = rec.wrote(module, name, value)
    try:
        return write(*args, **kwargs)
    except BaseException:
        if undo is not None:
            undo()
        raise


def install() -> None:
    """Patch, once per process, the writes that bump the epoch (see the module docs)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        cls = nn.Module
        set_attr, del_attr = cls.__setattr__, cls.__delattr__

        def __setattr__(self, name, value):  # noqa: N807 - the patched special method
            global _hooks_epoch, epoch
            d = self.__dict__
            if type(d.get("_parameters")) is not _WatchedDict and KEPT_MARK not in d:
                # (no graph reads it; a plain attribute of a module a recorder names is noted,
                # see ``Recorder.everything``)
                rec = _recorders.get(threading.get_ident()) if _everything else None
                if rec is not None and id(self) in rec.everything \
                        and not isinstance(value, (nn.Module, nn.Parameter)) \
                        and not any(name in d.get(k, ()) for k in REGISTRIES):
                    rec.wrote(self, name, value)
                set_attr(self, name, value)
                if name == "__class__":  # (any module's: a guard may hold its class, see
                    _hooks_epoch = next(_counter)  # _guards._ClassCheck)
                    epoch = next(_counter)
                return None
            rec = _recorders.get(threading.get_ident())
            if rec is not None:
                rec.setting = self  # (its register_buffer/_parameter: noted here, see _noting)
                try:
                    _noted(rec, self, name, value, set_attr, self, name, value)
                finally:
                    rec.setting = None
            else:
                set_attr(self, name, value)
            if name in REGISTRIES:  # (a new registry: ``ModuleList.__delitem__``'s)
                rewatch(self, name)
            elif name in _TREE_ATTRS:  # (another class, hooks dict: another tree)
                _hooks_epoch = next(_counter)
            epoch = next(_counter)  # after the write: a check in between sees the old epoch

        def __delattr__(self, name):  # noqa: N807
            del_attr(self, name)
            if watched(self):
                global epoch
                epoch = next(_counter)

        cls.__setattr__ = __setattr__
        cls.__delattr__ = __delattr__
        for name in ("register_buffer", "register_parameter"):
            setattr(cls, name, _noting(getattr(cls, name)))
        for name in _HOOK_METHODS:
            setattr(cls, name, _bumping(getattr(cls, name), watched_only=True))
        for name in _GLOBAL_HOOK_FUNCTIONS:
            fn = getattr(_module_mod, name, None)
            if fn is not None:
                setattr(_module_mod, name, _bumping(fn))
                if getattr(torch.nn.modules, name, None) is fn:
                    setattr(torch.nn.modules, name, getattr(_module_mod, name))
        _torch_hooks.RemovableHandle.remove = _bumping(_torch_hooks.RemovableHandle.remove)
        _installed = True


# -- hooks ---------------------------------------------------------------------------------

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")


# attributes whose write changes what a module tree runs besides its registries: each moves
# tree_epoch (a hooks dict set anew, ``m._forward_hooks = other._forward_hooks``; the class)
_TREE_ATTRS = frozenset((*_HOOK_DICTS, "__class__"))


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own."""
    d = module.__dict__
    return any(d.get(name) for name in _HOOK_DICTS[:4])


def hook_fingerprint(modules: list[weakref.ref]) -> tuple:
    """Which hooks each of ``modules`` (held weakly) and the process (global module hooks)
    has: compared again when the epoch moves. A deleted module counts as a change."""
    own = []
    for i, ref in enumerate(modules):
        m = ref()
        if m is None:
            own.append((i, None))
        elif hooked(m):
            own.append((i, tuple(tuple(m.__dict__.get(n, ())) for n in _HOOK_DICTS[:4])))
    return tuple(own), _global_hook_ids()


_OWN_HOOKS: set[int] = set()  # handle ids of the global hooks cudagraphify's probes register


def _global_hook_ids() -> tuple:
    # (each dict's keys taken at once, in C: another thread's probe registers and removes its
    # own global hook meanwhile, and a generator over the dict itself raised "OrderedDict
    # mutated during iteration" out of a call)
    return tuple(tuple(k for k in tuple(getattr(_module_mod, n, ())) if k not in _OWN_HOOKS)
                 for n in _GLOBAL_HOOK_DICTS)


_GLOBAL_DICTS = tuple(getattr(_module_mod, n) for n in _GLOBAL_HOOK_DICTS)


def global_hooks_present() -> bool:
    """Whether any global module hook is registered at all (cudagraphify's own included): a
    few dict reads, for the per-call checks (a hook registered through a name bound before
    cudagraphify patched the registration functions bumps no epoch)."""
    a, b, c, d = _GLOBAL_DICTS
    return bool(a or b or c or d)


def global_hooks() -> bool:
    """Whether the process has global module hooks (besides cudagraphify's own probes')."""
    return any(_global_hook_ids())


@contextlib.contextmanager
def own_global_hook(register: Callable, hook: Callable, **kwargs) -> Iterator[None]:
    """``register(hook)`` (a ``register_module_*_hook``) for the block: cudagraphify's own,
    so it does not count as the user's global hook (see :func:`global_hooks`)."""
    handle = getattr(register, "__wrapped__", register)(hook, **kwargs)  # no epoch bump
    _OWN_HOOKS.add(handle.id)
    try:
        yield
    finally:
        remove = type(handle).remove
        getattr(remove, "__wrapped__", remove)(handle)
        _OWN_HOOKS.discard(handle.id)


# -- recording reads -------------------------------------------------------------------------

# Module attributes that are torch's own bookkeeping (hooks and registries) or cudagraphify's:
# they are guarded elsewhere (statics, hooks) or not at all (state dict hooks).
INTERNAL_ATTRS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_cudagraphify_state", "_cudagraphify_share", "forward",
    "_compiled_call_impl", "__dict__", "__class__",
})

_recorders: dict[int, "Recorder"] = {}  # thread id -> the recorder active on that thread
_patch_users = 0
_everything = 0  # active recorders of unwatched modules' sets (``Recorder.everything``)
_patch_lock = threading.Lock()
_object_getattribute = object.__getattribute__
_get_ident = threading.get_ident
_module_getattr = nn.Module.__getattr__
_getframe = sys._getframe
# code that reads a module's __dict__ for its own lookups, not a forward's: torch's, ours
_OWN_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))
_OWN_DIR = _OWN_DIRS[1]  # (cudagraphify's)


def nested_codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code objects nested in it (comprehensions, lambdas, inner functions):
    what reading a function's bytecode for the names it loads must read."""
    codes, todo = [], [code]
    while todo:
        c = todo.pop()
        codes.append(c)
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return codes


def _recording_getattribute(self, name):
    if name in INTERNAL_ATTRS:  # (most reads: _call_impl's of the hook dicts)
        if name == "__dict__":  # (torch's own lookups read it: Module.__getattr__)
            rec = _recorders.get(_get_ident())
            if rec is not None and not _getframe(1).f_code.co_filename.startswith(_OWN_DIRS):
                # a forward's own read of its attributes' dict (``self.__dict__.get("s", 1)``,
                # ``vars(self)``): the dict is read, what it holds watched (see StateGuard)
                d = _object_getattribute(self, name)
                rec.read(self, "__dict__", d)
                return d
        return _object_getattribute(self, name)
    rec = _recorders.get(_get_ident())
    if rec is None:
        return _object_getattribute(self, name)
    d = _object_getattribute(self, "__dict__")
    if name not in d:
        cls = type(self)
        if cls.__getattr__ is _module_getattr and cls.__getattribute__ is _recording_getattribute:
            # A parameter, buffer or submodule (the common case) is what Module.__getattr__
            # returns once object.__getattribute__ has raised: returned here without the two
            # exceptions, where nothing on the class comes first (and the class has neither
            # lookup of its own). Registries are not reads.
            for k in REGISTRIES:
                registry = d.get(k)
                if registry is not None and name in registry:
                    if _class_attribute(cls, name) is not MISSING:
                        break
                    return registry[name]
    try:
        value = _object_getattribute(self, name)
    except AttributeError:
        # Not an attribute: Module.__getattr__ looks in the registries next. Where it is in
        # none, the lookup fails (``getattr(self, name, default)``, ``hasattr``): that it is
        # absent is what the run read.
        if not any(name in d.get(k, ()) for k in REGISTRIES):
            rec.read(self, name, MISSING)
        raise
    if name in d:
        if d[name] is value:
            key = (id(self), name)
            if key not in rec.reads:  # (Recorder.read, inlined: most reads are of these)
                rec.reads[key] = Read(self, name, value, False)
    else:
        raw = _class_attribute(type(self), name)
        if raw is value and not callable(raw):  # plain data on the class, not a descriptor
            rec.read(self, name, value, on_class=True)
        elif type(raw) in METHOD_KINDS:
            # a method of its class: what runs is the class's function until one is set on
            # the instance (``m.helper = f``, a module write: compared then, see Read.now).
            # The module held weakly: a read of a method keeps no module alive (one reached
            # through a weak proxy must die when its owner lets it: see _guards._ClassCheck).
            # (not nn.Module's own, ``self._call_impl`` in every call, ``named_modules``,
            # nor ours; torch's other reads are: ``self._conv_forward`` in Conv1d.forward)
            key = (id(self), name)
            if key not in rec.reads:
                where = _getframe(1).f_code.co_filename
                if where == _MODULE_FILE or where.startswith(_OWN_DIR):
                    return value
                read = rec.reads[key] = Read(self, name, raw, True)
                read._module = weakref.ref(self)
    return value


# what a class holds as its methods (a read of one is of the class's function, held by identity)
METHOD_KINDS = (types.FunctionType, staticmethod, classmethod)
_MODULE_FILE = nn.modules.module.__file__  # (nn.Module's own methods' reads: not recorded)


def _class_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return MISSING


class Read:
    """An attribute a run read: its value (``MISSING``: the lookup failed), and whether it was
    found on the module's class rather than on the module.

    The module is held strongly, or weakly in the copy :meth:`held_weakly` makes: a guard sits
    in a cache entry, and a shared or a region's cache must not keep a deleted module (and its
    graphs) alive through it. Once a weakly held module is gone, ``module`` is None and
    :meth:`now` reads ``GONE``, which matches no value."""

    __slots__ = ("_module", "name", "_value", "on_class")

    def __init__(self, module: nn.Module, name: str, value: Any, on_class: bool = False):
        self._module = module
        self.name, self._value, self.on_class = name, value, on_class

    def held_weakly(self, owned: frozenset[int]) -> "Read":
        """A copy that holds its module weakly, and its value too where the value leads back
        to a module of ``owned`` (ids): such a module itself (a parent kept as a plain
        attribute), or a bound method of one (``self.act = self._gelu_python``, as HF's
        GELUActivation keeps)."""
        read = Read(self._module, self.name, self._value, self.on_class)
        if type(self._module) is not weakref.ReferenceType:  # (a method's read: weak already)
            read._module = weakref.ref(self._module)
        v = self._value
        if isinstance(v, nn.Module) and id(v) in owned:
            read._value = _WeakValue(v, None)
        elif type(v) is types.MethodType and id(v.__self__) in owned \
                and isinstance(v.__self__, nn.Module):
            read._value = _WeakValue(v.__self__, v.__func__)
        return read

    @property
    def value(self) -> Any:
        v = self._value
        return v.get() if type(v) is _WeakValue else v

    def holds(self, now: Any) -> bool:
        """Whether ``now`` would drive a forward as the value read did."""
        v = self._value
        return v.matches(now) if type(v) is _WeakValue else same(now, v)

    @property
    def module(self) -> nn.Module | None:
        m = self._module
        return m() if type(m) is weakref.ReferenceType else m

    def now(self) -> Any:
        """What a run would read now."""
        module = self._module
        if type(module) is weakref.ReferenceType:
            module = module()
            if module is None:
                return GONE
        if self.name == "__dict__":  # (read whole: see _recording_getattribute)
            return module.__dict__
        mine = module.__dict__.get(self.name, MISSING)
        if mine is not MISSING or not self.on_class:
            return mine
        return _class_attribute(type(module), self.name)

    def __repr__(self) -> str:
        return (f"Read({type(self.module).__name__}.{self.name}={short(self.value)}"
                f"{', on its class' if self.on_class else ''})")


class _WeakValue:
    """A value read that leads back to a module of the callable's own tree, held weakly: the
    module, or (``func`` set) a bound method of it."""

    __slots__ = ("ref", "func")

    def __init__(self, module: nn.Module, func: Any):
        self.ref, self.func = weakref.ref(module), func

    def get(self) -> Any:
        m = self.ref()
        if m is None:
            return GONE
        return m if self.func is None else types.MethodType(self.func, m)

    def matches(self, now: Any) -> bool:
        m = self.ref()
        if m is None:
            return False
        if self.func is None:
            return now is m
        return type(now) is types.MethodType and now.__self__ is m and now.__func__ is self.func


class _InRegistry:
    """What a registry (``_parameters``, ``_buffers``, ``_modules``) held under a name before a
    run set it anew (see :meth:`Recorder.wrote`)."""

    __slots__ = ("registry", "value")

    def __init__(self, registry: str, value: Any):
        self.registry, self.value = registry, value


class Recorder:
    """What one run of a forward read from modules, which modules ran, and which module
    attributes it changed."""

    def __init__(self, everything: frozenset[int] = frozenset()):
        # (``everything``: the ids of modules whose plain attributes' sets are noted though no
        # graph reads them: a share_graph group's layers, whose runs are no calls; not a
        # registry's, and not those of a module made since, in the runs, whose own set-up
        # they are)
        self.everything = everything
        self.reads: dict[tuple[int, str], Read] = {}
        self.called: dict[int, nn.Module] = {}
        self.writes: list[tuple[nn.Module, str, Any, Any]] = []
        self.setting: nn.Module | None = None  # the module whose __setattr__ runs (_noting)
        # (the attributes set to the constant or the object they held: ``self.used = True`` on
        # a call after the first, a per-signature ``self.last_n = x.shape[0]``,
        # ``self.keep = self.value``; see ``set_again``)
        self.sets: list[tuple[nn.Module, str, Any]] = []
        self._thread = threading.get_ident()

    def read(self, module: nn.Module, name: str, value: Any, on_class: bool = False) -> None:
        key = (id(module), name)
        if key not in self.reads:  # the first read is what the run's code saw first
            self.reads[key] = Read(module, name, value, on_class)

    def wrote(self, module: nn.Module, name: str, value: Any) -> Callable[[], None] | None:
        """Note that ``module.name = value`` is about to be set; for a registry's name, what
        forgets the note if the set raises."""
        d = module.__dict__
        if name in INTERNAL_ATTRS:
            return None
        registry = next((k for k in REGISTRIES if name in d.get(k, ())), None)
        if registry is not None:
            # a parameter, buffer or submodule set anew: the statics guard sees the change on
            # the next call, but what a run that is not a call (a capture's) binds there, its
            # static copy of an argument (``self.seen = x``, ``nn.Parameter(x)``), must be
            # put back, and a forward that sets one on every call is refused as any other
            # attribute write is (a replay cannot repeat it). One entry per name: a forward
            # that sets it back to what it held (a swap for a masked run) wrote nothing
            old = d[registry][name]
            if old is value:
                return None
            writes = self.writes
            for k, (m, n, was, _) in enumerate(writes):
                if m is module and n == name and type(was) is _InRegistry:
                    entry = writes[k]
                    if was.value is value:
                        del writes[k]
                        return lambda: writes.insert(k, entry)
                    writes[k] = (module, name, was, value)
                    return lambda: writes.__setitem__(k, entry)
            writes.append((module, name, _InRegistry(registry, old), value))
            return writes.pop
        old = d.get(name, MISSING)
        if not same(old, value):
            self.writes.append((module, name, old, value))
        else:  # (a constant it held, or the very object: ``self.keep = self.value``)
            self.sets.append((module, name, value))
        return None

    def undo(self) -> None:
        """Put back the module attributes the run changed (the last write first): a run that
        was not a call (an extra warm-up, a capture's)."""
        for module, name, old, new in reversed(self.writes):
            if type(old) is _InRegistry:
                registry = module.__dict__.get(old.registry)
                # (only where what the run set is still there: a training capture's registries
                # held stand-ins of the parameters, put back since, see _statics.stand_ins)
                if registry is not None and registry.get(name, MISSING) is new:
                    registry[name] = old.value
            elif old is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
        if self.writes:
            bump()

    def _pre(self, module, args):
        if threading.get_ident() == self._thread:
            self.called.setdefault(id(module), module)


def setting(replay: Callable[[], None], sets: tuple) -> Callable[[], None]:
    """``replay`` followed by :func:`set_again` (an inference graph's replay, whichever path
    calls it)."""
    def run():
        replay()
        set_again(sets)
    return run


class From:
    """In a set made again (see ``set_again``): the object module ``ref()``'s own attribute
    ``name`` holds at the replay, which the forward read and set as it was (``self.keep =
    self.value``; see ``_first_call._sets``). The guard checks that read on every replay, and
    the object is not kept alive here."""

    __slots__ = ("ref", "name")

    def __init__(self, module: nn.Module, name: str):
        self.ref, self.name = weakref.ref(module), name

    def get(self) -> Any:
        m = self.ref()
        return MISSING if m is None else m.__dict__.get(self.name, MISSING)

    @staticmethod
    def find(value: Any, reads: dict, tree: frozenset[int]) -> "From | None":
        """The attribute of its own of a module of ``tree`` (ids) that a run read ``value``
        from, by identity (``reads``: a :class:`Recorder`'s), and that holds it still; None
        where there is none."""
        for read in reads.values():
            module = read.module
            if not read.on_class and read.value is value and module is not None \
                    and id(module) in tree and module.__dict__.get(read.name, MISSING) is value:
                return From(module, read.name)
        return None


def set_again(sets: tuple) -> None:
    """Set again the module attributes a graph's forward sets to a constant, or to the object
    another attribute it read holds (``(weakref of the module, name, value)``, the value a
    :class:`From` then; see ``Recorder.sets`` and ``_first_call._sets``), as the forward would
    have: a user may have changed one since (a flag reset), or another signature's call set its
    own value. A change bumps the epoch, as a forward's set does (a guard that read the old
    value checks again)."""
    changed = False
    for ref, name, value in sets:
        module = ref()
        if module is not None:
            if type(value) is From:
                value = value.get()
                if value is MISSING:  # (its module gone, or its attribute: no set)
                    continue
            d = module.__dict__
            if d.get(name, MISSING) is not value:
                d[name] = value
                changed = True
    if changed:
        bump()


class CallImpl:
    """Base of cudagraphify's own ``_compiled_call_impl`` of a graphed module (held there as a
    bound method): it does what ``_call_impl`` would do, so a module holding one runs as a
    module holding none."""

    __slots__ = ()


class PlainCall(functools.partial):
    """What a given-back piece holds as its ``_compiled_call_impl`` instead of a DirectCall:
    ``partial(nn.Module._call_impl, module)``, which runs as no override does, at the cost of
    a C call (see ``_wrap._retire_piece``); its own type, so that it is never taken for a
    user's override (an ``_call_impl`` bound to another module)."""

    __slots__ = ()


def own_call_impl(value: Any) -> bool:
    """Whether a module's ``_compiled_call_impl`` is cudagraphify's own: a bound method of a
    :class:`CallImpl`, or a :class:`PlainCall`."""
    return type(value) is PlainCall or isinstance(getattr(value, "__self__", None), CallImpl)


def call_override(module: nn.Module) -> Any:
    """What a module's ``__call__`` runs instead of ``_call_impl`` (``module.compile()`` sets
    it): None where that is ``_call_impl`` itself, or cudagraphify's own :class:`CallImpl`."""
    value = module.__dict__.get("_compiled_call_impl")
    return None if own_call_impl(value) else value


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class _Gone:
    def __repr__(self) -> str:
        return "<module deleted>"


GONE = _Gone()  # what a Read of a deleted module reads now


@contextlib.contextmanager
def recording(rec: Recorder, ran: bool = True) -> Iterator[Recorder]:
    """Record, on this thread, the module attributes read and the modules run (see module docs;
    ``ran=False``: not the modules run, whose global pre-hook would send every graphed
    module's call through ``_call_impl``)."""
    global _patch_users, _everything
    install()
    with _patch_lock:
        _patch_users += 1
        _everything += bool(rec.everything)
        if _patch_users == 1:
            nn.Module.__getattribute__ = _recording_getattribute
    tid = threading.get_ident()
    outer = _recorders.get(tid)
    _recorders[tid] = rec
    try:
        with own_global_hook(_module_mod.register_module_forward_pre_hook, rec._pre) if ran \
                else contextlib.nullcontext():
            yield rec
    finally:
        if outer is not None:
            _recorders[tid] = outer
        else:
            _recorders.pop(tid, None)
        with _patch_lock:
            _patch_users -= 1
            _everything -= bool(rec.everything)
            if _patch_users == 0:
                del nn.Module.__getattribute__


def same(a: Any, b: Any) -> bool:
    """Whether two attribute values would drive a forward the same way."""
    if a is b:
        return True
    if type(a) is not type(b) or not is_constant(a):
        return False
    try:  # (``0.0`` and ``-0.0`` differ, ``(2,)`` and ``(2.0,)`` too; NaN equals NaN)
        return strict_key(a) == strict_key(b)
    except Exception:  # noqa: BLE001 - an __eq__ that raises: not the same
        return False


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
