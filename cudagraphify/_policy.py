"""Which calls are safe to capture: op tags from rules, PyTorch's op tags and Thunder's.

:class:`OpPolicy` gives every call (a torch function or method, as a ``TorchFunctionMode`` sees
it, or a non-op call such as ``torch.cuda.synchronize``) a set of tag names, from, in order:

1. the user's overrides (``tag_op``, ``mark_safe``);
2. cudagraphify's rules: Python protocol calls on accelerator tensors (``item``, ``tolist``,
   ``bool``, printing), data-dependent shapes (``nonzero``, boolean-mask indexing), random ops
   and their generator (CPU generator or CPU device: ``CPU_RNG``; the default CUDA generator:
   ``RNG``, which graphs replay correctly), ``pin_memory``, copies between devices, non-op calls
   (syncs, seeding, collectives);
3. PyTorch's ``torch.Tag`` on the matching aten ops (``dynamic_output_shape``,
   ``data_dependent_output``, ``nondeterministic_seeded``);
4. Thunder's symbol tags over the op's decomposition, when asked (``thunder=True``).

:meth:`OpPolicy.can_graph` turns tags into a decision; subclass it to change the decision.
Pure: runs and is tested on a CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ._errors import CudagraphifyUsageError
from ._tags import UNSAFE, tag_name, thunder_tags

__all__ = ["OpPolicy", "default_policy", "op_name", "NON_OP_CALLS"]

T = torch.Tensor

_PROTOCOL_SYNC = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__,
                  T.__complex__, T.__repr__, T.__format__, T.numpy, T.__array__, torch.equal,
                  T.equal, torch.allclose, T.allclose, torch.is_nonzero, T.is_nonzero}
_DYNAMIC = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select,
            T.masked_select, torch.unique, T.unique, torch.unique_consecutive,
            T.unique_consecutive, torch.bincount, T.bincount}
# Calls that bring a tensor's values to the host (a Python value, or a shape made from them),
# whatever the device (``host_read`` adds the rules' and aten's tags); ``in`` too, whose
# ``.item()`` runs inside it, where no mode sees it
HOST_READS = frozenset(_PROTOCOL_SYNC | _DYNAMIC | {T.__contains__})
_INDEXING = {T.__getitem__, T.__setitem__, T.index_put, T.index_put_, torch.index_put}
_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
            F.feature_alpha_dropout}
_FACTORY_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy}

# Non-op calls a TorchFunctionMode does not see; the probe wraps them while it runs.
NON_OP_CALLS: dict[str, tuple[str, ...]] = {
    "torch.cuda.synchronize": ("HOST_SYNC",),
    "torch.cuda.Stream.synchronize": ("HOST_SYNC",),
    "torch.cuda.Event.synchronize": ("HOST_SYNC",),
    "torch.cuda.Event.query": ("HOST_SYNC",),
    "torch.cuda.Stream.query": ("HOST_SYNC",),
    "torch.manual_seed": ("CPU_RNG",),
    "torch.seed": ("CPU_RNG",),
    "torch.set_rng_state": ("CPU_RNG",),
    "torch.cuda.manual_seed": ("CPU_RNG",),
    "torch.cuda.manual_seed_all": ("CPU_RNG",),
    "torch.cuda.set_rng_state": ("CPU_RNG",),
    # Safe, but code that asks takes another path while captured (HF transformers' masks):
    # the probe notes the question, and a rehearsal answers it "yes" (see the engine).
    "torch.cuda.is_current_stream_capturing": (),
    **{f"torch.distributed.{n}": ("COLLECTIVE",) for n in (
        "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "barrier", "send", "recv", "isend", "irecv",
        "all_to_all", "all_to_all_single", "reduce", "gather", "scatter")},
}


# op_name's answers by the function's id (the probe asks for every op it records; by id, not
# equality: torch.saddmm == torch.sspaddmm), with the function held so that its id stays its own
_names: dict[int, tuple[Any, str]] = {}


def op_name(func: Any) -> str:
    if isinstance(func, str):
        return func
    hit = _names.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    name = _op_name(func)
    if len(_names) >= 4096:
        _names.clear()
    _names[id(func)] = (func, name)
    return name


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property read, such as Tensor.shape
        prop = getattr(func, "__self__", None)
        # (a C getset names itself; a Python property, __cuda_array_interface__, its getter)
        pname = getattr(prop, "__name__", None) or getattr(getattr(prop, "fget", None),
                                                           "__name__", None)
        if pname:
            return f"Tensor.{pname}"
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    qual = getattr(func, "__qualname__", "")
    if owner is torch._C.TensorBase or qual.startswith(("Tensor.", "TensorBase.")):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    if module.startswith(("torch.nn.functional", "torch._C._nn")) or func in _DROPOUT:
        return f"F.{name}"
    return f"torch.{name}" if module.startswith("torch") or owner is torch else name


ACCEL = frozenset({"cuda"})


def _on_device(t: Any, accel: frozenset) -> bool:
    """True for a tensor on a device whose work a graph captures (``accel``: device types)."""
    if not isinstance(t, torch.Tensor):
        return False
    device = t.device
    kind = _device_types.get(device)  # (``device.type`` makes a new string on each read)
    if kind is None:
        if len(_device_types) >= 256:
            _device_types.clear()
        kind = _device_types[device] = device.type
    return kind in accel


_device_types: dict[torch.device, str] = {}


def _no_data(data: Any) -> bool:
    """An empty list or tuple (``torch.tensor([], device="cuda")``, an HF ``DynamicLayer``'s
    first keys): a tensor of no elements, whose copy to the device copies nothing (``copy_``
    returns before any transfer), so nothing of the host's is kept in a graph."""
    return type(data) in (list, tuple) and len(data) == 0


def _device_of_factory(kwargs: dict) -> torch.device:
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.get_default_device()


_aten_tag_cache: dict[Any, frozenset] = {}
_device_tag_cache: dict[Any, frozenset] = {}


def _device_tags(func: Any) -> frozenset:
    """``torch_op_tags(func)`` but RNG (cached): what an op on an accelerator adds to the tags
    (see ``OpPolicy.tags``)."""
    hit = _device_tag_cache.get(func)
    if hit is None:
        if len(_device_tag_cache) >= 4096:
            _device_tag_cache.clear()
        hit = _device_tag_cache[func] = torch_op_tags(func) - {"RNG"}
    return hit


def torch_op_tags(func: Any) -> frozenset:
    """Tag names from ``torch.Tag`` on the aten ops named like ``func`` (cached)."""
    hit = _aten_tag_cache.get(func)
    if hit is not None:
        return hit
    name = getattr(func, "__name__", "").rstrip("_")
    found: set = set()
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
    if packet is not None:
        try:
            for ov in packet.overloads():
                tags = getattr(packet, ov).tags
                if torch.Tag.dynamic_output_shape in tags:
                    found.add("DYNAMIC_SHAPE")
                if torch.Tag.data_dependent_output in tags:
                    found.add("HOST_SYNC")
                if torch.Tag.nondeterministic_seeded in tags:
                    found.add("RNG")
        except (AttributeError, RuntimeError):
            pass
    result = frozenset(found)
    _aten_tag_cache[func] = result
    return result


def _rng_tags(func: Any, args: tuple, kwargs: dict, accel: frozenset) -> set:
    gen = kwargs.get("generator")
    if gen is not None:
        if gen.device.type == "cpu":
            return {"CPU_RNG"}
        defaults = torch.cuda.default_generators if torch.cuda.is_available() else ()
        index = gen.device.index or 0
        # only the default CUDA generator is registered with graphs and advanced on replay
        return {"RNG"} if index < len(defaults) and gen is defaults[index] else {"CPU_RNG"}
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    on_accel = (_on_device(tensors[0], accel) if tensors
                else _device_of_factory(kwargs).type in accel)
    return {"RNG"} if on_accel else {"CPU_RNG"}


def _to_tags(func: Any, args: tuple, kwargs: dict, accel: frozenset) -> set:
    src = args[0]
    if func is T.cpu:
        return {"CROSS_DEVICE", "HOST_SYNC"} if _on_device(src, accel) else set()
    if func is T.cuda:
        return set() if _on_device(src, accel) else {"CROSS_DEVICE"}
    if func is T.to:
        try:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        except (TypeError, RuntimeError):
            return set()
        if device is None:
            return set()
        src_on, dst_on = _on_device(src, accel), device.type in accel
        if src_on and not dst_on:
            return {"CROSS_DEVICE", "HOST_SYNC"}
        return {"CROSS_DEVICE"} if dst_on and not src_on else set()
    if func is T.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
        if _on_device(args[0], accel) != _on_device(args[1], accel):
            return {"CROSS_DEVICE"}
    return set()


_EVERY_DEVICE = frozenset({"cpu", "cuda", "mps", "xpu", "hpu", "xla", "meta", "privateuseone"})


def host_read(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call brings tensor values to the host on any device: a Python value
    (``.item()``, ``bool``, ``in``) or a shape made from them (``nonzero``, a boolean mask,
    ``repeat_interleave`` by a tensor; aten's data-dependent tags)."""
    if func in HOST_READS:
        return True
    tags = builtin_tags(func, args, kwargs, _EVERY_DEVICE)
    if func not in _RULED and not (func is F.one_hot and _num_classes(args, kwargs) >= 0):
        # (aten's tags, merged over a name's overloads: a function a rule decides by its
        # arguments, ``repeat_interleave`` by an int, and ``one_hot`` given its classes, keep
        # their static shapes)
        tags |= torch_op_tags(func)
    return "HOST_SYNC" in tags or "DYNAMIC_SHAPE" in tags


def _num_classes(args: tuple, kwargs: dict) -> int:
    n = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
    return n if isinstance(n, int) else -1


_RULED = frozenset(_PROTOCOL_SYNC | _DYNAMIC | _INDEXING | _DROPOUT | _FACTORY_FROM_DATA | {
    torch.where, T.where, torch.repeat_interleave, T.repeat_interleave, T.cpu, T.cuda, T.to,
    T.copy_, T.pin_memory})  # the functions builtin_tags has a rule for
_untagged: dict[Any, bool] = {}
_NONE: frozenset = frozenset()


def _never_tagged(func: Any) -> bool:
    """True when no rule of :func:`builtin_tags` and no aten tag applies to ``func`` (given no
    ``generator=`` or ``pin_memory=``), whatever its arguments: most ops (cached)."""
    hit = _untagged.get(func)
    if hit is None:
        hit = _untagged[func] = func not in _RULED and not torch_op_tags(func)
    return hit


def builtin_tags(func: Any, args: tuple, kwargs: dict, accel: frozenset = ACCEL) -> set:
    """cudagraphify's own rules for one call."""
    tags: set = set()
    first = args[0] if args else None
    if func in _PROTOCOL_SYNC:
        if _on_device(first, accel):
            tags.add("HOST_SYNC")
        return tags
    if func in _DYNAMIC:
        tags |= {"DYNAMIC_SHAPE", "HOST_SYNC"}
    elif func in (torch.where, T.where) and len(args) + len(kwargs) == 1:  # (``condition=``)
        tags |= {"DYNAMIC_SHAPE", "HOST_SYNC"}
    elif func in (torch.repeat_interleave, T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if repeats is None:  # (``repeat_interleave(counts)``: the counts are the repeats)
            repeats = args[0] if args else kwargs.get("input")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            tags |= {"DYNAMIC_SHAPE", "HOST_SYNC"}
    elif func in _INDEXING and len(args) > 1:
        index = args[1]
        parts = index if isinstance(index, (tuple, list)) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype in (torch.bool, torch.uint8)
               for p in parts):  # (a uint8 index is a mask too, deprecated)
            tags |= {"DYNAMIC_SHAPE", "HOST_SYNC"}
    elif func in _DROPOUT:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        if training and p > 0:
            tags |= _rng_tags(func, args[:1], {}, accel)
    elif func in (T.cpu, T.cuda, T.to, T.copy_):
        tags |= _to_tags(func, args, kwargs, accel)
    elif func in _FACTORY_FROM_DATA:
        if _device_of_factory(kwargs).type in accel and not isinstance(first, torch.Tensor) \
                and not _no_data(first):
            tags.add("CROSS_DEVICE")  # host data copied to the device: stale on replay
    if func is T.pin_memory or kwargs.get("pin_memory") is True:
        tags.add("HOST_ALLOC")
    if ("generator" in kwargs or "RNG" in torch_op_tags(func)) and func not in _DROPOUT:
        p = kwargs.get("dropout_p")
        if p is None and func is F.scaled_dot_product_attention:  # (q, k, v, mask, dropout_p)
            p = args[4] if len(args) > 4 else 0.0
        if not isinstance(p, (int, float)) or p > 0:  # no dropout: no random numbers
            tags |= _rng_tags(func, args, kwargs, accel)
    return tags


def _visible(fn: Any) -> bool:
    """Can the probe see calls of ``fn``? (torch functions, Tensor methods, custom ops, names)"""
    if isinstance(fn, str):
        return True
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module = getattr(fn, "__module__", None) or ""
    owner = getattr(fn, "__objclass__", None)
    return module.startswith("torch") or owner is torch._C.TensorBase or \
        getattr(fn, "__self__", None) is torch._C._VariableFunctions


def _check_target(caller: str, fn: Any) -> None:
    """Refuse what the probe would never match: anything but a torch function, Tensor method,
    custom op, or the name of a non-op call it wraps."""
    if isinstance(fn, str):
        if fn not in NON_OP_CALLS:
            raise CudagraphifyUsageError(
                f"{caller}: {fn!r} is not the name of a call the probe wraps; names stand only "
                f"for these non-op calls: {', '.join(NON_OP_CALLS)}. For a torch function, "
                "Tensor method or custom op, pass the object itself (torch.nonzero, "
                "torch.Tensor.item, torch.ops.mylib.my_op)")
        return
    if not callable(fn):
        raise CudagraphifyUsageError(
            f"{caller}: {fn!r} ({type(fn).__name__}) is not a function, op or name: pass a "
            "torch function, Tensor method or custom op (torch.library), or the name of a "
            "non-op call such as 'torch.cuda.synchronize'")
    if not _visible(fn):
        raise CudagraphifyUsageError(
            f"{caller}: {getattr(fn, '__qualname__', fn)!r} is a plain Python function: the "
            "probe sees torch functions, Tensor methods and custom ops (torch.library), not the "
            "Python functions that call them. Tag the torch op it calls, or register it as a "
            "custom op, or name a non-op call (e.g. 'torch.cuda.synchronize')")


class OpPolicy:
    """Tags calls and decides whether they can be captured. Subclass to change the decision.

    ``tag_op(fn, *tags)`` tags a torch function, Tensor method or custom op (or a non-op call
    of :data:`NON_OP_CALLS`, by name) wherever it is called; ``mark_safe(fn)`` overrides every
    other tag of ``fn``. Tags are ``Tag`` objects or names. Both refuse what the probe never
    sees (a plain Python function, another name) with a ``CudagraphifyUsageError``.
    """

    # Packages whose code asks ``torch.cuda.is_current_stream_capturing()`` only to skip work
    # that does not change the result (HF transformers: a host-sync shortcut in its masks, made
    # to give what torch.compile's path gives): the path they take while captured is trusted
    # to compute what the eager path computes (see ``trusts_captured_path``).
    TRUSTED_CAPTURED_PATHS: tuple[str, ...] = ("transformers.",)

    def __init__(self):
        self._overrides: dict[Any, frozenset[str]] = {}

    def trusts_captured_path(self, module_name: str) -> bool:
        """Whether code in module ``module_name`` that asks whether it is being captured takes,
        while captured, a path that computes what its eager path computes (then a forward whose
        eager path is unsafe is planned on that path). Anything not trusted keeps the eager
        path's plan: a guard skipped while captured (a NaN fix-up, a validation) would change
        answers. Extend ``TRUSTED_CAPTURED_PATHS`` or override this in a subclass."""
        return module_name.startswith(self.TRUSTED_CAPTURED_PATHS)

    def tag_op(self, fn: Callable, *tags) -> None:
        _check_target("tag_op", fn)
        if not tags:
            raise CudagraphifyUsageError(
                "tag_op needs at least one tag, as tag_op(fn, 'HOST_SYNC') or "
                "tag_op(fn, Tag.HOST_SYNC); to declare fn safe, call mark_safe(fn)")
        try:
            names = {tag_name(t) for t in tags}
        except ValueError as e:
            raise CudagraphifyUsageError(f"tag_op: {e}") from None
        self._overrides[fn] = self._overrides.get(fn, frozenset()) | names

    def mark_safe(self, fn: Callable) -> None:
        _check_target("mark_safe", fn)
        self._overrides[fn] = frozenset({"SAFE"})

    def overrides(self, fn: Any) -> frozenset[str] | None:
        return self._overrides.get(fn)

    def tags(self, func: Any, args: tuple = (), kwargs: dict | None = None, *,
             accel: frozenset = ACCEL, thunder: bool = False, thunder_key: Any = None) -> frozenset:
        """Every tag name of one call (see the module docs for the sources, in order)."""
        kwargs = kwargs or {}
        if not thunder and self.untagged_call(func, kwargs):
            return _NONE  # (what the rules below find for it)
        own = self._overrides.get(func)
        if own is not None and "SAFE" in own:
            return own
        found = set(own or ()) | builtin_tags(func, args, kwargs, accel)
        static_form = (func in (torch.repeat_interleave, T.repeat_interleave)
                       and kwargs.get("output_size") is not None)  # aten tags all its forms
        if not static_form and (any(_on_device(a, accel) for a in args) or any(
                _on_device(v, accel) for v in kwargs.values())):
            # a sync or a data-dependent shape matters on an accelerator only; RNG is decided
            # with the generator, above
            found |= _device_tags(func)
        if thunder and not isinstance(func, str):
            found |= {t for t in thunder_tags(func, thunder_key, args, kwargs) if t != "RNG"}
        return frozenset(found)

    def untagged_call(self, func: Any, kwargs: dict) -> bool:
        """True when no tag can apply to this call of ``func`` (Thunder's aside): no override,
        no rule of :func:`builtin_tags`, no aten tag, no ``generator=`` or ``pin_memory=``.
        Most calls; cached per function."""
        return self._overrides.get(func) is None and _never_tagged(func) and (
            not kwargs or ("generator" not in kwargs and "pin_memory" not in kwargs))

    def can_graph(self, func: Any, tags: frozenset) -> bool:
        """True when a call of ``func`` with these tags may be captured. Override to change the
        decision.

        The probe asks about every call it records (torch functions, Tensor methods, custom
        ops, and the non-op calls of :data:`NON_OP_CALLS` by name), tagged or not: most ops
        come with no tags, and a subclass may refuse such an op by ``func`` alone. Default: no
        unsafe tag, or ``SAFE``."""
        return "SAFE" in tags or not (tags & UNSAFE)


default_policy = OpPolicy()
