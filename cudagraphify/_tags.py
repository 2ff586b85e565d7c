"""cudagraphify's op tags, registered on Thunder's open tag base, and Thunder's view of an op.

Thunder's ``OpTags`` is a closed enum and its Symbols are frozen, so cudagraphify's tags are
registered the way Thunder allows: ``Tag`` is a subclass of ``thunder.core.baseutils.TagBase``
with ``register_tag``. Tags gathered from Thunder (over an op's traced decomposition) are mapped
onto these.

Importing Thunder takes seconds, so it happens only when Thunder's view is needed (a piecewise
plan, ``explain``, ``probe="thunder"``, or the first use of ``Tag``); the first-call screen works
on tag *names*. On a torch Thunder 0.2.6 cannot import under (torch >= 2.13 removed five
named-tensor methods it lists), stand-ins for exactly those names are added for the import and
removed right after. If Thunder still cannot be imported, cudagraphify keeps working on its own
rules and says so once.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

from ._errors import CudagraphifyWarning

__all__ = ["TAG_NAMES", "UNSAFE", "tag", "tag_class", "tag_name", "thunder", "thunder_tags"]

# Named-tensor methods Thunder 0.2.6 references and torch >= 2.13 no longer has.
_REMOVED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")

_lock = threading.Lock()
_thunder: Any = None
_thunder_error: str | None = None


def _import_thunder():
    added = []
    for name in _REMOVED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            def stand_in(*args, _name=name, **kwargs):
                raise RuntimeError(f"torch.Tensor.{_name} does not exist in this torch")

            stand_in.__name__ = name  # Thunder checks that it matches the attribute name
            stand_in.__qualname__ = f"Tensor.{name}"
            setattr(torch.Tensor, name, stand_in)
            added.append(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optional executors Thunder looks for
            import thunder
            import thunder.torch  # noqa: F401
            from thunder.core import symbol  # noqa: F401
    finally:
        for name in added:
            delattr(torch.Tensor, name)
    return thunder


def thunder():
    """The ``thunder`` module, or None when it cannot be imported (warned once)."""
    global _thunder, _thunder_error
    with _lock:
        if _thunder is None and _thunder_error is None:
            try:
                _thunder = _import_thunder()
            except Exception as e:  # noqa: BLE001 - any import failure means "no thunder"
                _thunder_error = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"cudagraphify: lightning-thunder cannot be imported ({_thunder_error}); "
                    "op safety is decided from cudagraphify's own rules and PyTorch's op tags",
                    CudagraphifyWarning, stacklevel=3)
        return _thunder


def _tag_base() -> type:
    th = thunder()
    if th is not None:
        from thunder.core.baseutils import TagBase

        return TagBase

    class TagBase:  # the same protocol as Thunder's, for when Thunder is missing
        def __new__(cls, name, _register=False):
            if _register:
                if hasattr(cls, name):
                    raise AttributeError(f"{cls.__name__}.{name} is already registered")
                res = super().__new__(cls)
                res._value = name
                setattr(cls, name, res)
                return res
            return getattr(cls, name)

        @classmethod
        def register_tag(cls, name):
            cls(name, _register=True)

        def __repr__(self):
            return f"{self.__class__.__name__}.{self._value}"

    return TagBase


_tag_cls: type | None = None


def tag_class() -> type:
    """``Tag``, built on first use (that imports Thunder, whose ``TagBase`` it extends)."""
    global _tag_cls
    if _tag_cls is None:
        cls = type("Tag", (_tag_base(),), {"__module__": "cudagraphify", "__doc__": _TAG_DOC})
        for name in TAG_NAMES:
            cls.register_tag(name)
        _tag_cls = cls
    return _tag_cls


_TAG_DOC = """cudagraphify's op tags (registered on Thunder's ``TagBase``).

HOST_SYNC: waits for the GPU on the host (``.item()``, printing, ``bool(t)``);
DYNAMIC_SHAPE: output shape depends on data (``nonzero``, boolean-mask indexing);
CPU_RNG: random numbers from a generator a graph does not replay (CPU, seeding);
HOST_ALLOC: allocates pinned or host memory; CROSS_DEVICE: copies between devices;
COLLECTIVE: distributed communication; RNG: CUDA random numbers (safe: replays advance them);
SAFE: explicitly safe to capture (overrides every other tag).
"""
TAG_NAMES = ("HOST_SYNC", "DYNAMIC_SHAPE", "CPU_RNG", "HOST_ALLOC", "CROSS_DEVICE", "COLLECTIVE",
              "RNG", "SAFE")


def tag(name: str):
    """The ``Tag`` object of a tag name."""
    return getattr(tag_class(), name)


def tag_name(t) -> str:
    """The name of a tag given as a ``Tag`` object or a name."""
    if isinstance(t, str):
        if t not in TAG_NAMES:
            raise ValueError(f"unknown tag {t!r}; tags are {TAG_NAMES}")
        return t
    value = getattr(t, "_value", None)
    if value in TAG_NAMES and isinstance(t, tag_class()):
        return value
    raise ValueError(f"{t!r} is not a cudagraphify tag; tags are {TAG_NAMES}")


UNSAFE = frozenset({"HOST_SYNC", "DYNAMIC_SHAPE", "CPU_RNG", "HOST_ALLOC", "CROSS_DEVICE",
                    "COLLECTIVE"})


_thunder_cache: dict = {}


def thunder_tags(func: Callable, key: Any, args: tuple, kwargs: dict) -> frozenset:
    """Tags Thunder knows for ``func`` on inputs like ``args`` (cached per op and ``key``).

    The op's Thunder Symbol is traced on CPU stand-ins of the inputs (proxies only: nothing
    runs); Thunder's tags are gathered over every bound symbol of the decomposition. A trace that
    fails with NotImplementedError is Thunder saying the output shape is data-dependent.
    """
    cache_key = (func, key)
    hit = _thunder_cache.get(cache_key)
    if hit is not None:
        return hit
    th = thunder()
    result: frozenset = frozenset()
    if th is not None:
        import thunder.torch as ttorch
        from thunder.core.prims import OpTags
        from thunder.core.symbol import gather_tags

        sym = ttorch._torch_to_thunder_function_map.get(func)
        if sym is not None:
            cpu = [a.detach().to("cpu") if isinstance(a, torch.Tensor) else a for a in args]
            kw = {k: (v.detach().to("cpu") if isinstance(v, torch.Tensor) else v)
                  for k, v in kwargs.items()}
            found: set = set(getattr(sym, "tags", None) or ())
            try:
                trace = th.trace(inline_trace=False)(sym, *cpu, **kw)
                for bsym in trace.bound_symbols:
                    found |= gather_tags(bsym)
            except NotImplementedError:
                found.add("DYNAMIC_SHAPE")
            except Exception:  # noqa: BLE001 - Thunder cannot trace it: no information
                pass
            mapped = set()
            for t in found:
                if t is OpTags.DEVICE_SYNC_OP:
                    mapped.add("HOST_SYNC")
                elif t is OpTags.RANDOM_OP:
                    mapped.add("RNG")
                elif isinstance(t, str):
                    mapped.add(t)
                elif isinstance(t, tag_class()):
                    mapped.add(t._value)
            result = frozenset(mapped)
    _thunder_cache[cache_key] = result
    return result
