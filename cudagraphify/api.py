"""The public entry points: ``graphify``, ``ungraphify``, ``stats``, ``explain``, ``share_graph``.

``graphify`` wraps ``forward`` (of a Module class, or of one instance) or a plain function with a
wrapt ``FunctionWrapper``; the wrapper hands each call to the callable's
:class:`~cudagraphify._engine.GraphedState`. Module hooks keep working: they run around the
wrapped ``forward`` as usual.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Hashable

import torch
import wrapt

from ._cache import CachePolicy, KeyFnPolicy
from ._engine import GraphedState, Options, Stats
from ._errors import CudagraphifyUsageError
from ._policy import OpPolicy, default_policy
from ._region import GraphRegion
from ._signature import Signature

__all__ = ["graphify", "ungraphify", "stats", "explain", "share_graph", "tag_op", "mark_safe"]

_STATE = "_cudagraphify_state"


class _Dispatch:
    """The wrapt wrapper function of one ``graphify``: finds the state for a call and runs it."""

    def __init__(self, options: Options, kind: str, owner: Any, had_own: bool):
        self.options = options
        self.kind = kind  # "class", "instance" or "function"
        self.owner = owner
        self.had_own = had_own
        self.state: GraphedState | None = None  # for plain functions
        self._bindings: dict[bool, tuple[frozenset[int], frozenset[str]]] = {}

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
            state = instance.__dict__.get(_STATE)
            if state is None:
                state = self._new_state(instance, wrapped)
            return state(wrapped, args, kwargs)
        if instance is not None:
            raise CudagraphifyUsageError(
                "graphify wraps functions and torch.nn.Module forwards; "
                f"{type(instance).__name__} is not a Module. Graphify a function that takes its "
                "tensors as arguments instead")
        state = self.state
        if state is None:
            positions, names = self.binding(wrapped, skip_self=False)
            name = getattr(wrapped, "__qualname__", repr(wrapped))
            state = self.state = GraphedState(None, self.options, name, positions, names)
        return state(wrapped, args, kwargs)

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
        state = GraphedState(module, options, f"{type(module).__name__}.forward",
                             positions, names)
        state.install_pieces = lambda paths: _install_pieces(module, paths, self.options)
        state.share = module.__dict__.get("_cudagraphify_share")
        if state.share is not None:
            # The group's layers replay through one set of static buffers: one lock for all.
            state.lock = state.share[0].lock
        module.__dict__[_STATE] = state
        return state


_is_compiling = torch.compiler.is_compiling


def _is_compiled(module: torch.nn.Module) -> bool:
    """A ``torch.compile``'d or ``thunder.jit``'d module (its forward runs compiled code)."""
    name = type(module).__name__
    return (name == "OptimizedModule" and "_orig_mod" in module._modules) or \
        (name == "ThunderModule" and "_model" in module._modules)


_disabled_call: Callable | None = None


def _outside_compile(dispatch: _Dispatch, wrapped: Callable, instance: Any, args: tuple,
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


class _BoundGraphedForward(_OwnClass, wrapt.BoundFunctionWrapper):
    """A graphified class's forward, looked up on an instance."""


class _GraphedForward(_OwnClass, wrapt.FunctionWrapper):
    """The wrapper ``graphify`` installs. Its ``_self_`` state never leaks onto the wrapped."""

    __bound_function_wrapper__ = _BoundGraphedForward

    def __init__(self, wrapped: Callable, dispatch: _Dispatch):
        super().__init__(wrapped, dispatch)
        self._self_dispatch = dispatch

    def __deepcopy__(self, memo):
        # A deep-copied module gets the same options and a fresh, empty graph cache.
        import copy

        d = self._self_dispatch
        return _GraphedForward(copy.deepcopy(self.__wrapped__, memo),
                               _Dispatch(d.options, d.kind, None, d.had_own))

    def __reduce_ex__(self, protocol):
        raise CudagraphifyUsageError(
            "a graphified forward cannot be pickled; call cudagraphify.ungraphify(...) first, "
            "or graphify the class instead of the instance")


def _static_binding(fn: Callable, static_argnames: tuple[str, ...],
                    skip_self: bool) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and names of the arguments declared static, checked against ``fn``'s signature."""
    if not static_argnames:
        return frozenset(), frozenset()
    fn = getattr(fn, "__wrapped__", fn) if isinstance(fn, _GraphedForward) else fn
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
            f"static_argnames names {unknown} that {getattr(fn, '__qualname__', fn)} does not "
            f"take; its arguments are {names}"
        )
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positions = frozenset(i for i, p in enumerate(params)
                          if p.name in static_argnames and p.kind in positional)
    return positions, frozenset(static_argnames)


def _install_pieces(root: torch.nn.Module, paths: list[str], options: Options) -> list:
    """Graphify the submodules at ``paths`` (a piecewise plan); returns those it wrapped.

    Pieces take the root's run options (warm-up, outputs, probe, op policy, enabled, bound) but
    not its keying options: argument names and cache policies describe the root's forward.
    """
    options = Options(num_warmup_iters=options.num_warmup_iters, max_graphs=options.max_graphs,
                      enabled=options.enabled, copy_outputs=options.copy_outputs,
                      probe=options.probe, op_policy=options.op_policy)
    installed = []
    share = root.__dict__.get("_cudagraphify_share")  # a share_graph layer: pieces share too
    for path in paths:
        sub = _submodule(root, path)
        if sub is root or _graphed_forward(sub) is not None:
            continue  # graphed already (by the user, or an earlier plan)
        if share is not None:
            group, k = share
            sub.__dict__["_cudagraphify_share"] = (group.piece_group(path), k)
        _install(sub, sub.forward, options, "instance", False)
        installed.append(sub)
    return installed


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule at a ``named_modules`` path (``get_submodule`` may be overridden: Thunder's
    module resolves names inside the module it wraps)."""
    for name in path.split(".") if path else ():
        root = root._modules[name]
    return root


def _options(num_warmup_iters, static_argnames, max_graphs, enabled, copy_outputs, cache_policy,
             key_fn, probe="auto", op_policy=None) -> Options:
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) \
            or num_warmup_iters < 1:
        raise CudagraphifyUsageError(
            f"num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    static_argnames = tuple(static_argnames)
    if not all(isinstance(n, str) for n in static_argnames):
        raise CudagraphifyUsageError(f"static_argnames must be names, got {static_argnames!r}")
    if not (isinstance(enabled, bool) or callable(enabled)):
        raise CudagraphifyUsageError(f"enabled must be a bool or a callable, got {enabled!r}")
    if cache_policy is not None and key_fn is not None:
        raise CudagraphifyUsageError("give cache_policy or key_fn, not both")
    if cache_policy is not None and not isinstance(cache_policy, CachePolicy):
        raise CudagraphifyUsageError(
            f"cache_policy must be a cudagraphify.CachePolicy, got {type(cache_policy).__name__}")
    if probe not in ("auto", "thunder", False):
        raise CudagraphifyUsageError(f'probe must be "auto", "thunder" or False, got {probe!r}')
    if op_policy is not None and not isinstance(op_policy, OpPolicy):
        raise CudagraphifyUsageError(
            f"op_policy must be a cudagraphify.OpPolicy, got {type(op_policy).__name__}")
    if key_fn is not None:
        if not callable(key_fn):
            raise CudagraphifyUsageError(f"key_fn must be callable, got {key_fn!r}")
        cache_policy = KeyFnPolicy(key_fn, max_graphs=max_graphs)
    elif cache_policy is None:
        cache_policy = CachePolicy(max_graphs=max_graphs)
    return Options(num_warmup_iters=num_warmup_iters, static_argnames=static_argnames,
                   max_graphs=cache_policy.max_graphs, enabled=enabled,
                   copy_outputs=bool(copy_outputs), cache_policy=cache_policy, probe=probe,
                   op_policy=op_policy)


def _graphed_forward_of(cls: type) -> _GraphedForward | None:
    attr = inspect.getattr_static(cls, "forward", None)
    return attr if isinstance(attr, _GraphedForward) else None


def _graphed_forward(module: torch.nn.Module) -> _GraphedForward | None:
    """The graphified forward of ``module``: its own (an instance graphified) or its class's."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, _GraphedForward) else _graphed_forward_of(type(module))


def graphify(
    target: Any = None,
    /,
    *,
    num_warmup_iters: int = 1,
    static_argnames: tuple[str, ...] | str = (),
    max_graphs: int = 16,
    enabled: bool | Callable[[], bool] = True,
    copy_outputs: bool = True,
    cache_policy: CachePolicy | None = None,
    key_fn: Callable[[Signature], Hashable] | None = None,
    probe: str | bool = "auto",
    op_policy: OpPolicy | None = None,
):
    """Run a module's ``forward`` (or a function) through CUDA graphs, one per input signature.

    Forms, each bare or with options::

        @graphify                       # every instance of the class
        class Block(nn.Module): ...

        model = graphify(model)         # this instance, in place; returns it

        @graphify(max_graphs=4)         # a plain function
        def step(x, y): ...

    The first call with a new signature runs eagerly on a side stream (its result is that call's
    result; ``num_warmup_iters - 1`` more warm-up runs go on copies of the inputs), then a graph
    is captured. Later calls with the same signature copy tensor arguments into the graph's
    static inputs, replay, and return the outputs.

    Args:
        num_warmup_iters: eager runs before capture (the first is the real call).
        static_argnames: arguments read in place instead of copied: their tensors' addresses
            become part of the signature (see :func:`mark_static`).
        max_graphs: graphs kept per callable; the least recently used is released beyond it.
        enabled: ``False`` (or a callable returning ``False``) runs eagerly.
        copy_outputs: ``True`` (default) returns fresh copies of outputs that live in the graph's
            memory, so a later call never overwrites them. ``False`` returns the graph's own
            output tensors: zero copy, but **the next call overwrites them** — copy what you
            keep.
        cache_policy: a :class:`CachePolicy` (subclass it to change keys or bounds).
        key_fn: shorthand for a policy whose ``key(signature)`` is ``key_fn``.
        probe: how the first call of a signature is screened for ops a graph cannot hold.
            ``"auto"`` (default): cudagraphify's rules and PyTorch's op tags; Thunder's symbol
            tags are used by ``explain``. ``"thunder"``: Thunder's tags on every op too (imports
            Thunder: seconds, once). ``False``: no screen (a failed capture still falls back).
            A module with unsafe ops runs eagerly while its largest safe submodules are graphed.
        op_policy: an :class:`OpPolicy` (subclass it to change decisions); default: the global
            one that ``tag_op``/``mark_safe`` update.

    .. warning::
        Graphs replay GPU work only. Python side effects inside ``forward`` (prints, counters,
        hooks on submodules, changing non-tensor attributes) happen during the first call of a
        signature only. Parameters and buffers are read in place and guarded; other tensors the
        forward reads from outside its arguments (globals, plain attributes) are read at the
        address they had at capture.
    """
    options = _options(num_warmup_iters, static_argnames, max_graphs, enabled, copy_outputs,
                       cache_policy, key_fn, probe, op_policy)
    if target is None:
        return lambda t: _graphify(t, options)
    return _graphify(target, options)


def _graphify(target: Any, options: Options) -> Any:
    if isinstance(target, type):
        if not issubclass(target, torch.nn.Module):
            raise CudagraphifyUsageError(
                f"graphify on a class needs a torch.nn.Module subclass, got {target.__name__}")
        if _graphed_forward_of(target) is not None:
            raise CudagraphifyUsageError(f"{target.__name__} is already graphified")
        had_own = "forward" in target.__dict__
        _install(target, target.forward, options, "class", had_own)
        return target
    if isinstance(target, torch.nn.Module):
        if isinstance(target.__dict__.get("forward"), _GraphedForward):
            raise CudagraphifyUsageError(
                f"this {type(target).__name__} instance is already graphified; "
                "call cudagraphify.ungraphify(module) first to change its options")
        if _graphed_forward_of(type(target)) is not None:
            raise CudagraphifyUsageError(
                f"{type(target).__name__} is graphified as a class already; its instances are "
                "graphed without graphify(instance)")
        _install(target, target.forward, options, "instance", False)
        return target
    if isinstance(target, _GraphedForward):
        raise CudagraphifyUsageError("this function is already graphified")
    if callable(target):
        return _wrap(target, options, "function", None, True)
    raise CudagraphifyUsageError(
        f"graphify expects a Module subclass, a Module instance or a function, got "
        f"{type(target).__name__}")


def _wrap(fn: Callable, options: Options, kind: str, owner: Any, had_own: bool) -> _GraphedForward:
    dispatch = _Dispatch(options, kind, owner, had_own)
    # Check static_argnames against the signature now, not at the first call.
    dispatch.binding(fn, skip_self=(kind == "class"))
    return _GraphedForward(fn, dispatch)


def _install(obj: Any, fn: Callable, options: Options, kind: str, had_own: bool) -> None:
    proxy = _wrap(fn, options, kind, obj, had_own)
    if kind == "class":
        setattr(obj, "forward", proxy)
    else:
        obj.__dict__["forward"] = proxy


def ungraphify(target: Any) -> Any:
    """Undo :func:`graphify`: restore the original ``forward`` (or function) and free the graphs.

    Returns the class, the module, or the original function.
    """
    if isinstance(target, type):
        proxy = _graphed_forward_of(target)
        if proxy is None or proxy._self_dispatch.owner is not target:
            raise CudagraphifyUsageError(f"{target.__name__} is not graphified")
        if proxy._self_dispatch.had_own:
            setattr(target, "forward", proxy.__wrapped__)
        else:
            delattr(target, "forward")
        return target
    if isinstance(target, torch.nn.Module):
        if not isinstance(target.__dict__.get("forward"), _GraphedForward):
            how = ("through its class; call ungraphify(type(module))"
                   if _graphed_forward_of(type(target)) is not None else "")
            raise CudagraphifyUsageError(
                f"this {type(target).__name__} instance is not graphified {how}".rstrip())
        del target.__dict__["forward"]
        target.__dict__.pop("_cudagraphify_share", None)  # leaves its share_graph group
        state = target.__dict__.pop(_STATE, None)
        if state is not None:
            state.release()
            for piece in state.pieces:  # submodules a piecewise plan graphified
                if isinstance(piece.__dict__.get("forward"), _GraphedForward):
                    ungraphify(piece)
        return target
    if isinstance(target, _GraphedForward):
        if target._self_dispatch.state is not None:
            target._self_dispatch.state.release()
        return target.__wrapped__
    raise CudagraphifyUsageError(f"{target!r} is not graphified")


def _op_policy_of(module: torch.nn.Module, state: GraphedState | None) -> OpPolicy | None:
    """The ``op_policy`` ``module`` was graphified with (before its first call too)."""
    if state is not None:
        return state.options.op_policy
    fwd = _graphed_forward(module)
    return fwd._self_dispatch.options.op_policy if fwd is not None else None


def _state_of(target: Any) -> GraphedState | None:
    if isinstance(target, torch.nn.Module):
        state = target.__dict__.get(_STATE)
        if state is None and _graphed_forward(target) is None:
            raise CudagraphifyUsageError(f"this {type(target).__name__} is not graphified")
        return state
    if isinstance(target, _GraphedForward):
        return target._self_dispatch.state
    raise CudagraphifyUsageError(
        f"expected a graphified module, function or graph_region, got {type(target).__name__}")


def stats(target: Any) -> Stats:
    """Counters of a graphified module, function, or a :class:`graph_region`.

    captures, replays, eager calls by reason, capture seconds, graph pool bytes (reserved by the
    live graphs' pools), live graphs, evictions, invalidations (parameters moved). A module run
    piecewise counts its graphed submodules' calls too (its own eager calls say "piecewise").
    """
    if isinstance(target, GraphRegion):
        return target.stats()
    state = _state_of(target)
    return _with_pieces(state) if state is not None else Stats()


def _with_pieces(state: GraphedState) -> Stats:
    total = state.stats()
    for piece in state.pieces:
        piece_state = piece.__dict__.get(_STATE)
        if piece_state is not None:
            total = total + _with_pieces(piece_state)
    return total


def explain(target: Any, *example_args: Any, **example_kwargs: Any):
    """What cudagraphify does with ``target``: a module tree, each node graphed or eager and why.

    With example inputs, the plan comes from a probe run of ``target`` on them (twice, to see
    data-dependent control flow), with Thunder's tags too; this works on a CPU (CPU tensors
    stand for CUDA ones) and leaves the module as it was (buffers and RNG state restored, no
    graphs made). Without inputs, it reports the plan and counters of the calls made so far.
    ``str()`` of the result is the tree; ``.to_dict()`` / ``.to_json()`` the same as data.
    """
    from ._explain import build, probe_plan

    module = target if isinstance(target, torch.nn.Module) else None
    graphed = module is None or _graphed_forward(module) is not None
    state = _state_of(target) if graphed else None
    name = (state.name if state is not None else
            type(target).__name__ if module is not None else
            getattr(target, "__qualname__", repr(target)))
    stats_ = state.stats() if state is not None else Stats()
    decisions = state.decisions() if state is not None else []
    if example_args or example_kwargs:
        if module is None:
            raise CudagraphifyUsageError("explain with example inputs needs a torch.nn.Module")
        plan = probe_plan(module, example_args, example_kwargs, _op_policy_of(module, state))
    elif state is not None and state.last_plan is not None:
        findings, pieces = state.last_plan
        plan = (findings, pieces, None)
    elif state is not None and (state.captures or state.retargets):
        plan = ({}, [""], None)
    else:
        plan = None
    return build(name, module, plan, stats_, decisions)


def tag_op(fn: Callable, *tags) -> None:
    """Tag ``fn`` (your function or custom op) for every graphed call that uses it.

    Tags are :class:`Tag` objects or their names (``"HOST_SYNC"``...); a call whose tags the
    policy refuses runs eagerly while its safe neighbours stay graphed.
    """
    default_policy.tag_op(fn, *tags)


def mark_safe(fn: Callable) -> None:
    """Declare ``fn`` safe to capture, whatever other tags it has."""
    default_policy.mark_safe(fn)


def share_graph(layers: Any, *, ignore_attrs: tuple[str, ...] | str = (), strict: bool = True,
                **options: Any):
    """Capture once and replay across identical layers, each with its own weights.

    ``layers`` is an ``nn.ModuleList`` or a sequence of modules of one structure (class,
    submodules, parameter and buffer shapes/dtypes/strides, plain attributes; a difference is an
    error naming it). Each layer is graphified in place with ``options`` (those of
    :func:`graphify`); calling any layer, as the parent's usual loop does, replays the shared
    capture: per input signature the first layer called is captured once (plus one capture of
    a second layer, to tell weight addresses from other bytes), and every layer gets a copy of
    that graph whose weight addresses are its own, checked once against its eager output. No
    weights are copied per call, and graph memory does not grow with the number of layers.

    Where sharing cannot be proven (see ``group.stats()["reasons"]``: random ops, training,
    calls inside a ``graph_region``, a kernel argument that is not a rebased address), each layer
    captures its own graph in one memory pool shared by the group.

    Args:
        ignore_attrs: plain attributes allowed to differ between layers because forward does
            not use them, as ``"self_attn.layer_idx"`` (path inside the layer) or a bare name.
        strict: refuse sharing when two layers' captures differ in a kernel argument that is
            neither a rebased address nor proven capture-dependent nor one byte long (an empty
            functor's byte, counted as unproven) (default). ``strict=False``
            keeps such bytes as the template has them when they are no device address in
            either capture (the uninitialised tail of a kernel's argument struct, as in HF
            Llama's RMSNorm reduction) and relies on the check of each layer's graph against
            its eager output: a per-layer scalar the forward reads from somewhere the
            structural check does not see would then be taken from the template layer.

    Returns the :class:`ShareGroup` (``stats()``, ``release()``, ``unshare()``).
    """
    from ._share import ShareGroup, check_layers

    if isinstance(ignore_attrs, str):
        ignore_attrs = (ignore_attrs,)
    if options.get("copy_outputs", True) is False:
        raise CudagraphifyUsageError(
            "share_graph with copy_outputs=False: the layers share one set of output buffers, "
            "so each layer's output would be overwritten by the next layer's call")
    mods = check_layers(layers, tuple(ignore_attrs))
    for i, layer in enumerate(mods):
        if _graphed_forward(layer) is not None:
            raise CudagraphifyUsageError(
                f"share_graph: layer {i} is graphified already; share_graph graphifies the "
                "layers itself (ungraphify them first)")
    group = ShareGroup(mods, tuple(ignore_attrs), strict,
                       max_templates=options.get("max_graphs", 16))
    for i, layer in enumerate(mods):
        layer.__dict__["_cudagraphify_share"] = (group, i)
        graphify(layer, **options)
    return group
