"""Objects a forward returns that a graph can hand out again: an HF ``DynamicCache``.

HF causal LMs called as ``model(ids)`` (``use_cache`` on, no cache passed in) make a
``DynamicCache`` inside forward and return it in their output. Its layers hold the keys and
values as plain tensors, next to constants (``is_initialized``, ``dtype``, ``device``); the
object itself is made anew on every call. A graph cannot return an object it does not know
(see ``_replay.output_leaves``); this one it can make again: the same class, the same
constants, the replay's tensors in place of the capture's.

Inside cudagraphify, the runs of a first call (warm-up, rehearsal, capture) see such an object
as a :class:`SeenThrough` node, registered with ``torch.utils._pytree``: every flatten of the
output finds its tensors (the output plan, the checks of what a capture holds or returns), and
the output plan's ``tree_unflatten`` makes a new object of the class on every replay. What the
user gets from an eager run is the object the forward made (:func:`restore`).

Only exact classes of ``transformers.cache_utils`` listed here qualify (not a subclass, whose
methods may read what the copy lacks), only where every attribute is a plain tensor, an
immutable value, a class, or (the cache's ``layers``) a list of qualifying objects, and only an
object the forward made for its output (nothing but the output holds it, once: see
:func:`see_through`); anything else stays an object no graph returns, as before.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ._replay import OutputPlanError, _attributes_kept, _is_size, containers_of
from ._signature import is_constant

__all__ = ["SeenThrough", "see_through", "seeing_through", "restore"]

_HF = "transformers.cache_utils"
# (class name -> the attribute that holds a list of layer objects, if any)
_CLASSES = {"DynamicCache": "layers", "DynamicLayer": None, "DynamicSlidingWindowLayer": None}
_Tensor = torch.Tensor


class SeenThrough:
    """An object of a qualifying class, as a pytree node (its tensors, in attribute order)."""

    __slots__ = ("obj", "tensors", "context")

    def __init__(self, obj: Any, tensors: list, context: tuple):
        self.obj, self.tensors, self.context = obj, tensors, context


def _qualifies(obj: Any) -> bool:
    tp = type(obj)
    return tp.__module__ == _HF and tp.__name__ in _CLASSES and tp.__qualname__ == tp.__name__


def _refs_from(holders: list, obj: Any) -> int:
    """How many references to ``obj`` the objects ``holders`` hold where a replay's output
    holds them again: a list's or tuple's items, a pytree node's children (not a dict's keys,
    which pytree keeps in its spec, the capture's object) and, for a dict-like node, its
    attributes that mirror an item (an HF ``ModelOutput`` holds each field as an item and as an
    attribute; another attribute pytree drops); any other object's attributes."""
    n = 0
    for h in holders:
        tp = type(h)
        if tp is list or tp is tuple:
            n += sum(1 for v in h if v is obj)
            continue
        node = pytree.SUPPORTED_NODES.get(pytree._get_node_type(h))
        if node is None:
            d = getattr(h, "__dict__", None)
            n += sum(1 for v in d.values() if v is obj) if type(d) is dict else 0
            continue
        n += sum(1 for v in node.flatten_fn(h)[0] if v is obj)
        d = getattr(h, "__dict__", None) if isinstance(h, dict) else None
        if type(d) is dict:
            n += sum(1 for k, v in d.items() if v is obj and k in h and h[k] is obj)
    return n


def _others(obj: Any, holders: list) -> int:
    """References to ``obj`` beyond those of ``holders`` (with the caller's one local name and
    this call's own: :data:`_ALONE` where nothing else holds it)."""
    return sys.getrefcount(obj) - _refs_from(holders, obj)


def _calibrated() -> int:
    """What :func:`_others` gives for an object held by a list alone, asked from a loop over
    that list (as :func:`see_through` and :func:`_describe` ask)."""
    holder = [SeenThrough(None, [], ())]
    for x in holder:
        return _others(x, [holder])
    raise AssertionError


class _Owner:
    """Stands for a cache in :func:`_calibrated_attribute`."""


def _calibrated_attribute() -> int:
    """What :func:`_others` gives for a list held by one object's attribute alone, read with
    ``dict.get`` into one local name (as :func:`_describe` reads a cache's layers)."""
    owner = _Owner()
    owner.layers = []
    layers = vars(owner).get("layers")
    return _others(layers, [owner])


def _describe(obj: Any, tensors: list) -> tuple | None:
    """How to make ``obj`` again: (class, ((name, kind, what), ...)); its tensors appended to
    ``tensors`` in that order. None where an attribute is neither a plain tensor, an immutable
    value, a class nor (the class's list attribute) a list of qualifying objects that nothing
    else holds (each in it once)."""
    tp = type(obj)
    d = getattr(obj, "__dict__", None)
    if type(d) is not dict or getattr(tp, "__slots__", ()):
        return None
    listed = _CLASSES[tp.__name__]
    layers = d.get(listed) if listed is not None else None
    # (the list itself held by anything but this object, another cache or a global: a replay
    # makes a list of its own)
    if layers is not None and _others(layers, [obj]) != _ALONE_ATTRIBUTE:
        return None
    del layers
    parts = []
    for name, value in d.items():
        if type(value) is _Tensor:
            tensors.append(value)
            parts.append((name, "tensor", None))
        elif name == listed and type(value) is list:
            inner = []
            for item in value:
                # (a layer the caller can reach otherwise, or one listed twice: a replay would
                # make two objects, or one the caller's does not know)
                if _others(item, [value]) != _ALONE or not _qualifies(item):
                    return None
                made = _describe(item, tensors)
                if made is None:
                    return None
                inner.append(made)
            if len({id(item) for item in value}) != len(value):
                return None
            parts.append((name, "list", tuple(inner)))
        elif is_constant(value) or isinstance(value, type):
            # (a class, ``layer_class_to_replicate``: every eager cache refers to it too)
            parts.append((name, "const", value))
        else:
            return None
    return tp, tuple(parts)


def _make(context: tuple, values: Any) -> Any:
    tp, parts = context
    obj = tp.__new__(tp)
    d = obj.__dict__
    for name, kind, what in parts:
        if kind == "tensor":
            d[name] = next(values)
        elif kind == "list":
            d[name] = [_make(inner, values) for inner in what]
        else:
            d[name] = what
    return obj


def _flatten(node: SeenThrough) -> tuple[list, tuple]:
    return list(node.tensors), node.context


def _unflatten(values: Any, context: tuple) -> Any:
    """A new object of the class (a replay's output), its tensors the ones given."""
    return _make(context, iter(values))


pytree.register_pytree_node(SeenThrough, _flatten, _unflatten)


def _is_node(x: Any) -> bool:
    return type(x) is SeenThrough


def see_through(out: Any) -> Any:
    """``out`` with each qualifying object in it as a :class:`SeenThrough` node (``out`` itself
    where it holds none). Only an object the forward made for its output: one that nothing
    but the output's containers holds (an argument, a module's attribute, a global or a
    partial's would be another object on replay, not the caller's), that is in the output
    once and whose layers are in it only through it (a replay makes one object where the
    output holds it). (``out`` itself a cache is held by this call too: see
    :func:`seeing_through`, which asks with the output held by a list alone.)"""
    return _see([out])


def _see(box: list) -> Any:
    """:func:`see_through` of ``box[0]``, which nothing but ``box`` and the caller holds."""
    leaves = pytree.tree_leaves(box[0], is_leaf=_is_size)
    found = [x for x in leaves if _qualifies(x)]
    if not found:
        return box[0]
    del leaves
    try:  # (pytree would rebuild a container that carries more than its items without it)
        _attributes_kept(box[0])
    except OutputPlanError:
        return box[0]
    holders = containers_of(box) + [found]
    sole = set()
    for x in found:
        if _others(x, holders) == _ALONE:
            sole.add(id(x))
    del x
    counts: dict[int, int] = {}
    for y in found:
        counts[id(y)] = counts.get(id(y), 0) + 1
    sole = {i for i in sole if counts[i] == 1}
    del found, holders
    if not sole:
        return box[0]

    def node(x: Any) -> Any:
        if id(x) not in sole or not _qualifies(x):
            return x
        tensors: list = []
        context = _describe(x, tensors)
        return x if context is None else SeenThrough(x, tensors, context)

    return pytree.tree_map(node, box, is_leaf=_is_size)[0]


def seeing_through(fn: Callable) -> Callable:
    """``fn``, its result seen through (the runs of a first call: see the module docstring);
    ``run.made`` the (seen, what the forward returned) of its runs, for :func:`restore`."""
    made: list = []

    def run(*args: Any, **kwargs: Any) -> Any:
        box = [fn(*args, **kwargs)]  # (held by this list alone while it is looked at)
        seen = _see(box)
        if seen is not box[0]:
            made.append((seen, box[0]))
        return seen
    run.made = made
    return run


def restore(out: Any, run: Callable) -> Any:
    """What the forward returned where ``run`` (a :func:`seeing_through`) saw ``out`` through:
    its own containers and objects, as an eager run returns them; ``run`` forgets its runs."""
    made, run.made[:] = list(run.made), []
    for seen, original in made:
        if seen is out:
            return original
    if not any(_is_node(x) for x in pytree.tree_leaves(out, is_leaf=_node_or_size)):
        return out
    return pytree.tree_map(lambda x: x.obj if _is_node(x) else x, out, is_leaf=_node_or_size)


def _node_or_size(x: Any) -> bool:
    return type(x) is SeenThrough or type(x) is torch.Size


_ALONE = _calibrated()
_ALONE_ATTRIBUTE = _calibrated_attribute()
