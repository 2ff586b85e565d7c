"""The public entry points: ``graphify``, ``ungraphify``, ``stats``, ``explain``, ``share_graph``.

How the wrapper attaches lives in :mod:`._wrap`; what happens on a call, in :mod:`._engine`.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from . import _funcpieces
from ._cache import CachePolicy
from ._engine import GraphedState
from ._options import Options, Stats
from ._wrap import (SHARE, GraphedForward, Share, drop_retired, graphed_forward,
                    graphed_forward_of, has_own_forward, install, retired, state_of_module,
                    uninstall_class, uninstall_instance, wrap)
from ._errors import CudagraphifyUsageError, name_of
from ._policy import OpPolicy, default_policy
from ._region import GraphRegion
from ._share import ShareGroup, check_layers
from ._signature import Signature

__all__ = ["graphify", "ungraphify", "stats", "explain", "share_graph", "tag_op", "mark_safe"]


def graphify(
    target: Any = None,
    /,
    *,
    num_warmup_iters: int = 1,
    static_argnames: tuple[str, ...] | str = (),
    max_graphs: int | None = None,
    enabled: bool | Callable[[], bool] = True,
    copy_outputs: bool = True,
    cache_policy: CachePolicy | None = None,
    key_fn: Callable[[Signature], Hashable] | None = None,
    probe: str | bool = "auto",
    op_policy: OpPolicy | None = None,
    segments: bool = False,
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
        max_graphs: graphs kept per callable (default 16); the least recently used is released
            beyond it. With ``cache_policy``, the policy's ``max_graphs`` bounds the cache: give
            it there (a different value here is an error).
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
        segments: experimental. ``True``: a signature that runs eagerly because of refused
            calls (``.item()``, a host sync) graphs the runs of safe torch calls between them
            ("segments"): its forward's Python runs on every inference call, and each matching
            run of calls is answered by one replay. Timed against the forward without them on
            its first calls; given back where they do not pay. See the README.

    .. warning::
        Graphs replay GPU work only. Python side effects inside ``forward`` (prints, counters,
        hooks on submodules, changing non-tensor attributes) happen during the first call of a
        signature only. Parameters and buffers are read in place and guarded; other tensors the
        forward reads from outside its arguments (globals, plain attributes) are read at the
        address they had at capture.
    """
    options = Options.build("graphify", num_warmup_iters=num_warmup_iters,
                            static_argnames=static_argnames, max_graphs=max_graphs,
                            enabled=enabled, copy_outputs=copy_outputs,
                            cache_policy=cache_policy, key_fn=key_fn, probe=probe,
                            op_policy=op_policy, segments=segments)
    if target is None:
        return lambda t: _graphify(t, options)
    return _graphify(target, options)


def _graphify(target: Any, options: Options) -> Any:
    if isinstance(target, type):
        if not issubclass(target, torch.nn.Module):
            raise CudagraphifyUsageError(
                f"graphify on a class needs a torch.nn.Module subclass, got {target.__name__}")
        if graphed_forward_of(target) is not None:
            raise CudagraphifyUsageError(f"{target.__name__} is already graphified")
        had_own = "forward" in target.__dict__
        install(target, target.forward, options, "class", had_own)
        return target
    if isinstance(target, torch.nn.Module):
        if isinstance(target.__dict__.get("forward"), GraphedForward):
            raise CudagraphifyUsageError(
                f"this {type(target).__name__} instance is already graphified; "
                "call cudagraphify.ungraphify(module) first to change its options")
        if graphed_forward_of(type(target)) is not None:
            raise CudagraphifyUsageError(
                f"{type(target).__name__} is graphified as a class already; its instances are "
                "graphed without graphify(instance)")
        install(target, target.forward, options, "instance", has_own_forward(target))
        _generate_compile(target, off=True)
        return target
    if isinstance(target, GraphedForward):
        raise CudagraphifyUsageError("this function is already graphified")
    if callable(target):
        return wrap(target, options, "function", None, True)
    raise CudagraphifyUsageError(
        f"graphify expects a Module subclass, a Module instance or a function, got "
        f"{type(target).__name__}")


def ungraphify(target: Any) -> Any:
    """Undo :func:`graphify`: restore the original ``forward`` (or function) and free the graphs.

    Returns the class, the module, or the original function.
    """
    if isinstance(target, type):
        proxy = graphed_forward_of(target)
        if proxy is None or proxy._self_dispatch.owner is not target:
            raise CudagraphifyUsageError(f"{target.__name__} is not graphified")
        uninstall_class(target, proxy)
        return target
    if isinstance(target, torch.nn.Module):
        if retired(target):  # a plan's piece given back: its plain forward is in place
            drop_retired(target)
            return target
        if not isinstance(target.__dict__.get("forward"), GraphedForward):
            how = ("through its class; call ungraphify(type(module))"
                   if graphed_forward_of(type(target)) is not None else "")
            raise CudagraphifyUsageError(
                f"this {type(target).__name__} instance is not graphified {how}".rstrip())
        uninstall_instance(target)
        _generate_compile(target, off=False)
        return target
    if isinstance(target, GraphedForward):
        if target._self_dispatch.state is not None:
            target._self_dispatch.state.release()
        return target.__wrapped__
    raise CudagraphifyUsageError(f"{target!r} is not graphified")


_COMPILE_OFF = "_cudagraphify_turned_generate_compile_off"


def _generate_compile(module: torch.nn.Module, off: bool) -> None:
    """HF ``generate()`` wraps the forward of a model with a static cache in torch.compile by
    default; over a graphified model that only adds its compile time and its guards to every
    step (the graphs already replay the step). Graphifying an HF model instance turns that off
    (``generation_config.disable_compile``); ungraphify turns it back on where it was on."""
    config = getattr(module, "generation_config", None)
    if off:
        if hasattr(config, "disable_compile") and config.disable_compile is not True:
            module.__dict__[_COMPILE_OFF] = (config, config.disable_compile)
            config.disable_compile = True
    else:
        config, before = module.__dict__.pop(_COMPILE_OFF, (None, None))
        if config is not None:
            config.disable_compile = before


def _op_policy_of(module: torch.nn.Module, state: GraphedState | None) -> OpPolicy | None:
    """The ``op_policy`` ``module`` was graphified with (before its first call too)."""
    if state is not None:
        return state.options.op_policy
    fwd = graphed_forward(module)
    return fwd._self_dispatch.options.op_policy if fwd is not None else None


def _state_of(target: Any) -> GraphedState | None:
    if isinstance(target, torch.nn.Module):
        state = state_of_module(target)
        if state is None and graphed_forward(target) is None:
            raise CudagraphifyUsageError(f"this {type(target).__name__} is not graphified")
        return state
    if isinstance(target, GraphedForward):
        return target._self_dispatch.state
    raise CudagraphifyUsageError(
        f"expected a graphified module, function or graph_region, got {type(target).__name__}")


def stats(target: Any) -> Stats:
    """Counters of a graphified module, function, a :class:`graph_region` or a
    :class:`ShareGroup` (the same as ``group.stats()``).

    captures, replays, eager calls by reason, capture seconds, graph pool bytes (reserved by the
    live graphs' pools), live graphs, evictions, invalidations (parameters moved). A module run
    piecewise counts its graphed submodules' calls too (its own eager calls say "piecewise").
    """
    if isinstance(target, (GraphRegion, ShareGroup)):
        return target.stats()
    states = _funcpieces.states_of(target)
    if states is not None:  # (a function graphed as a piece: its wrapper, see _funcpieces)
        return sum((s.stats() for s in states), Stats())
    state = _state_of(target)
    return _with_pieces(state) if state is not None else Stats()


def _with_pieces(state: GraphedState) -> Stats:
    total = state.stats()
    for piece in state.pieces:
        piece_state = state_of_module(piece)
        if piece_state is not None:
            total = total + _with_pieces(piece_state)
    return total


def explain(target: Any, *example_args: Any, **example_kwargs: Any):
    """What cudagraphify does with ``target``: a module tree, each node graphed or eager and why.

    With example inputs, the plan comes from a probe run of ``target`` on them (twice, to see
    data-dependent control flow), with Thunder's tags too; this works on a CPU (CPU tensors
    stand for CUDA ones) and leaves the module as it was (buffers, module attributes,
    registries, hooks and classes, tensors kept as plain attributes, the example inputs and
    the RNG state restored, no graphs made; a parameter its runs wrote in place is named in a
    warning, not restored; a lazy module not yet initialized is refused). Without inputs, it reports the plan and counters of the calls made so far.
    ``str()`` of the result is the tree; ``.to_dict()`` / ``.to_json()`` the same as data.
    """
    from ._explain import build, probe_plan

    module = target if isinstance(target, torch.nn.Module) else None
    graphed = module is None or graphed_forward(module) is not None or retired(module)
    state = _state_of(target) if graphed else None
    name = (state.name if state is not None else
            type(target).__name__ if module is not None else
            name_of(target))
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


def tag_op(fn: Callable | str, *tags) -> None:
    """Tag ``fn`` (a torch function, Tensor method or custom op, or the name of a non-op call
    such as ``"torch.cuda.synchronize"``) for every graphed call that uses it.

    Tags are :class:`Tag` objects or their names (``"HOST_SYNC"``...); a call whose tags the
    policy refuses runs eagerly while its safe neighbours stay graphed. Anything the probe would
    never see (a plain Python function, an unknown name) raises a
    :class:`CudagraphifyUsageError`.
    """
    default_policy.tag_op(fn, *tags)


def mark_safe(fn: Callable | str) -> None:
    """Declare ``fn`` (as for :func:`tag_op`) safe to capture, whatever other tags it has."""
    default_policy.mark_safe(fn)


def share_graph(layers: Any, *, ignore_attrs: tuple[str, ...] | str = (), strict: bool = True,
                **options: Any):
    """Capture once and replay across identical layers, each with its own weights.

    ``layers`` is an ``nn.ModuleList`` or a sequence of modules of one structure (class,
    submodules, parameter and buffer shapes/dtypes/strides; a difference is an error naming
    it). Plain attributes may differ (HF's ``layer_idx``): a layer whose forward reads a value
    that differs from the template layer's does not share; one whose attributes differ but
    are not read is captured once and diffed against the template, and shares it only where
    its own capture proves the difference changed no kernel argument. Each layer is graphified in place with ``options`` (those of
    :func:`graphify`); calling any layer, as the parent's usual loop does, replays the shared
    capture: per input signature the first layer called is captured once (plus one capture of
    a second layer, to tell weight addresses from other bytes), and every layer gets a copy of
    that graph whose weight addresses are its own, checked once against its eager output. No
    weights are copied per call, and graph memory does not grow with the number of layers.

    Where sharing cannot be proven (see ``group.stats().reasons``: random ops, training,
    calls inside a ``graph_region``, a kernel argument that is not a rebased address), each layer
    captures its own graph in one memory pool shared by the group.

    Args:
        ignore_attrs: plain attributes declared unused by forward, as
            ``"self_attn.layer_idx"`` (path inside the layer) or a bare name: a layer that
            differs from the template only in them is not captured to prove it.
        strict: refuse sharing when two layers' captures differ in a kernel argument that is
            neither a rebased address nor proven capture-dependent nor one byte long (an empty
            functor's byte, counted as unproven) nor a host address in one of them (a stack
            address in a struct's unused tail, counted as unproven) (default). ``strict=False``
            keeps such bytes as the template has them when in neither capture they are an
            address of memory the layers may read (their pool, parameters, buffers, inputs,
            attribute tensors): the uninitialised tail of a kernel's argument struct, as in HF
            Llama's RMSNorm reduction, now and then a stale address; and relies on the check of each layer's graph against
            its eager output: a per-layer scalar the forward reads from somewhere the
            structural check does not see would then be taken from the template layer.

    Returns the :class:`ShareGroup` (``stats()``, ``release()``, ``unshare()``).
    """
    if isinstance(ignore_attrs, str):
        ignore_attrs = (ignore_attrs,)
    options = Options.build("share_graph", **options)
    if not options.copy_outputs:
        raise CudagraphifyUsageError(
            "share_graph with copy_outputs=False: the layers share one set of output buffers, "
            "so each layer's output would be overwritten by the next layer's call")
    mods = check_layers(layers, tuple(ignore_attrs))
    for i, layer in enumerate(mods):
        if graphed_forward(layer) is not None:
            raise CudagraphifyUsageError(
                f"share_graph: layer {i} is graphified already; share_graph graphifies the "
                "layers itself (ungraphify them first)")
    group = ShareGroup(mods, tuple(ignore_attrs), strict, max_templates=options.max_graphs)
    for i, layer in enumerate(mods):
        layer.__dict__[SHARE] = Share(group, i)
        _graphify(layer, options)
    return group
