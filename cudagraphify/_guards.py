"""Per-graph guards: what a replay must see besides its arguments.

A graph replays fixed kernels with fixed scalars on fixed memory. Everything a forward's Python
read to choose them must still hold when the graph replays:

- :class:`StateGuard` — the module attributes the capture's run read (recorded by
  :mod:`._watch`), compared again when the epoch moved; mutable values (a dict, a list, a
  dataclass or an HF config) on every call (dict versions, snapshots); tensors kept as plain
  attributes, or named by a graphed function (closure cells, globals), held and checked
  (address, layout, and for CPU scalars their value); the hooks of the modules it runs.
- :class:`FlagsGuard` — global flags that change which kernels run: Dynamo's
  ``GlobalStateGuard`` (grad mode, autocast, default dtype, deterministic algorithms, TF32 and
  reduced-precision matmul) and the others (cuDNN flags, fp32 precision, SDPA backends, fp16
  accumulation, BLAS and linalg backends, the current device).

Not seen (documented): class attributes changed on the class, writes straight into a module's
``__dict__`` or through ``object.__setattr__``, non-tensor Python globals.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import dis
import enum
import functools
import gc
import inspect
import itertools
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

from . import _watch, _writes
from ._signature import MEMBER_ATTRS, _frozen_fields, is_constant, storage_of
from ._state import host_bits, object_dict
from ._statics import MAPPING_VIEWS, no_one_layout, ptrs_equal, watch
from ._watch import (GONE, INTERNAL_ATTRS, METHOD_KINDS, MISSING, Read, call_override,
                     global_hooks_present, nested_codes, same, short)

__all__ = ["StateGuard", "FlagsGuard", "Unguardable", "function_bindings"]

# -- global flags --------------------------------------------------------------------------

_C = torch._C
_GlobalStateGuard = torch._C._dynamo.guards.GlobalStateGuard


def _getter(name: str, *args: Any) -> Callable[[], Any]:
    """A getter of a flag: the C function itself (bound to ``args`` where it takes some), or a
    stand-in returning None where this build lacks it or it refuses the arguments."""
    fn = getattr(_C, name, None)
    if fn is None:
        return lambda: None
    if args:
        try:
            fn(*args)
        except RuntimeError:
            return lambda: None
        return functools.partial(fn, *args)  # still one C call
    return fn


# cuDNN's TF32 flag: where torch has per-operation fp32 precision (2.9 and later), the
# legacy ``allow_tf32`` is derived from the conv and RNN precisions, and reading it raises
# once they differ (``cudnn.conv.fp32_precision = "ieee"`` alone): read those instead.
_TF32 = (("fp32 precision (conv)", _getter("_get_fp32_precision_getter", "cuda", "conv")),
         ("fp32 precision (rnn)", _getter("_get_fp32_precision_getter", "cuda", "rnn"))) \
    if hasattr(_C, "_get_fp32_precision_getter") else \
    (("cudnn.allow_tf32", _getter("_get_cudnn_allow_tf32")),)
_CUDNN = (("cudnn.enabled", _getter("_get_cudnn_enabled")),
          ("cudnn.benchmark", _getter("_get_cudnn_benchmark")),
          ("cudnn.deterministic", _getter("_get_cudnn_deterministic")),
          *_TF32)
_priority = _getter("_get_sdp_priority_order")
_SDPA = (("flash SDPA", _getter("_get_flash_sdp_enabled")),
         ("mem-efficient SDPA", _getter("_get_mem_efficient_sdp_enabled")),
         ("math SDPA", _getter("_get_math_sdp_enabled")),
         ("cuDNN SDPA", _getter("_get_cudnn_sdp_enabled")),
         ("math SDPA fp16/bf16 reduction", _getter("_get_math_sdp_allow_fp16_bf16_reduction")),
         ("SDPA priority", _priority))
_OTHERS = (("fp16 accumulation", _getter("_get_cublas_allow_fp16_accumulation")),
           ("BLAS backend", _getter("_get_blas_preferred_backend")),
           ("linalg backend", _getter("_get_linalg_preferred_backend")))
_device = getattr(_C, "_cuda_getDevice", None)
_cuda = torch.cuda


def _current_device():
    # (once CUDA is up: asking earlier would initialise it; None on a build without CUDA)
    return _device() if _cuda._initialized and _device is not None else None


def _compile_reader(getters) -> Callable[[], tuple]:
    """One frame that calls each getter (most are C functions) and makes the tuple. A getter
    that returns a pybind enum (the BLAS and linalg backends) is read as the enum's value: two
    enums compare through a Python-level ``__eq__``, ints in C."""
    names = [f"g{i}" for i in range(len(getters))]
    reads = [f"{n}().value" if hasattr(type(read()), "__members__") else f"{n}()"
             for n, (_, read) in zip(names, getters)]
    return eval(f"lambda {', '.join(f'{n}={n}' for n in names)}: "  # noqa: S307
                f"({', '.join(reads)},)",
                dict(zip(names, (read for _, read in getters))))


def dual_level() -> int:
    """The forward-mode AD level open (-1: none). A graph carries no tangents: inside one, calls
    run eagerly; entering and leaving it moves :data:`flags_epoch` (see
    :func:`watch_flag_setters`)."""
    return _forward_ad._current_level


_read_flags = _compile_reader([*_CUDNN, *_SDPA, *_OTHERS, ("forward-mode AD level", dual_level),
                               ("current device", _current_device)])


def device_reader() -> Callable[[], Any] | None:
    """The current device's getter as the replay path calls it: the C function itself once
    CUDA is up (a graph exists: it is), else what the flags read; None where CUDA is up with
    one device (nothing can make another one current: the check would be vacuous)."""
    if _cuda._initialized and _device is not None:
        return _device if _cuda.device_count() > 1 else None
    return _current_device


# The setters of the flags above (all but the current device), as torch's Python API reaches
# them: through ``torch._C`` at call time, or held by torch.backends.cudnn's properties.
# Each is wrapped once to move :data:`flags_epoch` after it ran, so that the replay path
# reads the flags again only after one of them ran.
_SETTERS = ("_set_cudnn_enabled", "_set_cudnn_benchmark", "_set_cudnn_deterministic",
            "_set_cudnn_allow_tf32", "_set_fp32_precision_setter",
            "_set_float32_matmul_precision", "_set_sdp_use_flash", "_set_sdp_use_mem_efficient",
            "_set_sdp_use_math", "_set_sdp_use_cudnn", "_set_sdp_use_overrideable",
            "_set_sdp_use_fa3", "_set_math_sdp_allow_fp16_bf16_reduction",
            "_set_sdp_priority_order", "_set_cublas_allow_fp16_accumulation",
            "_set_blas_preferred_backend", "_set_linalg_preferred_backend")
_flag_ticks = itertools.count(1)
flags_epoch = 0  # read as ``_guards.flags_epoch``: moved by every flag setter's call
_setters_lock = threading.Lock()
_setters_watched = False


def _ticking(setter: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        try:
            return setter(*args, **kwargs)
        finally:
            global flags_epoch
            flags_epoch = next(_flag_ticks)  # unique: two threads' moves never cancel out

    wrapper.__name__ = wrapper.__qualname__ = setter.__name__
    wrapper.__doc__ = setter.__doc__
    wrapper.__wrapped__ = setter
    return wrapper


def watch_flag_setters() -> None:
    """Wrap the flag setters (once per process): in ``torch._C``, and in every
    ``torch.backends`` property (``ContextProp``) that already holds one."""
    global _setters_watched
    with _setters_lock:
        if _setters_watched:
            return
        wrapped = {}
        for name in _SETTERS:
            setter = getattr(_C, name, None)
            if setter is not None and not hasattr(setter, "__wrapped__"):
                wrapped[setter] = _ticking(setter)
                setattr(_C, name, wrapped[setter])
        for name in ("enter_dual_level", "exit_dual_level"):  # (``dual_level`` calls them)
            fn = getattr(_forward_ad, name, None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                setattr(_forward_ad, name, _ticking(fn))
        context_prop = getattr(torch.backends, "ContextProp", None)
        backends = [m for name, m in list(sys.modules.items())
                    if name.startswith("torch.backends")] if context_prop is not None else []
        for mod in backends:
            for prop in list(vars(type(mod)).values()):
                if isinstance(prop, context_prop) and getattr(prop, "setter", None) in wrapped:
                    prop.setter = wrapped[prop.setter]
        _setters_watched = True


class FlagsGuard:
    """Global flags as they were when a graph was captured.

    Dynamo's ``GlobalStateGuard`` (grad mode, autocast, default dtype, deterministic
    algorithms, TF32 and reduced-precision matmul) in one C call, plus, in one compiled frame
    of C calls: the cuDNN flags and fp32 precision for convolutions and RNNs, the SDPA backends
    and their priority, fp16 accumulation, the BLAS and linalg backends, the current device.
    (All of them, whatever the run's ops: an op can reach cuDNN or SDPA from inside another
    torch function, where no probe sees it. Inference mode is part of every key, and of the
    tensor guards.)

    ``check()`` reads them all (the slow path). The replay path (:class:`~._fast.Fast`) checks
    the global state and (on a host with several GPUs) the current device on every call, and
    reads the other flags again only when :data:`flags_epoch` moved since ``epoch``, that is
    when one of their setters ran (see :func:`watch_flag_setters`)."""

    __slots__ = ("global_state", "flags", "epoch")

    read = staticmethod(_read_flags)  # the flags other than the global state's, as a tuple

    def __init__(self):
        watch_flag_setters()
        self.global_state = _GlobalStateGuard()
        self.epoch = flags_epoch  # (read first: a setter running meanwhile moves it again)
        self.flags = _read_flags()

    def check(self) -> bool:
        return self.global_state.check() and _read_flags() == self.flags

    def flags_since(self, epoch: int) -> int | None:
        """The flags other than the global state's, checked by a holder that last found them
        the same at :data:`flags_epoch` ``epoch``: read again only if a setter ran since. The
        epoch to remember, or None where they differ. (The replay path, :class:`~._fast.Fast`,
        has this inline.)"""
        now = flags_epoch  # (read first: a setter running meanwhile moves it again)
        if now != epoch and _read_flags() != self.flags:
            return None
        return now


# -- guarding what was read ------------------------------------------------------------------

_dict_version = torch._C._dynamo.guards.dict_version
_MAX_WATCHED = 256  # mutable objects watched per graph; beyond that the read is refused


class Unguardable(Exception):
    """A value a forward read cannot be guarded; the message says what and why."""


_IDENTITY_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                   types.BuiltinMethodType, types.MethodWrapperType, types.WrapperDescriptorType,
                   types.ModuleType, type, functools.partial)


# Objects of these packages coordinate (locks, events, queues, loggers): a forward reads no
# data of theirs into a kernel, so they are held by identity, their internals not watched.
_INFRASTRUCTURE = frozenset({"threading", "queue", "asyncio", "multiprocessing", "concurrent",
                             "logging", "weakref", "_thread", "_weakref"})


def _mutable_data(value: Any) -> bool:
    """An array-like container of data that changes in place without a dict or a version
    (a numpy array, an array, a memoryview)."""
    if isinstance(value, (array.array, memoryview)):
        return True
    return type(value).__module__.split(".")[0] == "numpy" and hasattr(value, "shape")


def _watch_value(value: Any, out: list[Callable[[], bool]], tensors: list[torch.Tensor],
                 seen: set[int], depth: int) -> None:
    """Per-call checks that ``value`` (a mutable object a forward read) still holds what it
    held; tensors found inside are collected (held and checked by the caller). Functions,
    methods, classes, modules and objects with no data of their own to read (a lock, a
    sentinel) are held by identity. Raises :class:`Unguardable` for array-like data that
    changes in place with neither a dict nor a version to watch (numpy arrays)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return
    if id(value) in seen:
        return
    if is_constant(value):
        if _own_member(value):
            # an enum member with attributes of its own (``self.scale`` set in its
            # ``__init__``): a constant where its key is taken (an argument), but held here by
            # identity, and ``Mode.A.scale = 3.0`` changes what a forward reads: its attributes
            # checked on every call (and those of members among them)
            seen.add(id(value))
            d = object_dict(value)
            out.append(_DictCheck(d, value))
            for item in list(d.values()):
                if _own_member(item):
                    _watch_value(item, out, tensors, seen, depth + 1)
        else:
            # (such members inside a constant tuple, frozenset, slice or frozen dataclass:
            # ``self.modes = (Mode.A,)``, watched alike)
            for member in _members_within(value):
                _watch_value(member, out, tensors, seen, depth + 1)
        return
    if isinstance(value, _CALLABLE_TYPES):
        # (held by identity; what it reads when called is watched too: see _watch_callable)
        seen.add(id(value))
        _watch_callable(value, out, tensors, seen, depth)
        return
    if isinstance(value, _IDENTITY_TYPES) \
            or type(value).__module__.split(".")[0] in _INFRASTRUCTURE:
        return
    if isinstance(value, nn.Module):
        # its state is the module tree's (guarded as a module it ran, or by identity); its
        # class, compared after a module write (a method of it may run: ``self.items[0].f``;
        # any module's ``__class__`` write moves the epoch)
        seen.add(id(value))
        out.append(_ClassCheck(value))
        return
    seen.add(id(value))
    if len(seen) > _MAX_WATCHED:
        raise Unguardable(f"reads {_MAX_WATCHED}+ mutable objects (containers nested too deep "
                          "to check on every call)")
    if depth > 4:
        raise Unguardable("reads a container nested more than 4 deep")
    owner = None
    if isinstance(value, dict):
        d = value
        extra = object_dict(value)
        if isinstance(extra, dict) and extra:  # (items kept as attributes too: ModelOutput)
            out.append(_DictCheck(extra, value))
            for item in list(extra.values()):
                if _watched(item):
                    _watch_value(item, out, tensors, seen, depth + 1)
    elif isinstance(value, (list, set, frozenset, bytearray, collections.deque)):
        check = _ItemsCheck(value)
        out.append(check)
        for item in check.items:
            if _watched(item):
                _watch_value(item, out, tensors, seen, depth + 1)
        return
    elif isinstance(value, tuple):
        for item in value:
            _watch_value(item, out, tensors, seen, depth + 1)
        return
    elif isinstance(value, MAPPING_VIEWS):
        # a read-only view (``MappingProxyType``, a dict's keys, values or items): it holds
        # nothing of its own, and shows its mapping as it is now: watched as that mapping
        _watch_value(_viewed(value), out, tensors, seen, depth)
        return
    else:
        d = object_dict(value)
        if not isinstance(d, dict):
            if dataclasses.is_dataclass(value) or _writes.slot_names(type(value)):
                # a dataclass with slots, or a plain class with slots: its fields
                check = _FieldsCheck(value)
                out.append(check)
                for item in check.held:
                    _watch_value(item, out, tensors, seen, depth + 1)
                return
            if _mutable_data(value):
                raise Unguardable(f"is a {type(value).__name__}: it can change in place, with "
                                  "no dict or version to watch")
            return  # no state a forward reads as data (a lock, a sentinel): by identity
        owner = value
    out.append(_DictCheck(d, owner))
    for item in list(d.values()):
        if _watched(item):
            _watch_value(item, out, tensors, seen, depth + 1)


def _own_member(value: Any) -> bool:
    """Whether ``value`` is an enum member with attributes of its own, beyond the enum's."""
    if not isinstance(value, enum.Enum):
        return False
    d = object_dict(value)
    return isinstance(d, dict) and not d.keys() <= MEMBER_ATTRS


def _watched(item: Any) -> bool:
    """Whether an item of a container or object a forward read is watched (see
    :func:`_watch_value`): a tensor, or what is not a constant, or a member of its own, or a
    constant that holds one."""
    return isinstance(item, torch.Tensor) or not is_constant(item) or _own_member(item) \
        or next(_members_within(item), None) is not None


def _members_within(value: Any, depth: int = 0):
    """The enum members with attributes of their own inside a constant's items (a tuple's, a
    frozenset's, a slice's start, stop and step, a frozen dataclass's fields), at any depth up
    to 4 (a constant holds no cycle but through a member, whose attributes are watched as its
    own)."""
    if depth > 4:
        return
    if isinstance(value, (tuple, frozenset)):
        items = value
    elif type(value) is slice:
        items = (value.start, value.stop, value.step)
    else:
        items = _frozen_fields(value)  # (a constant's: its class a frozen dataclass)
        if items is None:
            return
    for item in items:
        if _own_member(item):
            yield item
        else:
            yield from _members_within(item, depth + 1)


class _ClassCheck:
    """A module found in what a forward read (held weakly) and its class then; ``proxied``:
    found through a weak proxy (held weakly too, through its target; :func:`_proxy_target`),
    whose target's death moves the epoch and is a change: eager then raises ReferenceError."""

    __slots__ = ("ref", "cls", "proxied")

    def __init__(self, module: Any, proxied: bool = False):
        if type(module) in _PROXIES:  # (``isinstance(proxy, nn.Module)`` holds)
            module, proxied = _proxy_target(module), True
            if module is None:
                raise Unguardable("holds a weak proxy of a module that cannot be told")
        self.ref = weakref.ref(module, _watch.bump) if proxied else weakref.ref(module)
        self.cls = type(module)
        self.proxied = proxied


_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def _proxy_target(proxy: Any) -> Any:
    """The object a live weak proxy stands for (None where it died, or where it cannot be told:
    its ``__init__`` bound to it, through the proxy, is how it is reached; a class's, its
    ``__mro__``'s first)."""
    try:
        if isinstance(proxy, type):  # (``isinstance`` asks the target's class)
            return proxy.__mro__[0]
        target = proxy.__init__.__self__
        # (both through ``__class__``, which a class may answer as it likes: a mock's)
        return target if target.__class__ is proxy.__class__ else None
    except (ReferenceError, AttributeError, IndexError):
        return None


def _viewed(view: Any) -> Any:
    """The mapping a ``MappingProxyType`` or a dict view shows (its one referent)."""
    if not isinstance(view, types.MappingProxyType):
        view = view.mapping  # (a dict view's mapping: a proxy of its dict)
    (mapping,) = gc.get_referents(view)
    return mapping


_CALLABLE_TYPES = (types.FunctionType, types.MethodType, functools.partial, weakref.ref,
                   weakref.ProxyType, weakref.CallableProxyType)


def _watch_callable(fn: Any, out: list, tensors: list, seen: set[int], depth: int) -> None:
    """What a callable a forward read (a module attribute: ``self.post = sched.scale``) reads
    when called, beyond its arguments: a partial's bound arguments and keywords and its
    function; a bound method's object, the attributes its method reads (``_self_reads``; not
    a module's: the module tree is guarded); a function's closure cells (which it names, by
    identity, and the containers, tensors and callables they hold; other objects by identity)
    and its attributes; a weak reference's target (a proxy: its target's attributes). The
    functions of torch and of installed libraries are held by identity: their closures and
    attributes are their own bookkeeping (a wrapper's ``__wrapped__``)."""
    # (the hop through a callable uses up no depth: what it reaches is watched as if it were
    # the attribute itself)
    if isinstance(fn, functools.partial):
        _watch_value(fn.args, out, tensors, seen, depth)
        _watch_value(fn.keywords, out, tensors, seen, depth)
        _watch_value(fn.func, out, tensors, seen, depth)
        d = object_dict(fn)
        if type(fn) is not functools.partial and isinstance(d, dict):
            # (a subclass's attributes: its own ``__call__`` may read them, ``self.scale``)
            out.append(_DictCheck(d, fn))
            for item in list(d.values()):
                if _watched(item):
                    _watch_value(item, out, tensors, seen, depth + 1)
    elif isinstance(fn, types.MethodType):
        owner, func = fn.__self__, fn.__func__
        if isinstance(owner, nn.Module):
            out.append(_ClassCheck(owner))  # (its class: the method runs on it)
        if not isinstance(owner, (nn.Module, type, types.ModuleType)) \
                and isinstance(func, types.FunctionType):
            # (the attributes its method reads, as a graphed callable object's: _self_reads)
            objects: list = []
            bindings: list = []
            _watch_object(owner, func, objects, bindings)
            for _, read, value, _ in bindings:
                out.append(lambda read=read, value=value: same(read(), value))
                if isinstance(value, nn.Module):
                    out.append(_ClassCheck(value))
            for _, obj in objects:
                _watch_value(obj, out, tensors, seen, depth)
        if isinstance(func, types.FunctionType) and id(func) not in seen:
            seen.add(id(func))
            _watch_callable(func, out, tensors, seen, depth)  # (its closure, its defaults)
    elif isinstance(fn, weakref.ref):
        target = fn()
        if isinstance(target, types.MethodType):  # (a WeakMethod: a new one each time)
            out.append(lambda fn=fn, target=target: _same_method(fn(), target))
        else:
            out.append(lambda fn=fn, target=target: fn() is target)
        if isinstance(target, nn.Module):
            out.append(_ClassCheck(target))  # (its class: a method of it may run)
        elif target is not None:
            _watch_value(target, out, tensors, seen, depth)
    elif isinstance(fn, (weakref.ProxyType, weakref.CallableProxyType)):
        try:  # (its target's dict, through the proxy)
            d = object_dict(fn)
            module = isinstance(getattr(fn, "_parameters", None), dict)
        except ReferenceError:  # (a dead proxy: calling it raises, as eagerly)
            return
        target = _proxy_target(fn)
        if target is None:
            raise Unguardable("holds a weak proxy whose target cannot be told (its death, "
                              "after which a read through it raises, would not be seen)")
        try:  # (its target's death: a change, seen at once; see StateGuard._changed)
            out.append(_ClassCheck(target, proxied=True))
        except TypeError:  # (a target that takes no weak reference of its own)
            raise Unguardable("holds a weak proxy of an object that takes no weak reference "
                              "(its death would not be seen)") from None
        if module:  # (its class: a method of it may run; compared by the check above)
            return
        if isinstance(d, dict):
            out.append(_DictCheck(d))
            for item in list(d.values()):
                if _watched(item):
                    _watch_value(item, out, tensors, seen, depth)
    elif isinstance(fn, types.FunctionType) and not _library_function(fn):
        for cell in fn.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            out.append(lambda cell=cell, held=held: _cell_holds(cell, held))
            if isinstance(held, _WATCHED_IN_CLOSURES):
                _watch_value(held, out, tensors, seen, depth)
            elif isinstance(held, nn.Module):
                out.append(_ClassCheck(held))  # (its class: a method of it may run)
            # (any other object it closes over by identity only: what it reads of it is not
            # known, and watching it whole would take a manager's own bookkeeping (a list of
            # orders, a counter) for a change on every call; README)
        # its defaults (``lambda t, cfg=cfg: ...``, a mutable default) and attributes
        defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__
        out.append(lambda fn=fn, held=(defaults, kwdefaults):
                   fn.__defaults__ is held[0] and fn.__kwdefaults__ is held[1])
        for held in defaults or ():
            if isinstance(held, _WATCHED_IN_CLOSURES):
                _watch_value(held, out, tensors, seen, depth)
            elif isinstance(held, nn.Module):
                out.append(_ClassCheck(held))
        if kwdefaults:  # (a dict: ``post.__kwdefaults__["temperature"] = 0.5``)
            _watch_value(kwdefaults, out, tensors, seen, depth)
        if fn.__dict__:  # (a function's attributes: ``scale.factor = 2``)
            _watch_value(fn.__dict__, out, tensors, seen, depth)


_WATCHED_IN_CLOSURES = (dict, list, tuple, set, frozenset, collections.deque,
                        torch.Tensor, enum.Enum) + _CALLABLE_TYPES


def _same_method(now: Any, then: types.MethodType) -> bool:
    return now is not None and now.__self__ is then.__self__ and now.__func__ is then.__func__


def _cell_holds(cell: Any, held: Any) -> bool:
    try:
        now = cell.cell_contents
    except ValueError:
        return False
    return now is held or same(now, held)


def _library_function(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is torch's or an installed library's: its file under site-packages, or
    its package installed into a directory with the distributions' metadata beside it
    (``pip install --target``); not the user's own code (a source checkout, an editable
    install: no ``.dist-info`` beside the package)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return True
    filename = code.co_filename
    if filename.startswith(_LIBRARY_ROOTS) or "site-packages" in filename \
            or "dist-packages" in filename:
        return True
    # (by its code's file, not ``__module__``: a wrapper's ``functools.wraps`` copies the
    # user's)
    folder = os.path.dirname(filename)
    hit = _installed.get(folder)
    if hit is None:
        hit = _installed[folder] = _installed_beside(folder)
    return hit


_LIBRARY_ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,))
_installed: dict[str, bool] = {}  # a code file's folder -> its package installed beside metadata


def _installed_beside(folder: str) -> bool:
    """Whether the package holding ``folder`` (up through its ``__init__.py`` files) lies in a
    directory that holds installed distributions' metadata (``.dist-info``)."""
    try:
        for _ in range(16):
            if not os.path.exists(os.path.join(folder, "__init__.py")):
                break  # (the directory the top-level package lies in)
            folder = os.path.dirname(folder)
        return any(entry.endswith(".dist-info") for entry in os.listdir(folder))
    except OSError:
        return False


class _FieldsCheck:
    """A per-call check that a dataclass (or a plain class) with slots holds the same field
    values (by identity); ``restore()`` puts them back."""

    __slots__ = ("v", "names", "held")

    def __init__(self, v: Any):
        self.v = v
        names = [f.name for f in dataclasses.fields(v)] if dataclasses.is_dataclass(v) \
            else _writes.slot_names(type(v))
        self.names = [n for n in names if hasattr(v, n)]  # (the slots set)
        self.held = [getattr(v, n) for n in self.names]

    def __call__(self) -> bool:
        v = self.v
        return all(getattr(v, n) is x for n, x in zip(self.names, self.held))

    def restore(self) -> None:
        """Put the fields back as they were (a run that was not a call changed them)."""
        for n, x in zip(self.names, self.held):
            if getattr(self.v, n) is not x:
                object.__setattr__(self.v, n, x)


class _ItemsCheck:
    """A per-call check that a list, deque, set or bytearray holds the same items (by
    identity), in the same order where it has one; ``restore()`` puts them back."""

    __slots__ = ("v", "items", "ids", "unordered")

    def __init__(self, v: Any):
        self.v = v
        self.unordered = isinstance(v, (set, frozenset))
        self.items = list(v)  # held: an id compared below is never reused
        self.ids = frozenset(map(id, self.items)) if self.unordered else list(map(id, self.items))

    def __call__(self) -> bool:
        v = self.v
        if self.unordered:
            return frozenset(map(id, v)) == self.ids
        return len(v) == len(self.ids) and list(map(id, v)) == self.ids

    def restore(self) -> None:
        """Put the items back as they were (a run that was not a call changed them)."""
        if not self():
            if self.unordered or type(self.v) is collections.deque:
                self.v.clear()
                (self.v.update if self.unordered else self.v.extend)(self.items)
            else:
                self.v[:] = self.items


class _DictCheck:
    """A per-call check that an object's ``__dict__`` (or a dict) holds what it held: its
    version, in C; where the version moved, its items compared (the same keys, each value the
    same object or an equal immutable value), and the version taken again if they are. So a
    write of the same value (``cache.flag = True`` before every generate) costs one compare,
    not the graph."""

    __slots__ = ("d", "version", "items", "owner", "cls", "order")

    def __init__(self, d: dict, owner: Any = None):
        self.d = d
        self.version = _dict_version(d)
        self.items = list(d.items())  # held: an id compared below is never reused
        # an OrderedDict's order: ``move_to_end`` moves no version (two moves can keep both
        # ends): its keys, by identity, compared too (one pass in C, as _ItemsCheck's)
        self.order = list(map(id, d)) if isinstance(d, collections.OrderedDict) else None
        # the object whose __dict__ it is: a new __dict__ or class (``obj.__dict__ = {...}``,
        # ``obj.__class__ = Other``) leaves the old dict's version as it was
        self.owner, self.cls = owner, type(owner)

    def __call__(self) -> bool:
        owner = self.owner
        if owner is not None and (type(owner) is not self.cls or owner.__dict__ is not self.d):
            return False
        if _dict_version(self.d) == self.version:
            order = self.order
            return order is None or list(map(id, self.d)) == order
        now = list(self.d.items())
        if len(now) != len(self.items) or any(
                k is not k0 and k != k0 or not same(v, v0)
                for (k, v), (k0, v0) in zip(now, self.items)):
            return False
        self.version = _dict_version(self.d)
        if self.order is not None:  # (an equal key put back: another object)
            self.order = list(map(id, self.d))
        return True

    def restore(self) -> None:
        """Put the items back as they were (a run that was not a call changed them)."""
        if not self():
            _writes.refill(self.d, dict(self.items))
            self.version = _dict_version(self.d)
            if self.order is not None:
                self.order = list(map(id, self.d))


# the type of graphify's forward wrapper (``_wrap.GraphedForward`` registers itself)
WRAPPERS: list[type] = []


def _forward_of(module: nn.Module) -> Any:
    """What a module's own ``forward`` entry makes it run: a piecewise plan's wrapper counts as
    what it wraps (the instance's own forward, or none: the class's), since the plan installs
    and gives back its pieces' wrappers without changing what they compute (a graph that ran a
    piece ran its plain forward, as part of it)."""
    fwd = module.__dict__.get("forward")
    if type(fwd) in WRAPPERS:
        dispatch = fwd._self_dispatch
        if dispatch.options.piece and dispatch.owner is module:  # (its own: not another's)
            return fwd.__wrapped__ if dispatch.had_own else None
    return fwd


class StateGuard:
    """The module state one graph (or one eager decision) depends on.

    ``valid()`` is True while every read value is what the run read: values are compared again
    when the epoch moved (with the hooks, and the class and ``forward`` of every module the run
    ran); mutable objects, held tensors and CPU scalars on every call, and the hooks on every
    call where the process has global module hooks.
    """

    def __init__(self, reads: list[Read], hooks: Callable[[], tuple] | None = None,
                 bindings: list[tuple[str, Callable[[], Any], Any, Any]] = (),
                 ran: list[nn.Module] = (), objects: list[tuple[str, Any]] = (),
                 owned: frozenset[int] = frozenset(), loose=(), tree: list[nn.Module] = ()):
        # the modules of the callable's own tree (ids in ``owned``) are held weakly: an entry
        # in a shared or a region's cache must not keep its owner alive (its owner's deletion
        # drops it). A module outside it (built by forward, or a global) is held as it was
        # read: it cannot lead back to the owner
        # (a method's read holds its module weakly: one dead already is left out)
        reads = [r for r in reads if r.module is not None]
        self._reads = [r.held_weakly(owned) if id(r.module) in owned else r for r in reads]
        # the class of each module it read from, and of each module it read (``self.s``, whose
        # method it called): ``m.__class__ = Other`` runs other code
        self._classes = [(type(r.module), type(r.value) if isinstance(r.value, nn.Module)
                          else None) for r in reads]
        # argument objects passed as they are (named in static_argnames, or recognised static
        # state such as an HF StaticCache): (where, the object); what they hold is checked on
        # every call like a mutable object a forward read
        self._objects = list(objects)
        for r in reads:  # their attribute writes must bump the epoch
            watch(r.module)
        # the classes of the modules of the callable's tree (held weakly: see above), whose
        # methods its forward may call without calling them (``self.layers[0].helper(x)``)
        self._tree = [(weakref.ref(m), type(m), False) for m in tree]
        # the modules the run ran, each with its class, own forward and call override
        # (``module.compile()``): replacing any of them changes what runs
        self._ran = [(weakref.ref(m) if id(m) in owned else m, type(m), _forward_of(m),
                      call_override(m)) for m in ran]
        for m in ran:
            watch(m)
        # names outside modules (a graphed function's closure cells, and its globals that held
        # a tensor): (what, how to read it now, the value, how to put it back), checked on
        # every call
        self._bindings = list(bindings)
        self._hooks = hooks
        self._hooks_then = hooks() if hooks is not None else None
        self.epoch = _watch.epoch
        checks: list[Callable[[], bool]] = []
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        self.unguardable = ""  # why what was read cannot be guarded ("" when it can)
        for r in self._reads:
            if r.name == "__dict__" and type(r.value) is dict:
                # (a forward that reads its module's dict itself: the dict, every attribute
                # in it, by its version; what its attributes hold, as read ones: not the
                # registries and hooks, which the statics and hook guards see)
                checks.append(_DictCheck(r.value))  # (not its module: held weakly, see Read)
                try:
                    for k, v in list(r.value.items()):
                        if k not in INTERNAL_ATTRS and k != "training" and _watched(v):
                            _watch_value(v, checks, tensors, seen, 0)
                except Unguardable as e:
                    self.unguardable = (f"forward reads {type(r.module).__name__}.__dict__, "
                                        f"which {e}")
                    break
            elif isinstance(r.value, torch.Tensor):
                tensors.append(r.value)
            elif r.on_class and type(r.value) in METHOD_KINDS:
                pass  # (a method of its class, by identity: set on the instance, a change)
            elif r.value is not MISSING and _watched(r.value):
                try:
                    _watch_value(r.value, checks, tensors, seen, 0)
                except Unguardable as e:
                    self.unguardable = (f"forward reads {type(r.module).__name__}.{r.name}, "
                                        f"which {e}")
                    break
        for where, value in self._objects:
            if self.unguardable:
                break
            try:
                _watch_value(value, checks, tensors, seen, 0)
            except Unguardable as e:
                self.unguardable = f"{where} ({type(value).__name__}) {e}"
        for _, read, value, _ in self._bindings:
            checks.append(lambda read=read, value=value: read() is value)
            if isinstance(value, nn.Module):  # (a graphed function's closure cell: its class)
                try:
                    checks.append(_ClassCheck(value))
                except Unguardable as e:
                    self.unguardable = f"a closure cell of it {e}"
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif _own_member(value):  # (its attributes: see _watch_value)
                _watch_value(value, checks, tensors, seen, 0)
            # (anything else by identity only: what a closed-over container or object holds
            # is not watched; a list the function appends to on every call would otherwise
            # make an eager decision capture again on every call)
        self.tensors = _unique(tensors)  # held: never freed under a graph that reads them
        without = [t for t in self.tensors if _no_address(t)]
        if without and not self.unguardable:
            t = without[0]
            self.unguardable = (
                f"forward reads a {'nested ' if t.is_nested else ''}{type(t).__name__} "
                f"({t.layout}) from outside its arguments, "
                "parameters and buffers (an attribute, closure or global) whose memory has no "
                "single address and layout to guard (a sparse or nested tensor, a wrapper tensor "
                "subclass): calls that read it run eagerly")
        # (``loose``: storages of tensors whose layout the run changes itself, the decision
        # being to run that code eagerly: held, not checked)
        checks.extend(_tensor_checks([t for t in self.tensors if not _no_address(t)
                                      and (not loose or storage_of(t) not in loose)]))
        # (the classes of modules found in what it read: compared after a module write, as
        # the tree's are, not on every call)
        self._tree += [(c.ref, c.cls, c.proxied) for c in checks if type(c) is _ClassCheck]
        checks = [c for c in checks if type(c) is not _ClassCheck]
        self._checks = checks
        self.volatile = bool(checks)

    @property
    def reads(self) -> list[tuple[nn.Module, str, Any]]:
        """(module, attribute, value read) for every attribute the run read."""
        return [(r.module, r.name, r.value) for r in self._reads]

    def valid(self) -> bool:
        now = _watch.epoch  # read once: a write bumps it after it is done
        if self.epoch != now:
            if self._changed() is not None:
                return False
            self.epoch = now
        elif self._hooks is not None and global_hooks_present() \
                and self._hooks() != self._hooks_then:
            return False  # a global hook registered without an epoch bump
        if self.volatile:
            for check in self._checks:
                if not check():
                    return False
        return True

    def restore(self) -> None:
        """Put back the attributes of the objects this guard watches (their ``__dict__``
        items) and the closure cells it reads: a run that was not a call (a capture's) changed
        them."""
        for check in self._checks:
            if type(check) is _DictCheck or type(check) is _ItemsCheck \
                    or type(check) is _FieldsCheck:
                check.restore()
        for _, read, value, put in self._bindings:
            if put is not None and read() is not value:
                put(value)  # (a closure cell the run rebound: ``nonlocal step; step += 1``)

    def _changed(self) -> str | None:
        for r, (cls, value_cls) in zip(self._reads, self._classes):
            now = r.now()
            if now is GONE:
                if r.on_class and type(r.value) in METHOD_KINDS:
                    continue  # (a method's read, held weakly: nothing left to set it on)
                return f"a module whose .{r.name} it read was deleted"
            if not r.holds(now):
                return (f"{type(r.module).__name__}.{r.name} changed ({short(r.value)} -> "
                        f"{short(now)})")
            if type(r.module) is not cls \
                    or (value_cls is not None and type(now) is not value_cls):
                return f"the class of {cls.__name__} or of its .{r.name} was replaced"
        for m, cls, forward, call in self._ran:
            if type(m) is weakref.ReferenceType:
                m = m()
                if m is None:
                    return f"a {cls.__name__} it ran was deleted"
            if type(m) is not cls or _forward_of(m) is not forward \
                    or call_override(m) is not call:
                return f"{cls.__name__}'s class, forward or compiled call was replaced"
        # (on every epoch move, not only the tree epoch's: a class written past
        # nn.Module.__setattr__, ``object.__setattr__(m, "__class__", X)``, moves neither)
        for ref, cls, proxied in self._tree:
            m = ref()
            if m is None:
                if proxied:  # (a call through the proxy now raises)
                    return f"a {cls.__name__} it reads through a weak proxy was deleted"
            elif type(m) is not cls:  # (by identity: a metaclass's == may take another as it)
                return f"the class of a {cls.__name__} in its tree was replaced"
        if self._hooks is not None and self._hooks() != self._hooks_then:
            return "hooks were added to or removed from a module it runs"
        return None


def callable_state(fn: Callable) -> tuple[Callable, list[tuple[str, Any]], list[tuple]]:
    """A graphed callable that is no plain function: the function it runs, the objects it
    carries that the call reads without their being arguments, to be watched as a forward's
    mutable objects are (:class:`StateGuard`'s ``objects``), and bindings (as
    :func:`function_bindings`') of the attributes it reads. A ``functools.partial``'s bound
    arguments and keywords are arguments of every call: watched whole. A callable object's
    attributes: those its ``__call__`` reads as ``self.<name>`` (and the methods it calls on
    ``self``, four calls deep; :func:`_self_reads`), each compared as a module attribute is
    (an equal constant is the same); where ``self`` goes anywhere else (passed on, ``getattr``,
    ``super()``, a property), the object whole. A bound method of an object (not a module's:
    the module tree is guarded) alike. Read without running any ``__getattr__`` of theirs."""
    objects: list[tuple[str, Any]] = []
    bindings: list[tuple] = []
    for _ in range(8):
        calls = getattr(fn, "__cudagraphify_calls__", None) \
            if type(fn) is types.FunctionType else None
        if calls is not None:  # (graphify's call of a torch function: see _wrap.user_call)
            fn = calls
        elif isinstance(fn, functools.partial):
            objects += [("the functools.partial's bound arguments", fn.args),
                        ("the functools.partial's bound keywords", fn.keywords)]
            # (and which objects they are: ``__setstate__`` replaces all three)
            bindings += [(f"the functools.partial's .{a}", lambda p=fn, a=a: getattr(p, a),
                          getattr(fn, a), None) for a in ("func", "args", "keywords")]
            call = inspect.getattr_static(type(fn), "__call__", None)
            if isinstance(call, types.FunctionType):  # (a subclass's own, which runs)
                _watch_object(fn, call, objects, bindings)
                return types.MethodType(call, fn), objects, bindings
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            owner = fn.__self__
            if not isinstance(owner, (nn.Module, type, types.ModuleType)):
                _watch_object(owner, fn.__func__, objects, bindings)
            return fn, objects, bindings
        elif isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, nn.Module, type)):
            return fn, objects, bindings
        else:
            call = inspect.getattr_static(type(fn), "__call__", None)
            if not isinstance(call, types.FunctionType):
                return fn, objects, bindings
            _watch_object(fn, call, objects, bindings)
            return types.MethodType(call, fn), objects, bindings
    return fn, objects, bindings


def _watch_object(obj: Any, method: types.FunctionType, objects: list, bindings: list) -> None:
    """What guards ``obj``, whose ``method`` the call runs (see :func:`callable_state`)."""
    name = type(obj).__name__
    d = object_dict(obj)
    names = _self_reads(type(obj), method) if isinstance(d, dict) else None
    if names is None:
        objects.append((f"the callable {name} object", obj))
        return
    for attr in sorted(names):
        value = d.get(attr, MISSING)
        where = f"{name}.{attr}"

        def read(d=d, attr=attr, value=value):
            now = d.get(attr, MISSING)
            return value if same(now, value) else now  # (an equal constant is the same)
        def put(v, d=d, attr=attr):  # (a run that was not a call set it: ``self.n += 1``)
            if v is MISSING:
                d.pop(attr, None)
            else:
                d[attr] = v
        bindings.append((f"the attribute {where} of the callable object", read, value, put))
        if not isinstance(value, (torch.Tensor, nn.Module)) and value is not MISSING \
                and _watched(value):
            objects.append((where, value))  # (what it holds: a list, a config object)
    # (its __dict__ replaced, or its class: what is read is not the dict above)
    bindings.append((f"the __dict__ of the callable {name} object",
                     lambda obj=obj: object_dict(obj), d, None))
    bindings.append((f"the class of the callable {name} object", lambda obj=obj: type(obj),
                     type(obj), None))


_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK", "LOAD_CLOSURE")
_SELF_ATTRS = ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR")


def _self_reads(cls: type, method: types.FunctionType, depth: int = 0,
                seen: set | None = None) -> set[str] | None:
    """The attribute names ``method`` (a method of ``cls``) reads or sets on its ``self``, with
    those of the methods of ``cls`` it calls on ``self``; None where ``self`` is used any other
    way (passed to a call, ``getattr(self, ...)``, ``vars``, ``super()``, a property or other
    descriptor read on it), or past four calls deep: then no list of names is complete."""
    code = getattr(method, "__code__", None)
    if code is None or not code.co_argcount or depth > 4:
        return None
    seen = set() if seen is None else seen
    if id(code) in seen:
        return set()
    seen.add(id(code))
    me = code.co_varnames[0]
    names: set[str] = set()
    for c in nested_codes(code):
        if c is not code and me not in c.co_freevars and me in c.co_varnames:
            return None  # (a nested function naming its own ``self``: not followed)
        instrs = list(dis.get_instructions(c))
        for i, ins in enumerate(instrs):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "super":
                return None
            if isinstance(ins.argval, tuple) and me in ins.argval:
                return None  # (3.13's LOAD_FAST_LOAD_FAST: ``self`` loaded with another)
            if ins.argval != me:
                continue
            if ins.opname in ("STORE_FAST", "DELETE_FAST", "STORE_DEREF", "DELETE_DEREF"):
                return None  # (``self`` rebound)
            if ins.opname in ("MAKE_CELL", "COPY_FREE_VARS", "LOAD_CLOSURE"):
                continue  # (handed to a nested function: its code is read too)
            if ins.opname not in _SELF_LOADS:
                if ins.opname.startswith(("LOAD_", "STORE_", "DELETE_")):
                    return None  # (an opcode of another Python: not understood)
                continue
            j = i + 1
            while j < len(instrs) and instrs[j].opname == "COPY":  # (``self.n += 1``)
                j += 1
            nxt = instrs[j] if j < len(instrs) else None
            if nxt is None or nxt.opname not in _SELF_ATTRS \
                    or not isinstance(nxt.argval, str) or nxt.argval == "__dict__":
                return None
            attr = nxt.argval
            names.add(attr)
            raw = inspect.getattr_static(cls, attr, MISSING)
            if raw is MISSING or nxt.opname != "LOAD_ATTR" and nxt.opname != "LOAD_METHOD":
                continue
            if isinstance(raw, (staticmethod, classmethod)):
                continue  # (no ``self``: reads none of its attributes)
            if isinstance(raw, types.FunctionType):
                inner = _self_reads(cls, raw, depth + 1, seen)
                if inner is None:
                    return None
                names |= inner
            elif hasattr(type(raw), "__get__"):
                return None  # (a property or another descriptor: what it reads is not known)
    return names


def function_bindings(fn: Callable) -> list[tuple[str, Callable[[], Any], Any, Any]]:
    """What a graphed function (or forward) names directly, outside its arguments: every
    value in its closure cells, and the tensors among the globals its own code reads. Each as
    (what, how to read the name now, the value, how to put it back: a closure cell's, else
    None); a :class:`StateGuard` checks the names still
    refer to them (by identity) and holds the tensors, with their addresses and layouts
    checked. (Functions it calls are not
    looked into: a tensor they read shows as a tensor from outside; globals that are not
    tensors are not guarded: see the README's guard model.)"""
    func = getattr(fn, "__func__", fn)
    func = getattr(func, "__wrapped__", func)
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    out = []
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        if name == "__class__":  # (super()'s: the class a method was defined in)
            continue
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        out.append((f"closure variable {name!r} of {func.__qualname__}",
                    lambda cell=cell: cell.cell_contents, value,
                    lambda v, cell=cell: setattr(cell, "cell_contents", v)))
    space = getattr(func, "__globals__", {})
    for name in code.co_names:
        value = space.get(name)
        if isinstance(value, torch.Tensor):
            out.append((f"global {name!r} of {func.__module__}",
                        lambda space=space, name=name: space.get(name), value, None))
    return out


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _no_address(t: torch.Tensor) -> bool:
    """Whether ``t`` has data but no storage of its own to watch (a sparse tensor, a wrapper
    tensor subclass: its memory is in the tensors it wraps; a nested tensor, whose buffer has
    no one shape to guard). Meta tensors have no data."""
    if t.device.type == "meta":
        return False
    if no_one_layout(t):
        return True
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return True
    return False


def _tensor_check(t: torch.Tensor) -> Callable[[], bool]:
    """A per-call check that ``t`` (held) still has the address, layout and requires_grad,
    and for a CPU scalar the value, a graph read."""
    # (requires_grad too, as TensorGuards checks it: one that starts requiring grad must make
    # the call decide again, a graph would give it no gradient)
    meta = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    if t.device.type == "cpu" and t.numel() <= 64:
        value = host_bits(t)  # (floats by their bits: 0.0 and -0.0 differ)
        return lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device,
                        t.requires_grad) == meta and host_bits(t) == value
    return lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device,
                    t.requires_grad) == meta


_TensorGuards = torch._C._dynamo.guards.TensorGuards


def _tensor_checks(tensors: list[torch.Tensor]) -> list[Callable[[], bool]]:
    """The per-call checks of held tensors: CPU scalars (whose value a forward reads on the
    host) one by one (:func:`_tensor_check`); the others all in one: their layouts, dtypes,
    devices and flags in C (``TensorGuards``), their addresses in one list."""
    small = [t for t in tensors if t.device.type == "cpu" and t.numel() <= 64]
    rest = [t for t in tensors if not (t.device.type == "cpu" and t.numel() <= 64)]
    checks = [_tensor_check(t) for t in small]
    if len(rest) == 1 or (rest and any(type(t) is not torch.Tensor and
                                       type(t) is not nn.Parameter for t in rest)):
        checks.extend(_tensor_check(t) for t in rest)
    elif rest:
        guard = _TensorGuards(*rest, dynamic_dims_sizes=[list(t.shape) for t in rest],
                              dynamic_dims_strides=[list(t.stride()) for t in rest])
        ptrs = [t.data_ptr() for t in rest]
        if ptrs_equal is not None:
            indices = list(range(len(rest)))
            checks.append(lambda: guard.check(*rest) and ptrs_equal(rest, ptrs, indices))
        else:
            checks.append(lambda: guard.check(*rest) and [t.data_ptr() for t in rest] == ptrs)
    return checks
