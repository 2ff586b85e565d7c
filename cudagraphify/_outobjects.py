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
methods may read what the copy lacks), and only where every attribute is a plain tensor, an
immutable value, a class, or (the cache's ``layers``) a list of qualifying objects; anything else stays
an object no graph returns, as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

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


def _describe(obj: Any, tensors: list) -> tuple | None:
    """How to make ``obj`` again: (class, ((name, kind, what), ...)); its tensors appended to
    ``tensors`` in that order. None where an attribute is neither a plain tensor, an immutable
    value, a class nor (the class's list attribute) a list of qualifying objects."""
    tp = type(obj)
    d = getattr(obj, "__dict__", None)
    if type(d) is not dict or getattr(tp, "__slots__", ()):
        return None
    listed = _CLASSES[tp.__name__]
    parts = []
    for name, value in d.items():
        if type(value) is _Tensor:
            tensors.append(value)
            parts.append((name, "tensor", None))
        elif name == listed and type(value) is list:
            inner = []
            for item in value:
                if not _qualifies(item):
                    return None
                made = _describe(item, tensors)
                if made is None:
                    return None
                inner.append(made)
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
    where it holds none)."""
    leaves = pytree.tree_leaves(out)
    if not any(_qualifies(x) for x in leaves):
        return out

    def node(x: Any) -> Any:
        if not _qualifies(x):
            return x
        tensors: list = []
        context = _describe(x, tensors)
        return x if context is None else SeenThrough(x, tensors, context)

    return pytree.tree_map(node, out)


def seeing_through(fn: Callable) -> Callable:
    """``fn``, its result seen through (the runs of a first call: see the module docstring)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return see_through(fn(*args, **kwargs))
    return run


def restore(out: Any) -> Any:
    """``out`` with each node back to the object the forward made (what an eager run
    returns)."""
    if not any(_is_node(x) for x in pytree.tree_leaves(out, is_leaf=_is_node)):
        return out
    return pytree.tree_map(lambda x: x.obj if _is_node(x) else x, out, is_leaf=_is_node)
