"""Tensor hooks a forward registers, watched while a signature's first call runs.

A graph's replay runs no Python of forward or backward. A hook the forward registers on a tensor
(``h.register_hook(fn)``, ``p.register_post_accumulate_grad_hook(fn)``,
``torch.autograd.graph.register_multi_grad_hook``, ``retain_grad()`` on a non-leaf) would be
registered by the real call only: a replay's backward holds what the hook's Python computed
while captured, never its writes (to an output, an argument, a buffer: the static copies are
written, or nothing), its Python state (a log) or its effect on a tensor outside the graph (a
hook on the input). So such a signature is refused (``PYTHON_HOOK``): it runs eagerly, or
piecewise, its submodules that register none graphed. Decided on the real call, before any
extra warm-up or capture runs a backward, so the hook's Python runs in the user's backwards only.
Inference keys too: a hook registered under no_grad (on a parameter) is a registration on every
call that a replay would not make.

While a :class:`HookWatch` is active on a thread, the registering methods (patched, once for all
watches, while any is active: the probe sees ``register_hook`` through its torch function mode,
but a watch must work with ``probe=False`` too; other threads' calls go straight through) note
each registration as a :class:`~._probe.Finding`: the hook's ``__qualname__``, the user's
file:line, the module path the active probe is in. A blocking watch (the runs beyond the real
call: extra warm-ups, rehearsals, the capture, proofs) registers none: their backwards must not
run a hook's Python, and one left on a parameter would run in every later backward.

A blocking watch also notes the tensors ``torch.utils.swap_tensors`` swaps on its thread (in a
log of _writes': through ``torch._C._swap_tensor_impl``, which it calls however it was imported):
a run beyond the real call that swaps a tensor from before the call (a global) must not leave it
swapped, so the swaps are swapped back, the last first, before anything the runs changed is put
back (each put-back of _writes does it first) and when the watch ends; and a forward that swaps
tensors beyond its real call would swap them on every later call, which a replay does not (see
_first_call.verify, _capturing._shared).

Not seen: hooks on autograd nodes (``h.grad_fn.register_hook``, ``register_prehook``), whose
methods belong to C types that cannot be patched (README, Limitations).
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import os
import sys
import threading
import types
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from . import _probe, _writes
from ._errors import name_of
from ._probe import Finding
from ._watch import nested_codes

__all__ = ["HookWatch", "WHY"]

WHY = ("a tensor hook the forward registers: its Python runs in each backward, and a replay "
       "registers none (its writes, Python state and gradient changes outside the graph would "
       "be lost); it runs eagerly")

_lock = threading.Lock()
_users = 0
_undo: list[Callable[[], None]] = []
_active: dict[int, list["HookWatch"]] = {}  # thread id -> the watches active there, innermost last
# ``inner``: inside a noted multi-grad registration, "noted" or "block" (its own calls not noted)
_tls = threading.local()


class HookWatch:
    """Notes (``found``) the tensor hooks registered on this thread while active; with
    ``block``, registers none (a handle whose ``remove()`` does nothing stands in)."""

    def __init__(self, block: bool = False):
        self.block = block
        self.found: list[Finding] = []
        self.swaps: _writes.SwapLog | None = None  # (a blocking watch's, while active)
        self._thread: int | None = None

    def __enter__(self) -> "HookWatch":
        self._thread = threading.get_ident()
        _acquire()
        _active.setdefault(self._thread, []).append(self)
        if self.block:
            self.swaps = _writes.open_swap_log()
        return self

    def __exit__(self, *exc) -> None:
        stack = _active.get(self._thread, [])
        if self in stack:
            stack.remove(self)
        if not stack:
            _active.pop(self._thread, None)
        try:
            if self.swaps is not None:  # (what the runs swapped, swapped back: last first)
                log, self.swaps = self.swaps, None
                _writes.close_swap_log(log)
        finally:
            _release()

    def swaps_seen(self) -> list[Finding]:
        """While active: a finding for the tensors swapped on this watch's runs so far (none:
        empty)."""
        log = self.swaps
        if log is None or not log.seen:
            return []
        return [Finding("", "torch.utils.swap_tensors", ("PYTHON_STATE",),
                        f"forward swaps a {log.seen[0]} tensor's contents "
                        "(torch.utils.swap_tensors) on a path beyond its first run: a change of "
                        "Python objects on every call, which a replay does not make")]


def _no_handle() -> RemovableHandle:
    """What a blocked registration returns: a handle whose ``remove()`` does nothing."""
    return RemovableHandle(collections.OrderedDict())  # (it holds a weak reference to it)


def _watches() -> list[HookWatch] | None:
    """The watches active on this thread, where a registration here is the user's (None for
    cudagraphify's own calls and those inside a noted registration)."""
    watches = _active.get(threading.get_ident())
    if not watches or getattr(_tls, "inner", None) is not None:
        return None
    if _probe.own_file(sys._getframe(2).f_code.co_filename):  # (its models are user code)
        return None
    return watches


def _note(watches: list[HookWatch], op: str, hook: Any, why: str = WHY) -> bool:
    """Note a registration in every active watch (an outer one's run holds this one's);
    returns whether one of them blocks it."""
    probe = _probe._active.get(threading.get_ident())
    path = probe.path if probe is not None else ""
    frame = _probe._user_frame()
    what = f"{op}({_hook_name(hook)})" if hook is not None else op
    where = f"{frame[0]}:{frame[1]}" if frame is not None else "?"
    finding = Finding(path, what, ("PYTHON_HOOK",), f"{where}: {why}",
                      *(frame if frame is not None else ()))
    for w in watches:
        w.found.append(finding)
    return any(w.block for w in watches)


def _hook_name(hook: Any) -> str:
    """``__qualname__`` of a hook (of the function a ``functools.partial`` holds; a callable
    object's class)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return name_of(hook)


def _blocked(self, name: str) -> bool:
    """Whether a blocked registration can stand in for the real one: where the real one would
    raise (no grad required; a post-accumulate hook on a non-leaf), it runs and raises."""
    return isinstance(self, torch.Tensor) and self.requires_grad and (
        self.is_leaf or name != "register_post_accumulate_grad_hook")


def _registering(name: str, original: Callable) -> Callable:
    """``Tensor.<name>`` (``register_hook``, ``register_post_accumulate_grad_hook``) noted."""

    @functools.wraps(original)
    def register(self, hook, *args, **kwargs):
        inner = getattr(_tls, "inner", None)
        if inner == "block" and _blocked(self, name):  # (a blocked multi-grad hook's)
            return _no_handle()
        watches = _watches()
        if watches is None:
            return original(self, hook, *args, **kwargs)
        if _note(watches, f"Tensor.{name}", hook) and _blocked(self, name):
            return _no_handle()
        return original(self, hook, *args, **kwargs)
    return register


def _node_registering(name: str, original: Callable) -> Callable:
    """``register_hook`` / ``register_prehook`` of an autograd Function's ``ctx`` (its
    backward node, a ``BackwardCFunction``: a Python class, unlike torch's C++ nodes) noted,
    and blocked on the runs beyond the real call. torch's own registrations (a module's full
    backward hooks go on a ``BackwardHookFunction``'s node) are not noted."""

    @functools.wraps(original)
    def register(self, hook, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename.startswith(_TORCH_DIR):
            return original(self, hook, *args, **kwargs)
        watches = _watches()
        if watches is None:
            return original(self, hook, *args, **kwargs)
        if _note(watches, f"Node.{name}", hook):
            return _no_handle()
        return original(self, hook, *args, **kwargs)
    return register


def _retaining(original: Callable) -> Callable:
    """``Tensor.retain_grad`` noted where it registers a hook (a non-leaf's first)."""

    @functools.wraps(original)
    def retain_grad(self):
        watches = _watches()
        if watches is None or not isinstance(self, torch.Tensor) or self.is_leaf \
                or self.retains_grad or not self.requires_grad:
            return original(self)
        if _note(watches, "Tensor.retain_grad", None):
            return None
        return original(self)
    return retain_grad


def _multi(original: Callable) -> Callable:
    """``torch.autograd.graph.register_multi_grad_hook``, noted with the user's hook (the
    ``register_hook`` calls it makes are not noted again; blocked where it is)."""

    @functools.wraps(original)
    def register_multi_grad_hook(tensors, fn, *args, **kwargs):
        watches = _watches()
        if watches is None:
            return original(tensors, fn, *args, **kwargs)
        _tls.inner = "block" if _note(watches, "register_multi_grad_hook", fn) else "noted"
        try:
            return original(tensors, fn, *args, **kwargs)
        finally:
            _tls.inner = None
    return register_multi_grad_hook


NODE_WHY = ("a read of an autograd node (Tensor.grad_fn) in forward: a hook registered on it "
            "(grad_fn.register_hook, register_prehook) is a C method no patch sees, and its "
            "Python would run in each backward, never a replay's; so the read alone refuses: "
            "it runs eagerly")


# (torch's own reads are not noted: non-reentrant checkpointing, DDP, full backward hooks,
# Dynamo and Tensor.register_hook read a node and register no hook on it. Those of
# ``Module._call_impl``'s file are, where it registers a module's deprecated non-full backward
# hooks on its output's node, and of ``torch.autograd.graph``'s, whose helpers hand the user a
# node: ``get_gradient_edge(t).node``)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MODULE_PY = os.path.abspath(torch.nn.modules.module.__file__)
_COUNTED = frozenset({_MODULE_PY, os.path.abspath(torch.autograd.graph.__file__)})


def node_read(filename: str) -> None:
    """The probe saw code of ``filename`` read a tensor's autograd node (``grad_fn``) and find
    one: noted in this thread's watches (``NODE_WHY``), unless torch's own code read it."""
    if filename.startswith(_TORCH_DIR) and filename not in _COUNTED:
        return
    watches = _active.get(threading.get_ident())
    if watches and getattr(_tls, "inner", None) is None:
        _note(watches, "Tensor.grad_fn", None, NODE_WHY)


FN_WHY = ("an autograd Function whose backward reads a tensor from outside (a global, a "
          "closure; not its ctx): a replay's backward reads the tensor captured, not the one "
          "bound when it runs, and nothing guards it; it runs eagerly")


def backward_reads(outputs: Any, limit: int = 200_000) -> list[Finding]:
    """Findings for the autograd Functions (Python ``backward``) in ``outputs``' autograd
    graph whose ``backward`` reads a tensor from outside (see :func:`_outside_in`); one for a
    graph too large to walk (over ``limit`` nodes)."""
    found: list[Finding] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    keep = list(stack)  # (the nodes walked stay alive: their ids stay theirs)
    checked: set[int] = set()
    while stack:
        if len(seen) >= limit:
            return [Finding("", "autograd graph", ("PYTHON_STATE",),
                            f"more than {limit} nodes: its autograd Functions' backwards were "
                            f"not all screened for tensors they read from outside; {FN_WHY}")]
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and id(cls) not in checked:
            checked.add(id(cls))
            backward = getattr(cls, "backward", None)
            what = _outside_in(backward)
            if what is not None:
                code = getattr(_unwrapped(backward), "__code__", None)
                file = code.co_filename if code is not None else None
                line = code.co_firstlineno if code is not None else None
                found.append(Finding("", f"{cls.__qualname__}.backward", ("PYTHON_STATE",),
                                     f"{file}:{line}: reads {what}: {FN_WHY}", file, line))
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None:
                stack.append(nxt)
                keep.append(nxt)
    return found


def _holds_tensor(v: Any, depth: int = 2) -> bool:
    """A tensor, or a list, tuple or dict holding one (``depth`` levels down)."""
    if isinstance(v, torch.Tensor):
        return True
    if depth <= 0:
        return False
    if isinstance(v, dict):
        v = list(v.values())
    return isinstance(v, (list, tuple)) and any(_holds_tensor(x, depth - 1) for x in v[:64])


def _unwrapped(fn: Any) -> Any:
    fn = getattr(fn, "__func__", fn)
    for _ in range(8):  # (@once_differentiable, @torch.amp.custom_bwd: functools.wraps)
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = getattr(inner, "__func__", inner)
    return fn


def _outside_in(fn: Any, depth: int = 0, looked: set[int] | None = None,
                owner: Any = None) -> str | None:
    """What ``fn`` (a backward, unwrapped) reads from outside that holds a tensor, named: a
    global or closure variable its code (nested code too: comprehensions, lambdas) loads, a
    default argument, or the attribute read right after loading one (``CONFIG.scale``,
    ``mod.TABLE``; ``self.scale`` where ``fn`` is a method of ``owner``). The functions it
    reaches that way are looked into too (:func:`_callee`: a helper called by a global or
    closure name, ``helpers.scale``, a static method, a method of a global object, a partial,
    an ``lru_cache``, a callable object's ``__call__``, a ``torch.library`` op's backward),
    four calls deep, each once per walk (``looked``: ids of the code objects seen); not the
    functions of torch or of an installed library reached by a global name (a library's
    module-level cache read there would refuse every user of that library). None where there
    is none."""
    fn = _unwrapped(fn)
    code = getattr(fn, "__code__", None)
    if code is None or depth > 4:
        return None
    looked = set() if looked is None else looked
    looked.add(id(code))
    scope = getattr(fn, "__globals__", {})
    cells = {}
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # (an empty cell)
            pass
    for d in (*(getattr(fn, "__defaults__", None) or ()),
              *(getattr(fn, "__kwdefaults__", None) or {}).values()):
        if _holds_tensor(d):
            return "a default argument"
    me = code.co_varnames[0] if owner is not None and code.co_argcount else None
    # what it reaches, to be looked into: (value, how it is named, whether a global name
    # reached it, the object a method found on it is called on)
    helpers: list[tuple[Any, str, bool, Any]] = []
    for c in nested_codes(code):
        instrs = list(dis.get_instructions(c))
        for i, ins in enumerate(instrs):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                if ins.argval not in scope:
                    continue
                value, named, by_name = scope[ins.argval], f"the global {ins.argval!r}", True
            elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in cells:
                value, by_name = cells[ins.argval], False
                named = f"the closure variable {ins.argval!r}"
            elif me is not None and c is code and ins.opname == "LOAD_FAST" \
                    and ins.argval == me:
                value, named, by_name = owner, "its object", False  # (``self``)
            else:
                continue
            if value is not owner:
                if _holds_tensor(value):
                    return named
                helpers.append((value, named, by_name, None))
            nxt = instrs[i + 1] if i + 1 < len(instrs) else None
            if nxt is not None and nxt.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                attr = inspect.getattr_static(value, nxt.argval, None)
                if _holds_tensor(attr):
                    return f"{named}'s {nxt.argval!r}"
                # (a plain function found through an object, not a class or module: a method
                # called on that object)
                on = value if isinstance(attr, types.FunctionType) \
                    and not isinstance(value, (type, types.ModuleType)) else None
                helpers.append((attr, f"{named}'s {nxt.argval!r}", by_name, on))
    helpers += [(v, f"the closure variable {n!r}", False, None) for n, v in cells.items()]
    for value, named, by_name, on in helpers:
        # (torch.library's register_autograd keeps the backward on an object in a closure)
        for v in (value, inspect.getattr_static(value, "_backward_fn", None)):
            f, bound = _callee(v)
            if f is None or id(f.__code__) in looked \
                    or (by_name and _library_file(f.__code__.co_filename)):
                continue
            what = _outside_in(f, depth + 1, looked, on if on is not None else bound)
            if what is not None:
                return f"{what}, through {named}"
    return None


def _callee(v: Any) -> tuple[types.FunctionType | None, Any]:
    """The Python function a call of ``v`` runs (through a static or class method, a bound
    method, a partial, ``functools.wraps`` and ``lru_cache`` wrappers, a callable object's
    class ``__call__``), and the object it is a method of (None); (None, None) where there is
    none. Read without running any ``__getattr__`` of ``v``'s."""
    bound = None
    for _ in range(8):
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        elif isinstance(v, types.MethodType):
            bound, v = v.__self__, v.__func__
        elif isinstance(v, functools.partial):
            v = v.func
        elif isinstance(v, types.FunctionType):
            inner = inspect.getattr_static(v, "__wrapped__", None)  # (functools.wraps' wrapper)
            if inner is None:
                return v, bound
            v = inner
        elif type(v).__module__ == "functools" \
                and inspect.getattr_static(v, "__wrapped__", None) is not None:
            v = inspect.getattr_static(v, "__wrapped__")  # (an lru_cache or cache wrapper)
        elif v is None or isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType)):
            return None, None
        else:
            call = inspect.getattr_static(type(v), "__call__", None)  # (a callable object)
            if not isinstance(call, types.FunctionType):
                return None, None
            bound, v = v, call
    return None, None


def _library_file(filename: str) -> bool:
    """Whether ``filename`` is torch's or an installed library's (site-packages)."""
    return filename.startswith(_TORCH_DIR) or any(
        part in ("site-packages", "dist-packages") for part in filename.split(os.sep))


def _swap_checked(original: Callable) -> Callable:
    """``torch.utils.swap_tensors``: on a run beyond the real call (a blocking watch), a leaf
    that requires grad and is held elsewhere (an AccumulateGrad node of the real call's
    autograd graph) is not swapped: torch would poison that node, and the user's backward of
    the real call would raise. The run fails instead (its signature runs eagerly)."""

    @functools.wraps(original)
    def swap_tensors(t1, t2, *args, **kwargs):
        watches = _active.get(threading.get_ident())
        if watches and any(w.block for w in watches):
            for t in (t1, t2):
                if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad \
                        and t._use_count() > 1:
                    raise RuntimeError(
                        "cudagraphify: a run beyond a first call's real call swaps a tensor "
                        "(torch.utils.swap_tensors) that requires grad and that an autograd "
                        "graph holds: torch would poison the real call's backward")
        return original(t1, t2, *args, **kwargs)
    return swap_tensors


def _swapping(original: Callable) -> Callable:
    """``torch._C._swap_tensor_impl`` (the last step of ``torch.utils.swap_tensors``): the pair
    noted in this thread's innermost blocking watch's log (see _writes), once swapped."""

    @functools.wraps(original)
    def swap_tensor_impl(t1, t2):
        out = original(t1, t2)
        _writes.note_swap(t1, t2)
        return out
    return swap_tensor_impl


def _targets() -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, wrapper maker) for each registering call."""
    out = [(torch.Tensor, n, functools.partial(_registering, n))
           for n in ("register_hook", "register_post_accumulate_grad_hook")
           if hasattr(torch.Tensor, n)]
    if hasattr(torch.Tensor, "retain_grad"):
        out.append((torch.Tensor, "retain_grad", _retaining))
    graph = getattr(torch.autograd, "graph", None)
    if graph is not None and hasattr(graph, "register_multi_grad_hook"):
        out.append((graph, "register_multi_grad_hook", _multi))
    if hasattr(torch._C, "_swap_tensor_impl"):
        out.append((torch._C, "_swap_tensor_impl", _swapping))
    if hasattr(torch.utils, "swap_tensors"):
        out.append((torch.utils, "swap_tensors", _swap_checked))
    ctx = getattr(torch.autograd.function, "BackwardCFunction", None)
    if ctx is not None:
        out += [(ctx, n, functools.partial(_node_registering, n))
                for n in ("register_hook", "register_prehook") if hasattr(ctx, n)]
    return out


def _acquire() -> None:
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for owner, attr, make in _targets():
            _probe.patch(owner, attr, make, _undo)


def _release() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            while _undo:
                _undo.pop()()
