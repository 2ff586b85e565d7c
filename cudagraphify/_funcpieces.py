"""Function pieces: plain functions of a model library's modeling code, graphed as pieces of the
roots whose piecewise runs call them (issue 16).

An HF attention forward computes the rotary embedding in a module-level function,
``apply_rotary_pos_emb`` (about ten kernels a layer), that no submodule holds. Under a plan
around an argument no signature holds (an HF ``DynamicCache`` in ``generate()``), the attention
runs eagerly and its projections are pieces, so the rotary kernels ran eagerly in every layer of
every decode step. Graphed, they take the decode step of an 8-layer Llama from 1.50x to 1.74x
eager (``.ci/diag/rotary_fn.py``).

When a root installs a piecewise plan (:func:`install_for`), each function named in
:data:`FUNCTIONS` that a module of the root's tree sees in its class's module (its own copy,
or one it imports) is replaced there, once per process, by a wrapper (:func:`_piece_of`). The
wrapper calls the function through ``graphify`` with a piece's options (``Options.piece``: a
signature captured at its second sight, timed against its eager run on its first calls and
given back where it does not pay) only while a graphified root's own implicit region is in
effect on this thread (its chained pieces' inference run, see ``_pieces.PieceRuns.chained``),
so its graphs chain with the pieces' (one pool, outputs handed on without a copy, an output
still held protected before a replay overwrites it). Anywhere else (a model nobody
graphified, training and grad mode, a user's ``graph_region``, a capture, torch.compile's
trace) the wrapper calls the function itself. The graphed function is the engine's, with its
guards and decisions (an unsafe op runs it eagerly, with the reason), one per root's region (its
own trial and verdict); its graphs belong to that region and go with it. ``stats(fn)`` of the
wrapper gives its counters, summed over the regions alive; ``ungraphify`` leaves the wrapper in
place (it then calls the function itself)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch

from . import _region
from ._options import Options

__all__ = ["FUNCTIONS", "install_for", "states_of"]

# (module name prefix, function name): the functions graphed as pieces where a root's tree has
# a module whose class's module binds one of them as a plain function
FUNCTIONS: tuple[tuple[str, str], ...] = (("transformers.models.", "apply_rotary_pos_emb"),)

_ATTR = "__cudagraphify_piece__"  # on a wrapper: region -> the graphified function it calls
_lock = threading.Lock()
_made: dict[int, tuple[Callable, Callable]] = {}  # id(function) -> (function, its wrapper)
_stack_get = _region.stack_var().get
_is_compiling = torch.compiler.is_compiling


def install_for(root: torch.nn.Module) -> list[tuple[str, str]]:
    """Put the wrapper of each function of :data:`FUNCTIONS` in place of it in the modules of
    the classes of ``root``'s tree (once: a module holding the wrapper already is left as it
    is). Returns the (module, name) bindings replaced by this call."""
    replaced = []
    names = {type(m).__module__ for m in root.modules()}
    for modname in sorted(names):
        for prefix, name in FUNCTIONS:
            if not modname.startswith(prefix):
                continue
            module = sys.modules.get(modname)
            fn = getattr(module, name, None) if module is not None else None
            if type(fn) is not types.FunctionType or hasattr(fn, _ATTR):
                continue
            with _lock:
                if getattr(module, name, None) is not fn:
                    continue  # (replaced meanwhile)
                setattr(module, name, _piece_of(fn))
            replaced.append((modname, name))
    return replaced


def _piece_of(fn: Callable) -> Callable:
    """The wrapper of ``fn`` (one per function object: modules binding the same one share it).
    Each implicit region it is called in has a graphified ``fn`` of its own (its own signatures,
    trial and verdict: one root's timing does not give the function back for another)."""
    made = _made.get(id(fn))
    if made is not None and made[0] is fn:
        return made[1]
    from ._wrap import wrap  # (a late import: _wrap imports the engine, which imports this)

    options = dataclasses.replace(Options.build("graphify"), copy_outputs=True, piece=True)
    per_region: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def piece(*args: Any, **kwargs: Any) -> Any:
        # (torch.compile's trace first: it folds is_compiling() to True and traces the function
        # itself, with no graph break at the context variable)
        if not _is_compiling():
            stack = _stack_get()
            if stack and stack[-1].implicit:
                region = stack[-1]
                graphed = per_region.get(region)
                if graphed is None:
                    with _lock:
                        graphed = per_region.get(region)
                        if graphed is None:
                            graphed = per_region[region] = wrap(fn, options, "function", None,
                                                                True)
                state = graphed._self_dispatch.state
                if state is None or state.given_back is None:
                    return graphed(*args, **kwargs)
        return fn(*args, **kwargs)

    setattr(piece, _ATTR, per_region)
    _made[id(fn)] = (fn, piece)
    return piece


def states_of(target: Any) -> list | None:
    """The engine states of a function piece's wrapper, one per implicit region it was called
    in that is still alive (None for anything else)."""
    per_region = getattr(target, _ATTR, None) if type(target) is types.FunctionType else None
    if per_region is None:
        return None
    return [s for s in (g._self_dispatch.state for g in list(per_region.values()))
            if s is not None]
