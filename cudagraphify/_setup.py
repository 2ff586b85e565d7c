"""A static cache's set-up, done ahead of the call that would do it.

An HF ``StaticCache`` allocates its layers' tensors on their first update, inside forward
(``StaticLayer.lazy_initialization``): the call that does it (a prefill) runs eagerly (it
allocates what a graph would have to read at fixed addresses), and ``generate()`` with
``cache_implementation="static"`` makes a new cache for every call, so its prefill would
always run eagerly. After one such set-up, cudagraphify knows what the set-up made for that
signature (each layer's ``lazy_initialization`` arguments: batch, heads, head sizes, dtype,
device). A later call with the same signature (the same arguments, shapes, grad and autocast
state, and a cache in the same not-yet-set-up state) gets its cache's layers initialised by
the same function with the same arguments before forward runs; the call is then an ordinary
one, graphed (and rebased, see :mod:`._rebase`). What the call computes is unchanged: forward
would have made the same tensors on its first update. Only the layer type whose set-up is
known is done ahead (transformers' ``StaticLayer``); the records go with an invalidation
(parameters moved or changed dtype).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

__all__ = ["SetUps"]

_MAX = 16  # signatures whose set-up is kept


def _static_layers(obj: Any) -> list | None:
    layers = getattr(obj, "layers", None)
    if type(layers) is not list or not layers:
        return None
    return layers


def _known(layer: Any) -> bool:
    tp = type(layer)
    return tp.__name__ == "StaticLayer" and tp.__module__ == "transformers.cache_utils"


def _spec(layer: Any) -> tuple | None:
    """What ``lazy_initialization`` made of ``layer`` (None where it is not initialised)."""
    if not _known(layer) or getattr(layer, "is_initialized", False) is not True:
        return None
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        return None
    return (layer.batch_size, layer.num_heads, layer.k_head_dim, layer.v_head_dim,
            keys.dtype, keys.device, tuple(keys.shape), tuple(values.shape))


class SetUps:
    """The set-ups seen per signature key, done ahead for calls with that key."""

    def __init__(self):
        self._by_key: dict[Hashable, list] = {}

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def clear(self) -> None:
        self._by_key.clear()

    def record(self, key: Hashable, states: list, before: list) -> None:
        """After a call with ``key`` set up ``states`` (static state objects, in leaf order);
        ``before[k]``: which of state k's layers were initialised before the call."""
        made = []
        for obj, was in zip(states, before):
            layers = _static_layers(obj)
            if layers is None or len(layers) != len(was):
                return
            specs = [None if w else _spec(layer) for layer, w in zip(layers, was)]
            if any(not w and layer.is_initialized is True and spec is None
                   for layer, w, spec in zip(layers, was, specs)):
                return  # a layer set up that is not known: nothing is done ahead
            made.append(specs)
        if not any(s is not None for specs in made for s in specs):
            return
        if len(self._by_key) >= _MAX:
            self._by_key.pop(next(iter(self._by_key)))
        self._by_key[key] = made

    @staticmethod
    def initialised(states: list) -> list:
        """Per state, which of its layers are initialised (for :meth:`record`)."""
        return [[getattr(layer, "is_initialized", False) is True
                 for layer in (_static_layers(obj) or [])] for obj in states]

    def prepare(self, key: Hashable, states: list) -> bool:
        """Set up ``states`` as the call recorded under ``key`` did; whether anything was done.
        Layers already initialised, or whose recorded set-up made nothing, are left alone."""
        made = self._by_key.get(key)
        if made is None or len(made) != len(states):
            return False
        todo = []
        for obj, specs in zip(states, made):
            layers = _static_layers(obj)
            if layers is None or len(layers) != len(specs):
                return False
            for layer, spec in zip(layers, specs):
                if spec is not None and getattr(layer, "is_initialized", False) is not True:
                    if not _known(layer):
                        return False
                    todo.append((layer, spec))
        undo = [(layer, dict(vars(layer))) for layer, _ in todo]
        try:
            for layer, spec in todo:
                batch, heads, kd, vd, dtype, device = spec[:6]
                k = torch.empty((batch, heads, 1, kd), dtype=dtype, device=device)
                v = torch.empty((batch, heads, 1, vd), dtype=dtype, device=device)
                layer.lazy_initialization(k, v)
                if _spec(layer) != spec:  # (what lazy_initialization makes has changed)
                    raise ValueError(f"made {_spec(layer)}, not {spec}")
        except Exception:  # noqa: BLE001 - not done ahead: forward does it, as eagerly
            for layer, attrs in undo:
                vars(layer).clear()
                vars(layer).update(attrs)
            self._by_key.pop(key, None)
            return False
        return bool(todo)
