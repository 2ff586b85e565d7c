"""What a replay must see besides its arguments: module state, hooks and global flags.

A graph replays fixed kernels with fixed scalars on fixed memory. Everything a forward's Python
read to choose them must still hold when the graph replays. This module records what a run reads
and guards it cheaply:

- **The epoch**: one global counter, bumped by every write to a module a graph depends on (a
  *watched* one, see :mod:`._statics`) that no per-call check can see:
  ``nn.Module.__setattr__``/``__delattr__`` (patched once, on first use), and module hook
  registration and removal. Modules no graph reads never bump it. A call whose epoch equals the one its graph was last validated at
  skips every attribute check.
- **Reads**: while a :class:`Recorder` is active on a thread, ``nn.Module.__getattribute__``
  records every instance attribute a module's code reads (``self.scale``, ``self.training``,
  ``self.config``) with the value read, and module pre-hooks record which modules ran. A
  :class:`StateGuard` compares those values again when the epoch moved; mutable values (a dict,
  a list, a dataclass or an HF config) are checked on every call (dict versions, snapshots), and
  tensors kept as plain attributes are held and checked (address, shape, and for CPU scalars
  their value).
- **Global flags** that change which kernels run (:class:`FlagsGuard`): Dynamo's
  ``GlobalStateGuard`` (grad mode, autocast, default dtype, deterministic algorithms, TF32 and
  reduced-precision matmul) and the others (the current device; cuDNN flags and
  fp32 precision where the graph has convolutions, batch norms or RNNs, the SDPA backends
  where it has attention).

Not seen (documented): class attributes changed on the class, writes straight into a module's
``__dict__`` or through ``object.__setattr__``, non-tensor Python globals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.utils import hooks as _torch_hooks

from ._signature import is_constant
from ._statics import _WatchedDict, watch, watched

__all__ = ["bump", "install", "Recorder", "recording", "StateGuard", "FlagsGuard",
           "hook_fingerprint", "INTERNAL_ATTRS", "function_bindings"]

_counter = itertools.count(1)
epoch = 0  # read as ``_guards.epoch``: bumped by every module write the per-call path cannot see


def bump(*_args: Any) -> None:
    """Something a graph may depend on changed: every state guard checks itself again."""
    global epoch
    epoch = next(_counter)  # unique per bump, so two threads bumping never look unchanged


_installed = False
_install_lock = threading.Lock()
_HOOK_METHODS = ("register_forward_hook", "register_forward_pre_hook", "register_backward_hook",
                 "register_full_backward_hook", "register_full_backward_pre_hook")
_GLOBAL_HOOK_FUNCTIONS = ("register_module_forward_hook", "register_module_forward_pre_hook",
                          "register_module_backward_hook", "register_module_full_backward_hook",
                          "register_module_full_backward_pre_hook")


def _bumping(fn: Callable, watched_only: bool = False) -> Callable:
    """``fn`` that bumps the epoch first (for a module method with ``watched_only``: only when
    a graph depends on the module)."""
    def wrapper(*args, **kwargs):
        if not watched_only or (args and watched(args[0])):
            bump()
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def install() -> None:
    """Patch, once per process, the writes that bump the epoch (see the module docs)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        cls = nn.Module
        set_attr, del_attr = cls.__setattr__, cls.__delattr__

        def __setattr__(self, name, value):  # noqa: N807 - the patched special method
            if type(self.__dict__.get("_parameters")) is _WatchedDict:  # a graph reads it
                global epoch
                epoch = next(_counter)
                rec = _recorders.get(threading.get_ident())
                if rec is not None:
                    rec.wrote(self, name, value)
            set_attr(self, name, value)

        def __delattr__(self, name):  # noqa: N807
            if type(self.__dict__.get("_parameters")) is _WatchedDict:
                global epoch
                epoch = next(_counter)
            del_attr(self, name)

        cls.__setattr__ = __setattr__
        cls.__delattr__ = __delattr__
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


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own."""
    d = module.__dict__
    return any(d.get(name) for name in _HOOK_DICTS[:4])


def hook_fingerprint(modules: list[nn.Module]) -> tuple:
    """Which hooks each of ``modules`` and the process (global module hooks) has: compared
    again when the epoch moves."""
    own = tuple((i, tuple(tuple(m.__dict__.get(n, ())) for n in _HOOK_DICTS[:4]))
                for i, m in enumerate(modules) if hooked(m))
    return own, _global_hook_ids()


_OWN_HOOKS: set[int] = set()  # handle ids of the global hooks cudagraphify's probes register


def _global_hook_ids() -> tuple:
    return tuple(tuple(k for k in getattr(_module_mod, n, ()) if k not in _OWN_HOOKS)
                 for n in _GLOBAL_HOOK_DICTS)


def global_hooks() -> bool:
    """Whether the process has global module hooks (besides cudagraphify's own probes')."""
    return any(_global_hook_ids())


@contextlib.contextmanager
def own_global_hook(register: Callable, hook: Callable, **kwargs) -> Iterator[None]:
    """``register(hook)`` (a ``register_module_*_hook``) for the block: cudagraphify's own,
    so it does not count as the user's global hook (see :func:`global_hooks`)."""
    handle = register(hook, **kwargs)
    _OWN_HOOKS.add(handle.id)
    try:
        yield
    finally:
        handle.remove()
        _OWN_HOOKS.discard(handle.id)


# -- global flags --------------------------------------------------------------------------

_C = torch._C
_GlobalStateGuard = torch._C._dynamo.guards.GlobalStateGuard


def _getter(name: str, *args: Any) -> Callable[[], Any]:
    fn = getattr(_C, name, None)
    if fn is None:
        return lambda: None
    if args:
        def call():
            try:
                return fn(*args)
            except RuntimeError:
                return None
        return call
    return fn


_CUDNN = (("cudnn.enabled", _getter("_get_cudnn_enabled")),
          ("cudnn.benchmark", _getter("_get_cudnn_benchmark")),
          ("cudnn.deterministic", _getter("_get_cudnn_deterministic")),
          ("cudnn.allow_tf32", _getter("_get_cudnn_allow_tf32")),
          ("fp32 precision (conv)", _getter("_get_fp32_precision_getter", "cuda", "conv")),
          ("fp32 precision (rnn)", _getter("_get_fp32_precision_getter", "cuda", "rnn")))
_priority = _getter("_get_sdp_priority_order")
_SDPA = (("flash SDPA", _getter("_get_flash_sdp_enabled")),
         ("mem-efficient SDPA", _getter("_get_mem_efficient_sdp_enabled")),
         ("math SDPA", _getter("_get_math_sdp_enabled")),
         ("cuDNN SDPA", _getter("_get_cudnn_sdp_enabled")),
         ("math SDPA fp16/bf16 reduction", _getter("_get_math_sdp_allow_fp16_bf16_reduction")),
         ("SDPA priority", lambda: tuple(_priority() or ())))
_device = getattr(_C, "_cuda_getDevice", None)
_cuda = torch.cuda
# ops whose kernels the cuDNN flags (and fp32 precision for conv/rnn) choose, by name
_CUDNN_OPS = ("conv", "batch_norm", "instance_norm", "lstm", "gru", "rnn", "ctc_loss",
              "grid_sampl", "affine_grid")


def _current_device():
    # (once CUDA is up: asking earlier would initialise it; None on a build without CUDA)
    return _device() if _cuda._initialized and _device is not None else None


class FlagsGuard:
    """Global flags as they were when a graph was captured; ``check()`` on every call.

    Dynamo's ``GlobalStateGuard`` (grad mode, autocast, default dtype, deterministic
    algorithms, TF32 and reduced-precision matmul) in one C call, plus the current device, and
    the flags that choose the kernels of the ops the run made: the cuDNN flags where it ran
    convolutions, batch norms or RNNs, the SDPA backends where it ran
    ``scaled_dot_product_attention``. ``ops``: the op names the run made (None: not known, so
    every flag). (Inference mode is part of every key, and of the tensor guards.)"""

    __slots__ = ("_state", "_getters", "_read", "flags")

    def __init__(self, ops: set[str] | None = None):
        getters = []
        if ops is None or any(p in op for op in ops for p in _CUDNN_OPS):
            getters.extend(_CUDNN)
        if ops is None or any("scaled_dot_product_attention" in op for op in ops):
            getters.extend(_SDPA)
        getters.append(("current device", _current_device))
        self._getters = tuple(getters)
        # one frame that calls each getter (most are C functions) and makes the tuple
        names = [f"g{i}" for i in range(len(getters))]
        self._read = eval(f"lambda {', '.join(f'{n}={n}' for n in names)}: "  # noqa: S307
                          f"({', '.join(f'{n}()' for n in names)},)",
                          dict(zip(names, (read for _, read in getters))))
        self._state = _GlobalStateGuard()
        self.flags = self._read()

    def check(self) -> bool:
        return self._state.check() and self._read() == self.flags

    def reason(self) -> str:
        if not self._state.check():
            return f"global state changed: {self._state.reason()}"
        diff = [f"{name}: {a} -> {b}" for (name, _), a, b in
                zip(self._getters, self.flags, self._read()) if a != b]
        return "global flags changed (" + "; ".join(diff) + ")"


# -- recording reads -------------------------------------------------------------------------

# Module attributes that are torch's own bookkeeping (hooks and registries) or cudagraphify's:
# they are guarded elsewhere (statics, hooks) or not at all (state dict hooks).
INTERNAL_ATTRS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_cudagraphify_state", "_cudagraphify_share", "forward",
    "__dict__", "__class__",
})

_REGISTRIES = ("_parameters", "_buffers", "_modules")
_recorders: dict[int, "Recorder"] = {}  # thread id -> the recorder active on that thread
_patch_users = 0
_patch_lock = threading.Lock()
_object_getattribute = object.__getattribute__


def _recording_getattribute(self, name):
    value = _object_getattribute(self, name)
    rec = _recorders.get(threading.get_ident())
    if rec is not None and name not in INTERNAL_ATTRS:
        d = _object_getattribute(self, "__dict__")
        if name in d and d[name] is value:
            rec.read(self, name, value)
    return value


@dataclasses.dataclass
class Read:
    module: nn.Module
    name: str
    value: Any


class Recorder:
    """What one run of a forward read from modules, which modules ran, and which module
    attributes it changed."""

    def __init__(self):
        self.reads: dict[tuple[int, str], Read] = {}
        self.called: dict[int, nn.Module] = {}
        self.writes: list[tuple[nn.Module, str, Any, Any]] = []
        self._thread = threading.get_ident()

    def read(self, module: nn.Module, name: str, value: Any) -> None:
        key = (id(module), name)
        if key not in self.reads:  # the first read is what the run's code saw first
            self.reads[key] = Read(module, name, value)

    def wrote(self, module: nn.Module, name: str, value: Any) -> None:
        d = module.__dict__
        if name in INTERNAL_ATTRS or any(name in d.get(k, ()) for k in _REGISTRIES):
            return  # a parameter, buffer or submodule: the statics guard sees those
        old = d.get(name, _MISSING)
        if not _same(old, value):
            self.writes.append((module, name, old, value))

    def _pre(self, module, args):
        if threading.get_ident() == self._thread:
            self.called.setdefault(id(module), module)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Record, on this thread, the module attributes read and the modules run (see module docs)."""
    global _patch_users
    install()
    with _patch_lock:
        _patch_users += 1
        if _patch_users == 1:
            nn.Module.__getattribute__ = _recording_getattribute
    tid = threading.get_ident()
    outer = _recorders.get(tid)
    _recorders[tid] = rec
    try:
        with own_global_hook(_module_mod.register_module_forward_pre_hook, rec._pre):
            yield rec
    finally:
        if outer is not None:
            _recorders[tid] = outer
        else:
            _recorders.pop(tid, None)
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                del nn.Module.__getattribute__


# -- guarding what was read ------------------------------------------------------------------

_dict_version = torch._C._dynamo.guards.dict_version
_MAX_WATCHED = 256  # mutable objects watched per graph; beyond that the read is refused


def _same(a: Any, b: Any) -> bool:
    """Whether two attribute values would drive a forward the same way."""
    if a is b:
        return True
    if type(a) is not type(b) or not is_constant(a):
        return False
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
    except Exception:  # noqa: BLE001 - an __eq__ that raises: not the same
        return False


class Unguardable(Exception):
    """A value a forward read cannot be guarded; the message says what and why."""


def _watch(value: Any, out: list[Callable[[], bool]], tensors: list[torch.Tensor],
           seen: set[int], depth: int) -> None:
    """Per-call checks that ``value`` (a mutable object a forward read) still holds what it
    held; tensors found inside are collected (held and checked by the caller)."""
    if id(value) in seen or is_constant(value) or callable(value) and not isinstance(
            value, (dict, list)) and not dataclasses.is_dataclass(value):
        return
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return
    if isinstance(value, nn.Module):
        return  # its state is the module tree's (guarded as a module it ran, or by identity)
    seen.add(id(value))
    if len(seen) > _MAX_WATCHED:
        raise Unguardable(f"reads {_MAX_WATCHED}+ mutable objects (containers nested too deep "
                          "to check on every call)")
    if depth > 4:
        raise Unguardable("reads a container nested more than 4 deep")
    if isinstance(value, dict):
        d = value
    elif isinstance(value, (list, set, frozenset, bytearray)):
        snapshot = list(value) if not isinstance(value, (set, frozenset)) else set(value)
        ids = [id(v) for v in snapshot]
        kind = type(value)
        if kind in (set, frozenset):
            out.append(lambda v=value, s=frozenset(ids): frozenset(map(id, v)) == s)
        else:
            out.append(lambda v=value, s=ids: len(v) == len(s) and list(map(id, v)) == s)
        for item in snapshot:
            if not is_constant(item):
                _watch(item, out, tensors, seen, depth + 1)
        return
    elif isinstance(value, tuple):
        for item in value:
            _watch(item, out, tensors, seen, depth + 1)
        return
    else:
        d = getattr(value, "__dict__", None)
        if not isinstance(d, dict):
            return  # no instance dict (slots, C objects): held by identity only
    version = _dict_version(d)
    out.append(lambda d=d, v=version: _dict_version(d) == v)
    for item in list(d.values()):
        if not is_constant(item):
            _watch(item, out, tensors, seen, depth + 1)


class StateGuard:
    """The module state one graph (or one eager decision) depends on.

    ``valid()`` is True while every read value is what the run read: values are compared again
    when the epoch moved; mutable objects, held tensors and CPU scalars on every call.
    ``why()`` says what changed.
    """

    def __init__(self, reads: list[Read], hooks: Callable[[], tuple] | None = None,
                 bindings: list[tuple[str, Callable[[], Any], Any]] = ()):
        self._reads = [(r.module, r.name, r.value) for r in reads]
        for r in reads:  # their attribute writes must bump the epoch
            watch(r.module)
        # names outside modules (a graphed function's closure cells and globals) that held a
        # tensor: (what, how to read it now, the tensor), checked on every call
        self._bindings = list(bindings)
        self._hooks = hooks
        self._hooks_then = hooks() if hooks is not None else None
        self.epoch = epoch
        checks: list[Callable[[], bool]] = []
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for _, _, value in self._reads:
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif not is_constant(value):
                _watch(value, checks, tensors, seen, 0)
        for _, read, value in self._bindings:
            checks.append(lambda read=read, value=value: read() is value)
            tensors.append(value)
        self.tensors = _unique(tensors)  # held: never freed under a graph that reads them
        for t in self.tensors:
            checks.append(_tensor_check(t))
        self._checks = checks
        self.volatile = bool(checks)

    @property
    def reads(self) -> list[tuple[nn.Module, str, Any]]:
        """(module, attribute, value read) for every attribute the run read."""
        return list(self._reads)

    def valid(self) -> bool:
        if self.epoch != epoch:
            if self._changed() is not None:
                return False
            self.epoch = epoch
        if self.volatile:
            for check in self._checks:
                if not check():
                    return False
        return True

    def _changed(self) -> str | None:
        for module, name, value in self._reads:
            now = module.__dict__.get(name, _MISSING)
            if not _same(now, value):
                return f"{type(module).__name__}.{name} changed ({_short(value)} -> {_short(now)})"
        if self._hooks is not None and self._hooks() != self._hooks_then:
            return "hooks were added to or removed from a module it runs"
        return None

    def why(self) -> str:
        changed = self._changed()
        if changed is not None:
            return changed
        for what, read, value in self._bindings:
            if read() is not value:
                return f"{what} now names another object"
        if any(not check() for check in self._checks):
            return ("a mutable object, or a tensor kept as a module attribute or named by the "
                    "function, changed")
        return "unchanged"


def function_bindings(fn: Callable) -> list[tuple[str, Callable[[], Any], Any]]:
    """The tensors a graphed function (or forward) names directly, outside its arguments: in
    its closure cells and among the globals its own code reads. Each as (what, how to read the
    name now, the tensor); a :class:`StateGuard` holds them and checks the names still refer
    to them, with their addresses and layouts. (Functions it calls are not looked into: a
    tensor they read shows as a tensor from outside.)"""
    func = getattr(fn, "__func__", fn)
    func = getattr(func, "__wrapped__", func)
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    out = []
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            out.append((f"closure variable {name!r} of {func.__qualname__}",
                        lambda cell=cell: cell.cell_contents, value))
    space = getattr(func, "__globals__", {})
    for name in code.co_names:
        value = space.get(name)
        if isinstance(value, torch.Tensor):
            out.append((f"global {name!r} of {func.__module__}",
                        lambda space=space, name=name: space.get(name), value))
    return out


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _tensor_check(t: torch.Tensor) -> Callable[[], bool]:
    """A per-call check that ``t`` (held) still has the address and layout, and for a CPU
    scalar the value, a graph read."""
    meta = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    if t.device.type == "cpu" and t.numel() <= 64:
        value = t.tolist()
        return lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) == meta \
            and t.tolist() == value
    return lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) == meta


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
