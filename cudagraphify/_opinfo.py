"""What the probe knows of each function it sees: its op name, and what a call of it writes.

Looked up once per function (by id, the function held so that its id stays its own) and kept:
the probe asks about every torch call of a warm-up. A property read (``Tensor.shape``) comes as
a new method-wrapper each time: its ``__get__`` is keyed by the property's descriptor.
"""

from __future__ import annotations

from typing import Any

import torch

from ._policy import op_name

__all__ = ["infos", "info_of", "written_by", "schemas", "in_place", "W_NONE", "W_FIRST",
           "W_SCHEMA", "INPLACE_DUNDERS", "UNSEEN", "UNSEEN_OPS", "writes_unseen"]

# What the probe needs of each function it sees, by id (the function held, so that its id stays
# its own): (func, op_name(func), what it writes without keywords: W_NONE, W_FIRST (an
# in-place method or dunder: its first argument) or W_SCHEMA (a custom op: its schema says))
infos: dict[int, tuple[Any, str, int]] = {}
W_NONE, W_FIRST, W_SCHEMA = 0, 1, 2
# id(a getset descriptor) -> (it, the op name of its __get__: a property read; its __set__ and
# other method-wrappers are keyed as any function)
_getters: dict[int, tuple[Any, str]] = {}
_MethodWrapper = type(torch.Tensor.shape.__get__)


def info_of(func: Any) -> tuple[Any, str, int]:
    """``func``'s entry (see ``infos``), made and kept on its first call."""
    getter = getattr(func, "__self__", None) if type(func) is _MethodWrapper \
        and getattr(func, "__name__", None) == "__get__" else None
    if getter is not None:  # a property read (Tensor.shape): a new method-wrapper each time
        hit = _getters.get(id(getter))
        if hit is not None and hit[0] is getter:
            return (func, hit[1], W_NONE)
    if schemas(func):
        writes = W_SCHEMA
    else:
        writes = W_FIRST if in_place(getattr(func, "__name__", "") or "") else W_NONE
    info = (func, op_name(func), writes)
    if getter is not None:
        if len(_getters) >= 1024:
            _getters.clear()
        _getters[id(getter)] = (getter, info[1])
        return info
    if len(infos) >= 4096:
        infos.clear()
    infos[id(func)] = info
    return info


INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                             "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                             "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def in_place(name: str) -> bool:
    """Whether a function of this name writes its first argument (``add_``, ``__iadd__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in INPLACE_DUNDERS


def written_by(func: Any, args: tuple, kwargs: dict) -> list:
    """The tensors (or lists of them) a call writes in place, as far as its name, its ``out=``
    and ``inplace=`` arguments and a custom op's schema tell."""
    out = []
    found = schemas(func)
    if found:  # a custom op: its schemas say what it writes (every overload's, for a packet)
        for schema in found:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    out.append(args[i] if i < len(args) else kwargs.get(arg.name))
    else:
        if args and (in_place(getattr(func, "__name__", "") or "")
                     or kwargs.get("inplace") is True):
            out.append(args[0])  # (a list of tensors for the in-place _foreach ops)
        out.append(kwargs.get("out"))
    return [t for v in out for t in (v if isinstance(v, (list, tuple)) else (v,))]


# Calls whose writes neither their name, their arguments nor a version counter tell: running
# statistics updated in the kernel (by a part of the name: ``F.batch_norm``,
# ``torch.instance_norm``); memory handed past torch (a kernel launched with its address, numpy)
UNSEEN = ("batch_norm", "instance_norm")
UNSEEN_OPS = frozenset({"Tensor.data_ptr", "Tensor.numpy", "Tensor.__dlpack__", "Tensor.__array__",
                        "Tensor.__cuda_array_interface__", "Tensor.untyped_storage",
                        "Tensor.storage", "Tensor._typed_storage"})
_unseen: dict[str, bool] = {}


def writes_unseen(name: str) -> bool:
    """Whether a call of this op name (``op_name``) may write its tensor arguments unseen (see
    :data:`UNSEEN`, :data:`UNSEEN_OPS`)."""
    hit = _unseen.get(name)
    if hit is None:
        if len(_unseen) >= 4096:
            _unseen.clear()
        hit = _unseen[name] = name in UNSEEN_OPS or any(u in name for u in UNSEEN)
    return hit


def schemas(func: Any) -> list:
    """The schemas of a custom op: an OpOverload's own, or each overload's of a packet
    (``torch.ops.ns.op``); none for anything else."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return [schema]
    if isinstance(func, torch._ops.OpOverloadPacket):
        try:
            return [getattr(func, ov)._schema for ov in func.overloads()]
        except Exception:  # noqa: BLE001 - an odd packet: its name decides, as for others
            return []
    return []
