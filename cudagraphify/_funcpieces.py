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
guards and decisions (an unsafe op runs it eagerly, with the reason), one per root's region and
call of it in the root's run, the nth layer's call the nth (its own trial and verdict; see
:class:`_Calls`); its graphs belong to that region and go with it. ``stats(fn)`` of the
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
_get_ident = threading.get_ident
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


# calls of one function in one run of a root given graphs of their own (one per layer of an
# HF model); the calls beyond share the last one's
_MAX_CALLS = 64


class _Calls:
    """A function's graphified copies in one implicit region: one for each call of it in a
    run of the root, by its order in the run (the nth call of a run, the nth layer's, is the
    nth copy's; runs on several threads at once are counted apart). One copy for all the
    layers would capture a signature at its second sight, the second layer's call, in the run
    before the layers' pieces capture theirs: its graph would come before theirs in the
    region's pool, and a replay of it, while their outputs are held as its arguments, would be
    blocked (then captured again, after every piece, and the outputs it hands on moved to
    copies before each later piece's replay: a copy a layer, a decode step)."""

    __slots__ = ("counts", "graphed")

    def __init__(self):
        self.counts: dict[int, list] = {}  # thread -> [its run's number, calls in it so far]
        self.graphed: list = []

    def next(self, region, make: Callable) -> Any:
        """The copy for this call of the function in the calling thread's current run of
        ``region``'s root (under the module's lock)."""
        me = _get_ident()
        run_of = region.run_of
        # (a thread that runs no run of the root itself, one its forward hands work to with
        # the run's context, ``asyncio.to_thread``: counted by the runs of any thread)
        run = run_of.get(me)
        if run is None:
            run = -1 - region.entered
        counts = self.counts
        mine = counts.get(me)
        if mine is None or mine[0] != run:
            if mine is None and len(counts) >= 256:
                for t in [t for t in counts if t not in run_of]:
                    del counts[t]  # (threads gone: their counts start again)
            mine = counts[me] = [run, 0]
        n = mine[1]
        mine[1] = n + 1
        graphed = self.graphed
        if n < len(graphed):
            return graphed[n]
        if len(graphed) >= _MAX_CALLS:
            return graphed[-1]
        graphed.append(make())
        return graphed[-1]


def _piece_of(fn: Callable) -> Callable:
    """The wrapper of ``fn`` (one per function object: modules binding the same one share it).
    Each implicit region it is called in has graphified copies of ``fn`` of its own, one for
    each call of it in a run (:class:`_Calls`; their own signatures, trial and verdict: one
    root's timing does not give the function back for another, nor one layer's for the next)."""
    made = _made.get(id(fn))
    if made is not None and made[0] is fn:
        return made[1]
    from ._wrap import wrap  # (a late import: _wrap imports the engine, which imports this)

    options = dataclasses.replace(Options.build("graphify"), copy_outputs=True, piece=True)
    per_region: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def make() -> Any:
        return wrap(fn, options, "function", None, True)

    @functools.wraps(fn)
    def piece(*args: Any, **kwargs: Any) -> Any:
        # (torch.compile's trace first: it folds is_compiling() to True and traces the function
        # itself, with no graph break at the context variable)
        if not _is_compiling():
            stack = _stack_get()
            if stack and stack[-1].implicit:
                region = stack[-1]
                with _lock:
                    calls = per_region.get(region)
                    if calls is None:
                        calls = per_region[region] = _Calls()
                    graphed = calls.next(region, make)
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
    return [s for s in (g._self_dispatch.state for calls in list(per_region.values())
                        for g in list(calls.graphed)) if s is not None]
