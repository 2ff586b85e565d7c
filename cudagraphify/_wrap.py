"""How ``graphify`` attaches to a module, a class or a function, and how it comes off again.

A wrapt ``FunctionWrapper`` replaces ``forward`` (of a class, or of one instance) or wraps a plain
function; its wrapper function (:class:`Dispatch`) finds the callable's
:class:`~cudagraphify._engine.GraphedState` and hands it each call. Module hooks keep working:
they run around the wrapped ``forward`` as usual. The per-module state lives in the module's own
``__dict__`` under :data:`STATE` (and :data:`SHARE` for a ``share_graph`` layer).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import weakref
from typing import Any, Callable, NamedTuple

import torch
import wrapt

from . import _funcpieces, _guards, _watch
from ._engine import STATE, GraphedState
from ._fast import MISS, converting
from ._nested import bypassing as _bypassing, in_graphed_call, plain_reason
from ._nested import nesting as _nesting, segment_mode as _segment_mode
from ._errors import CudagraphifyUsageError, name_of
from ._options import Options
from ._probe import USER_CALL_FILE

__all__ = ["STATE", "SHARE", "Share", "GraphedForward", "graphed_forward", "graphed_forward_of",
           "install", "wrap", "install_pieces", "uninstall_instance", "uninstall_class",
           "state_of_module", "share_of", "retired", "drop_retired", "has_own_forward"]

SHARE = "_cudagraphify_share"  # a share_graph layer's Share, in its __dict__
# a plan's piece given back for good gets its plain forward back (see _retire_piece); off,
# its calls keep going through DirectCall, counted (tests of that path switch it off)
RETIRE_PIECES = True


class Share(NamedTuple):
    """A share_graph layer's place: its group and its index in the group's layers."""

    group: Any
    layer: int

    # A copied or unpickled layer is in no group (a graphified layer of its own, with no
    # graphs): the group's graphs read the memory of the layers it was made for.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_no_share, ())


def _no_share() -> None:
    return None


def state_of_module(module: torch.nn.Module) -> GraphedState | None:
    """The module's GraphedState (None before its first graphed call)."""
    return module.__dict__.get(STATE)


def share_of(module: torch.nn.Module) -> Share | None:
    """The :class:`Share` of a share_graph layer, else None."""
    return module.__dict__.get(SHARE)


class Dispatch:
    """The wrapt wrapper function of one ``graphify``: finds the state for a call and runs it."""

    def __init__(self, options: Options, kind: str, owner: Any, had_own: bool):
        self.options = options
        self.kind = kind  # "class", "instance" or "function"
        self.owner = owner
        self.had_own = had_own
        self.state: GraphedState | None = None  # for plain functions
        # the instances this (class) graphify made states for: ungraphify(cls) releases them
        self.instances: weakref.WeakSet = weakref.WeakSet()
        self._bindings: dict[bool, tuple[frozenset[int], frozenset[str]]] = {}
        # (a function's: the callable it was last called with, and its user_call)
        self._user_call: tuple[Any, Callable | None] = (None, None)

    def binding(self, fn: Callable, skip_self: bool) -> tuple[frozenset[int], frozenset[str]]:
        b = self._bindings.get(skip_self)
        if b is None:
            b = self._bindings[skip_self] = _static_binding(fn, self.options.static_argnames,
                                                            skip_self)
        return b

    def __call__(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        if _is_compiling():
            # Traced by torch.compile: run through the graphs at run time, outside the trace
            # (a graph break), instead of being traced into plain ops and bypassed.
            return _outside_compile(self, wrapped, instance, args, kwargs)
        if instance is None and self.kind == "instance":
            instance = self.owner  # a forward kept as a plain function (torch.compile's module)
        if isinstance(instance, torch.nn.Module):
            state = instance.__dict__.get(STATE)
            if state is None or state.dispatch is not self:
                # (a state of another graphify's: the class was ungraphified and graphified
                # again, perhaps with another forward)
                state = self._new_state(instance, wrapped)
            if not _watch.global_hooks_present():
                fast = state._fast  # the previous call's decision, re-checked (see _engine)
                if fast is not None:
                    out = fast.call(wrapped, args, kwargs)
                    if out is not MISS:
                        return out
                # (the signature replayed before it)
                if state._alt is not None and converting() is None:
                    out = state.other_fast(wrapped, args, kwargs)
                    if out is not MISS:
                        return out
            return state.slow(wrapped, args, kwargs)
        if instance is not None:
            raise CudagraphifyUsageError(
                "graphify wraps functions and torch.nn.Module forwards; "
                f"{type(instance).__name__} is not a Module. Graphify a function that takes its "
                "tensors as arguments instead")
        state = self.state
        if state is None:
            positions, names = self.binding(wrapped, skip_self=False)
            name = name_of(wrapped)
            state = self.state = GraphedState(None, self.options, name, positions, names)
        call = self._user_call
        if call[0] is not wrapped:  # (a deep copy's own callable, ``__wrapped__`` set anew)
            call = self._user_call = (wrapped, user_call(wrapped))
        return state(call[1] or wrapped, args, kwargs)

    def _new_state(self, module: torch.nn.Module, wrapped: Callable) -> GraphedState:
        if self.kind == "instance":
            positions, names = self.binding(wrapped, skip_self=False)
        else:
            positions, names = self.binding(getattr(wrapped, "__func__", wrapped), skip_self=True)
        options = self.options
        if _is_compiled(module):
            # Compiled code is opaque to the probe (the warm-up traces, the capture runs
            # kernels): no op screen; a failed capture still falls back to eager.
            options = dataclasses.replace(options, probe=False)
        old = module.__dict__.get(STATE)
        if old is not None:
            old.release()
            old.close_chain()
        state = GraphedState(
            module, options, f"{type(module).__name__}.forward", positions, names,
            install_pieces=lambda paths: install_pieces(module, paths, self.options),
            share=share_of(module))
        state.dispatch = self
        if RETIRE_PIECES and options.piece and self.kind == "instance" \
                and share_of(module) is None:
            # (a share_graph layer's piece keeps its proxy: its group's templates serve
            # the other layers' pieces)
            state.retire = functools.partial(_retire_piece, weakref.ref(module))
        module.__dict__[STATE] = state
        self.instances.add(module)
        DirectCall.install(module, self, state)
        return state


_is_compiling = torch.compiler.is_compiling
# DirectCall's ``is_compiling()``, one frame less: torch.compile's tracing folds
# ``is_dynamo_compiling()`` to True, and export sets the flag
if hasattr(torch.compiler, "is_dynamo_compiling") and hasattr(torch.compiler,
                                                              "_is_compiling_flag"):
    _dynamo_compiling, _compiler = torch.compiler.is_dynamo_compiling, torch.compiler
else:  # (a torch without them: is_compiling() itself)
    _dynamo_compiling, _compiler = _is_compiling, types.SimpleNamespace(_is_compiling_flag=False)
_tracing = torch._C._is_tracing  # (a bool: cheaper than _get_tracing_state's object)
_call_impl = torch.nn.Module._call_impl
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# (global_hooks_present(), inlined on DirectCall's path: one frame less on every call)
_global_a, _global_b, _global_c, _global_d = _watch._GLOBAL_DICTS


class DirectCall(_watch.CallImpl):
    """A graphed module's ``_compiled_call_impl``: ``module(...)`` comes here straight from
    ``Module.__call__``, past ``_call_impl`` and the wrapt proxy (about 2 µs a call).

    It stands in only while ``_call_impl`` would do nothing but call the graphed forward: no
    hooks on the module, none global, no TorchScript trace, ``_call_impl`` torch's own (not
    overridden by a subclass, patched, or set on the instance), and ``module.forward`` still
    the proxy it was installed for (its class and ``__dict__`` unchanged, no forward of the
    instance's own put in front of a class's). Otherwise it hands the call to ``_call_impl``,
    and where the proxy is gone (``ungraphify``) it removes itself. ``module.compile()``
    replaces it; torch.compile traces ``_call_impl`` and never calls it; a copied or pickled
    module drops it (``Module.__getstate__``), a DataParallel replica too (see
    :func:`_replicas_run_eagerly`)."""

    __slots__ = ("module", "d", "state", "fn", "proxy", "where", "own", "cls", "cls_dict",
                 "bound")

    @staticmethod
    def install(module: torch.nn.Module, dispatch: "Dispatch", state: GraphedState) -> None:
        d = module.__dict__
        if ("_compiled_call_impl" in d and not _watch.own_call_impl(d["_compiled_call_impl"])) \
                or not all(name in d for name in _HOOKS):
            return  # compiled by the user, or a module torch's own __init__ did not set up
        cls = type(module)
        if cls._call_impl is not _call_impl or "_call_impl" in d:
            return  # a _call_impl of its own: it must run
        own = d.get("forward")
        if dispatch.kind == "instance":
            if not isinstance(own, GraphedForward) or own._self_dispatch is not dispatch:
                return
            where, proxy, fn = d, own, own.__wrapped__
        else:
            proxy = cls.__dict__.get("forward")  # the class itself, not a subclass of it
            if own is not None or not isinstance(proxy, GraphedForward) \
                    or proxy._self_dispatch is not dispatch:
                return
            where, fn = cls.__dict__, proxy.__wrapped__.__get__(module, cls)
        first = next((k.__dict__["forward"] for k in cls.__mro__ if "forward" in k.__dict__),
                     None)
        if first is not proxy and (hasattr(type(first), "__set__")
                                   or hasattr(type(first), "__delete__")):
            return  # a data descriptor on the class comes before the instance's forward
        self = DirectCall()
        self.module, self.d, self.state, self.fn, self.cls = module, d, state, fn, cls
        self.proxy, self.where, self.own = proxy, where, own
        # (a class's: the instance's own ``forward`` is checked below as well; an instance's:
        # that check is this one)
        self.cls_dict = where if where is not d else None
        # (the bound method, not the object: a call of it costs less than an object's
        # ``__call__``, on every call; no setattr: not a change of the module's state)
        self.bound = self.__call__
        d["_compiled_call_impl"] = self.bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.d
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] \
                or d["_backward_pre_hooks"] or _global_a or _global_b or _global_c \
                or _global_d or _tracing() or _dynamo_compiling() \
                or _compiler._is_compiling_flag:
            # (torch.compile of ``module.__call__``, as HF generate does for a static cache,
            # traces ``_compiled_call_impl``: ``_call_impl`` reaches the proxy, which calls
            # the graphs outside the compiled code)
            return self.module._call_impl(*args, **kwargs)
        module = self.module
        cls_dict = self.cls_dict
        if (cls_dict is not None and cls_dict.get("forward") is not self.proxy) \
                or d.get("forward") is not self.own \
                or type(module) is not self.cls or module.__dict__ is not d \
                or self.cls._call_impl is not _call_impl or "_call_impl" in d:
            if d.get("_compiled_call_impl") is self.bound \
                    and self.where.get("forward") is not self.proxy:
                d.pop("_compiled_call_impl", None)  # ungraphified: step aside for good
            return module._call_impl(*args, **kwargs)
        state = self.state
        why = state.given_back
        if why is not None:  # a piece whose graph did not pay (see _trial)
            if state._backward_pending or _nesting[0]:
                mode = _segment_mode.mode if _nesting[0] else None
                if mode is not None and not state._backward_pending:
                    # (a segments' run: the module may be answered whole, see _segmodes)
                    return mode.module(module, self.fn, args, kwargs)
                return state._given_back(self.fn, args, kwargs)
            state.eager_calls[why] += 1  # (``_given_back``'s common case, one frame less)
            return self.fn(*args, **kwargs)
        if _nesting[0] and in_graphed_call():
            # inside a warm-up, capture or segments' run on this thread: part of it, as the
            # slow path would decide, without its checks (a segments' replay meets every
            # piece of its forward here); a plan trial's plain forward: counted
            plain = plain_reason()
            if plain is not None:
                state.eager_calls[plain] += 1
            mode = _segment_mode.mode
            if mode is not None:  # (a segments' run: the module may be answered whole)
                return mode.module(module, self.fn, args, kwargs)
            return self.fn(*args, **kwargs)
        bypass = state._bypass
        if bypass is not None and bypass[0] is _bypassing.token:
            decided = bypass[1]
            lone = decided.lone
            if state._fast is decided and (
                    lone(args[0]) if lone is not None and len(args) == 1 and not kwargs
                    else decided.fits(args, kwargs)):
                # a piece decided eager, of the root whose call this is (see _fast.Bypass),
                # called as decided: its plain forward, as its own decision would run it
                state.eager_calls[decided.reason] += 1
                return self.fn(*args, **kwargs)
        fast = state._fast
        if fast is not None:  # (no global module hooks: checked above)
            out = fast.call(self.fn, args, kwargs)
            if out is not MISS:
                return out
        # (the signature replayed before it: a prefill's)
        if state._alt is not None and converting() is None:
            out = state.other_fast(self.fn, args, kwargs)
            if out is not MISS:
                return out
        return state.slow(self.fn, args, kwargs)


_replicate = torch.nn.Module._replicate_for_data_parallel
_replicate_patched = False


def _replicas_run_eagerly() -> None:
    """Patch, once, ``nn.Module._replicate_for_data_parallel``: a DataParallel replica copies
    its module's ``__dict__``, graphs and DirectCall included, which belong to the original
    module and its parameters. A replica lives for one step, on its own device: it runs its
    own forward eagerly (a graph captured every step would cost more than it saves)."""
    global _replicate_patched
    if _replicate_patched:
        return

    def _replicate_for_data_parallel(self):
        replica = _replicate(self)
        d = replica.__dict__
        fwd = graphed_forward(replica)
        if STATE in d or fwd is not None:  # (a DirectCall comes with a state)
            d.pop(STATE, None)
            d.pop(SHARE, None)
            _drop_direct_call(d)
            if fwd is not None:
                fn = fwd.__wrapped__
                if fwd._self_dispatch.kind == "instance" and fwd._self_dispatch.had_own:
                    d["forward"] = fn  # (the instance's own, as the replica had it)
                else:
                    d["forward"] = getattr(fn, "__func__", fn).__get__(replica, type(replica))
        return replica

    torch.nn.Module._replicate_for_data_parallel = _replicate_for_data_parallel
    _replicate_patched = True


def _drop_direct_call(d: dict) -> None:
    """Remove cudagraphify's DirectCall from a module's ``__dict__`` (a user's call override
    stays)."""
    if _watch.own_call_impl(d.get("_compiled_call_impl")):
        del d["_compiled_call_impl"]


def _is_compiled(module: torch.nn.Module) -> bool:
    """A ``torch.compile``'d or ``thunder.jit``'d module (its forward runs compiled code)."""
    name = type(module).__name__
    return (name == "OptimizedModule" and "_orig_mod" in module._modules) or \
        (name == "ThunderModule" and "_model" in module._modules)


_disabled_call: Callable | None = None


def _outside_compile(dispatch: Dispatch, wrapped: Callable, instance: Any, args: tuple,
                     kwargs: dict) -> Any:
    """Call ``dispatch`` where torch.compile does not trace (made on first use: building it
    imports torch._dynamo, which costs a second at import time)."""
    global _disabled_call
    if _disabled_call is None:
        _disabled_call = torch.compiler.disable(
            lambda d, w, i, a, kw: d(w, i, a, kw))
    return _disabled_call(dispatch, wrapped, instance, args, kwargs)


class _OwnClass:
    """A proxy reports its wrapped's class: ``isinstance(forward, types.MethodType)`` would
    hold, and torch.compile (torch 2.11, wrapt 2.5) then traced the original
    forward from ``__func__``, bypassing the graphs without a word. Reporting our own class
    makes it call us (a graph break to the graphs, see ``_outside_compile``)."""

    __slots__ = ()

    @property
    def __class__(self):
        return type(self)


class BoundGraphedForward(_OwnClass, wrapt.BoundFunctionWrapper):
    """A graphified class's forward, looked up on an instance."""


class GraphedForward(_OwnClass, wrapt.FunctionWrapper):
    """The wrapper ``graphify`` installs. Its ``_self_`` state never leaks onto the wrapped."""

    __bound_function_wrapper__ = BoundGraphedForward

    def __init__(self, wrapped: Callable, dispatch: Dispatch):
        super().__init__(wrapped, dispatch)
        self._self_dispatch = dispatch

    def __deepcopy__(self, memo):
        # A deep-copied module gets the same options and a fresh, empty graph cache.
        import copy

        d = self._self_dispatch
        return GraphedForward(copy.deepcopy(self.__wrapped__, memo),
                               Dispatch(d.options, d.kind, None, d.had_own))

    def __reduce_ex__(self, protocol):
        if self._self_dispatch.options.piece:
            # A plan's piece (a class-graphified model pickled after its first calls): it
            # unpickles as its plain forward; the root plans again on its first call.
            return (_plain_forward, (self.__wrapped__,))
        raise CudagraphifyUsageError(
            "a graphified forward cannot be pickled; call cudagraphify.ungraphify(...) first, "
            "or graphify the class instead of the instance")


_guards.WRAPPERS.append(GraphedForward)


def _plain_forward(fn: Callable) -> Callable:
    return fn


def _static_binding(fn: Callable, static_argnames: tuple[str, ...],
                    skip_self: bool) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and names of the arguments declared static, checked against ``fn``'s signature."""
    if not static_argnames:
        return frozenset(), frozenset()
    fn = getattr(fn, "__wrapped__", fn) if isinstance(fn, GraphedForward) else fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(), frozenset(static_argnames)
    if skip_self and params:
        params = params[1:]
    names = [p.name for p in params]
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = [n for n in static_argnames if n not in names]
    if unknown and not takes_kwargs:
        raise CudagraphifyUsageError(
            f"static_argnames names {unknown} that {name_of(fn)} does not "
            f"take; its arguments are {names}"
        )
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positions = frozenset(i for i, p in enumerate(params)
                          if p.name in static_argnames and p.kind in positional)
    return positions, frozenset(static_argnames)


def install_pieces(root: torch.nn.Module, paths: list[str], options: Options) -> list:
    """Graphify the submodules at ``paths`` (a piecewise plan); returns those it wrapped, and
    those a plan had wrapped already (a deep copy of a planned root brings its pieces along).

    Pieces take the root's run options (warm-up, probe, op policy, enabled, bound) but not its
    keying options (argument names and cache policies describe the root's forward), and always
    copy their outputs: a submodule called twice in one forward must not get its first result
    overwritten by its second call. The functions of the root's library graphed as pieces are
    put in place too (:func:`~._funcpieces.install_for`).
    """
    options = dataclasses.replace(options, static_argnames=(), cache_policy=None,
                                  copy_outputs=True, piece=True)
    if paths:  # (the functions its library's modules graph as pieces: see _funcpieces)
        _funcpieces.install_for(root)
    installed = []
    share = share_of(root)  # a share_graph layer: pieces share too
    for path in paths:
        sub = _submodule(root, path)
        fwd = sub.__dict__.get("forward")
        if isinstance(fwd, GraphedForward) and fwd._self_dispatch.options.piece \
                and sub is not root:
            # a piece of a plan already (this root's earlier plan, or the plan of the root a
            # deep copy was made of: its pieces came with it)
            installed.append(sub)
            continue
        if sub is root or graphed_forward(sub) is not None or retired(sub):
            continue  # graphed by the user, or given back
        if share is not None:
            sub.__dict__[SHARE] = Share(share.group.piece_group(path), share.layer)
        install(sub, sub.forward, options, "instance", has_own_forward(sub))
        installed.append(sub)
    return installed


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule at a ``named_modules`` path (``get_submodule`` may be overridden: Thunder's
    module resolves names inside the module it wraps)."""
    for name in path.split(".") if path else ():
        root = root._modules[name]
    return root


def graphed_forward_of(cls: type) -> GraphedForward | None:
    attr = inspect.getattr_static(cls, "forward", None)
    return attr if isinstance(attr, GraphedForward) else None


def graphed_forward(module: torch.nn.Module) -> GraphedForward | None:
    """The graphified forward of ``module``: its own (an instance graphified) or its class's."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, GraphedForward) else graphed_forward_of(type(module))


def wrap(fn: Callable, options: Options, kind: str, owner: Any, had_own: bool) -> GraphedForward:
    dispatch = Dispatch(options, kind, owner, had_own)
    # Check static_argnames against the signature now, not at the first call.
    dispatch.binding(fn, skip_self=(kind == "class"))
    return GraphedForward(fn, dispatch)


# callables whose call runs no Python frame before the torch call it is (``torch.sin``,
# ``F.gelu``, ``torch.Tensor.add``), and partials of them
_C_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType,
                types.WrapperDescriptorType, types.MethodWrapperType,
                types.ClassMethodDescriptorType)


def user_call(fn: Callable) -> Callable | None:
    """For a graphified torch function (``graphify(torch.sin)``): a one-line function of the
    user's that calls it, or None for any other callable. The probe and the segment modes
    leave out the torch calls made from cudagraphify's own frames (its reads of real values);
    a torch function called straight from the one that runs the user's callable would be left
    out too, and its output seen as made outside the call. Its guard still reads the callable
    it calls (see ``_guards.callable_state``: a partial's bound arguments)."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    if not isinstance(inner, _C_CALLABLES):
        return None
    env = {"fn": fn}
    exec(compile("def call(*args, **kwargs):\n    return fn(*args, **kwargs)\n",
                 f"{USER_CALL_FILE}{name_of(fn)}>", "exec"), env)
    call = env["call"]
    call.__cudagraphify_calls__ = fn
    return call


def install(obj: Any, fn: Callable, options: Options, kind: str, had_own: bool) -> None:
    _replicas_run_eagerly()
    proxy = wrap(fn, options, kind, obj, had_own)
    if kind == "class":
        setattr(obj, "forward", proxy)
    else:
        obj.__dict__["forward"] = proxy




def uninstall_instance(module: torch.nn.Module) -> None:
    """Restore an instance's own ``forward``, leave its share_graph group, release its graphs and
    those of the submodules a piecewise plan graphified."""
    _restore_forward(module)
    _drop_state(module)


def _restore_forward(module: torch.nn.Module) -> None:
    """Put back what the instance's ``forward`` was before graphify: its class's (the proxy
    goes), or a forward of the instance's own (accelerate's hooks set one), which stays. One
    store: a call on another thread meanwhile runs the one or the other."""
    d = module.__dict__
    proxy = d["forward"]
    if proxy._self_dispatch.had_own:
        d["forward"] = proxy.__wrapped__
    else:
        del d["forward"]


def has_own_forward(module: torch.nn.Module) -> bool:
    """Whether the instance holds a ``forward`` of its own (accelerate's hooks set one), which
    ``ungraphify`` must put back; a bound method of its class's forward (what unpickling a plan's
    piece leaves, see ``GraphedForward.__reduce_ex__``) is not one."""
    own = module.__dict__.get("forward")
    if own is None:
        return False
    return getattr(own, "__self__", None) is not module or getattr(own, "__func__", None) \
        is not inspect.getattr_static(type(module), "forward", None)


def _retire_piece(ref: weakref.ref) -> None:
    """A plan's piece given back for good (see _pieces.PieceRuns.give_back): its plain forward is
    put back, and its DirectCall removed, so that its calls cost what they cost without
    cudagraphify. Its state stays in its ``__dict__`` (stats, explain, and the next plan
    leaves it as it is: :func:`retired`) until its root is ungraphified."""
    module = ref()
    if module is None:
        return
    d = module.__dict__
    fwd = d.get("forward")
    from . import _segrun  # (not at import: it imports the engine)
    if isinstance(fwd, GraphedForward) and (fwd._self_dispatch.options.segments
                                            or _segrun.ENABLED):
        return  # (with segments on, its DirectCall stays: a segments' replay answers it whole)
    if isinstance(fwd, GraphedForward) and fwd._self_dispatch.options.piece:
        if isinstance(getattr(d.get("_compiled_call_impl"), "__self__", None), DirectCall):
            # (not deleted: ``Module._wrapped_call_impl`` reads it twice, and a call on another
            # thread between the two reads would get None; ``_call_impl`` itself, as a module
            # without it runs, through a partial: a C call, no Python frame)
            d["_compiled_call_impl"] = _watch.PlainCall(_call_impl, module)
        _restore_forward(module)


def drop_retired(module: torch.nn.Module) -> None:
    """Forget a given-back piece's state (``ungraphify`` of it, or of its root): a later plan
    graphifies it anew."""
    _drop_state(module)


def retired(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plan's piece given back for good (see :func:`_retire_piece`)."""
    state = module.__dict__.get(STATE)
    return state is not None and state.given_back is not None and state.retire is None \
        and state.options.piece and not isinstance(module.__dict__.get("forward"),
                                                    GraphedForward)


def uninstall_class(cls: type, proxy: GraphedForward) -> None:
    """Restore the class's ``forward``; release the states it made for its instances and the
    pieces their plans graphified (those stay graphed otherwise)."""
    dispatch = proxy._self_dispatch
    if dispatch.had_own:
        setattr(cls, "forward", proxy.__wrapped__)
    else:
        delattr(cls, "forward")
    for module in list(dispatch.instances):
        state = module.__dict__.get(STATE)
        if state is not None and state.dispatch is dispatch:
            _drop_state(module)
    dispatch.instances.clear()


def _drop_state(module: torch.nn.Module) -> None:
    _drop_direct_call(module.__dict__)
    module.__dict__.pop(SHARE, None)
    state = module.__dict__.pop(STATE, None)
    if state is not None:
        state.release()
        state.close_chain()
        for piece in state.pieces:
            fwd = piece.__dict__.get("forward")
            if isinstance(fwd, GraphedForward):
                if fwd._self_dispatch.options.piece:  # (not a graphify of the user's own)
                    uninstall_instance(piece)
            elif retired(piece):
                drop_retired(piece)
