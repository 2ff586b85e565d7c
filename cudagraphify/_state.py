"""Static state passed as an argument: objects recognised as keeping their tensors in place.

A Hugging Face ``StaticCache`` is allocated on its first update and then only written in
place; a graph can read and write it where it lies. Such an object is keyed by what it holds
(:func:`state_key`: the address and layout of every tensor in it, every other value it holds),
not by its identity, and never held by a graph: a graph applies to a call exactly when the
cache passed holds tensors at the addresses the graph was captured with, with the same
layouts and the same Python state. So a cache that ``generate()`` makes anew for every call
(``cache_implementation="static"``) reuses the graphs of an earlier one whose memory it was
given, a cache that was reset in place (``cache.reset()``) keeps them, and a cache whose
tensors were replaced or moved gets graphs of its own.

A cache allocates its tensors on its first update, inside forward; that call runs eagerly. What
it allocated is read back as a :class:`SetUp` (HF's ``Cache.early_initialization`` arguments):
the next cache passed in the state the first one was in is set up the same way before the call,
so that its first call (a prefill) is graphed too. On CUDA it allocates them in a memory pool
of its own: when ``generate`` drops its cache, the next cache set up is given the same memory,
so the same key, and replays the dropped one's graphs, which are kept for it (:func:`pooled`).
Nothing here touches CUDA but :meth:`SetUp.apply` (it allocates the cache's tensors, as its
first update would).
"""

from __future__ import annotations

import contextlib
import struct
import types
import weakref
from typing import Any, Hashable

import torch

from ._statics import ptrs_equal

__all__ = ["is_static_state", "may_be_static_state", "demote", "demoted", "changed_again",
           "state_key", "state_layout", "StateUnkeyable", "SetUp", "pooled", "first_of_kind",
           "tensors_in"]

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_MAX_ITEMS = 4096  # values walked per object: beyond that it is refused (too costly per call)
_MAX_DEPTH = 5
_cache_types: dict[type, bool] = {}


class StateUnkeyable(Exception):
    """A static-state object holds something :func:`state_key` cannot describe."""


def is_static_state(value: Any) -> bool:
    """Whether ``value`` is state recognised as keeping its tensors in place: a Hugging Face
    ``Cache`` whose layers are all static (``StaticCache``; ``cache.is_compileable``), unless a
    forward was seen changing its Python state (:func:`demote`). A ``DynamicCache`` grows (new
    tensors every step): it is not."""
    if not may_be_static_state(type(value)):
        return False
    if _changing and _changing.payload(value) is not None:
        return False
    try:
        return getattr(value, "is_compileable", False) is True
    except Exception:  # noqa: BLE001 - a cache in a state its property cannot read
        return False


class _Remembered(dict):
    """id -> (weak reference, payload) of live objects: an entry leaves with its object."""

    def payload(self, value: Any) -> Any:
        """What was remembered of ``value`` (None: nothing)."""
        hit = self.get(id(value))
        return hit[1] if hit is not None and hit[0]() is value else None

    def remember(self, value: Any, payload: Any) -> bool:
        """Remember ``payload`` for ``value``; False where it takes no weak reference."""
        try:
            ref = weakref.ref(value, lambda _r, k=id(value), d=self: d.pop(k, None))
        except TypeError:
            return False
        self[id(value)] = (ref, payload)
        return True


# static-state objects demoted to opaque ones, with why (see demote)
_changing = _Remembered()
CHANGES = ("has Python state that the forward changes on every call (such as a sliding "
           "window's token count; seen on two calls with it)")
# static-state objects a forward changed the Python state of once (see changed_again)
_changed_once = _Remembered()


def changed_again(value: Any) -> bool:
    """A forward changed ``value``'s Python state: whether it did so before (a one-time change,
    a flag set on the first step, is then not taken for one made on every call). True where
    it cannot be remembered (no weak reference)."""
    if _changed_once.payload(value):
        return True
    return not _changed_once.remember(value, True)


def demote(value: Any, why: str = CHANGES) -> None:
    """``value`` is static state no graph of a call with it could use: a forward changed its
    Python state, not only its tensors' values (HF's ``StaticSlidingWindowLayer`` counts the
    tokens it has seen in a Python int, bumped by every update: each call would find it under a
    new key, and pay a first call's probed runs to learn it again), or :func:`state_key` cannot
    describe it (``why`` says which). From now on it is not static state but an opaque object,
    for every callable it is passed to, for as long as it lives: those calls run eagerly
    around it, as with a ``DynamicCache``. (Without a weak reference, nothing: the calls go on
    being decided one by one.) An object set up by a call of a kind (:func:`first_of_kind`)
    marks that kind: the next ones of it are passed as they are at once."""
    _changing.remember(value, why)
    kind = _first_of.payload(value)
    if kind is not None:
        kind.demoted = why


def demoted(value: Any) -> str | None:
    """Why ``value`` was demoted (:func:`demote`), or None."""
    return _changing.payload(value)


def may_be_static_state(tp: type) -> bool:
    """Whether instances of ``tp`` may be static state: an HF ``Cache`` class."""
    hit = _cache_types.get(tp)
    if hit is None:
        hit = _cache_types[tp] = any(k.__name__ == "Cache" and
                                     k.__module__ == "transformers.cache_utils"
                                     for k in tp.__mro__)
    return hit


def state_key(value: Any) -> Hashable:
    """What ``value`` holds, as a hashable key: for each tensor its address, shape, stride,
    dtype, device and ``requires_grad`` (a small CPU tensor: its value too, which a forward
    reads on the host), every immutable value as it is, containers and objects by their
    contents. Raises :class:`StateUnkeyable` for what cannot be described (modules, array-like
    data that changes in place, too much to walk on every call).

    The key of an object is remembered with what its walk saw (:class:`_Walk`): while none of
    its dicts and lists changed and its tensors kept their addresses, layouts and (small CPU
    ones) values, the same key is returned after a few C calls, without walking again."""
    hit = _memo.get(id(value))
    if hit is not None and hit[0]() is value and hit[1].same(value):
        if len(_memo) > _MAX_MEMO // 2:  # (least recently used first: a hit moves to the end)
            _memo[id(value)] = _memo.pop(id(value))
        return hit[2]
    walk = _Walk()
    key = StateKey(_key(value, 0, [0], walk))
    walk.freeze(value)
    if any(x is value for d, _ in walk.dicts for x in d.values()) or \
            any(obj is value for obj, _, _ in walk.objects):
        return key  # a cycle back to the object: the memo would keep it alive
    try:
        ref = weakref.ref(value, lambda _r, k=id(value): _memo.pop(k, None))
    except TypeError:
        return key
    if len(_memo) >= _MAX_MEMO:
        _memo.pop(next(iter(_memo)), None)
    _memo[id(value)] = (ref, walk, key)
    return key


def state_layout(values: list) -> tuple[Hashable, list[tuple[int, int]]]:
    """What :func:`state_key` tells of ``values`` (static states) except where their tensors
    lie: each tensor by its storage's index, size and alignment (address modulo 256) and its
    offset in it. With the storages, as (address, bytes) in that order. Raises
    :class:`StateUnkeyable` (as state_key does, and for pinned host memory)."""
    walk = _Walk()
    walk.storages = {}
    key = tuple(_key(v, 0, [0], walk) for v in values)
    ranges = sorted(walk.storages.items(), key=lambda item: item[1][0])
    return key, [(ptr, nbytes) for ptr, (_, nbytes) in ranges]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_pack_double = struct.Struct("<d").pack


def float_bits(v: float) -> bytes:
    """A float's bits: ``0.0`` and ``-0.0`` differ, and NaNs of other signs (``float.hex``
    names both ``nan``); the same NaN equals itself."""
    return _pack_double(v)


def host_bits(t: torch.Tensor) -> list:
    """A host tensor's values as a graph that read them is checked against (``tolist``):
    floats by their bits, so that ``0.0`` and ``-0.0`` differ (and a NaN equals itself)."""
    t = t.resolve_neg()  # (a neg or conj view: its values, which a view as ints would not be)
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.is_floating_point():
        t = t.view(_BITS[t.element_size()])
    return t.tolist()


def object_dict(obj: Any) -> Any:
    """``obj.__dict__`` (through a proxy's ``__getattribute__``: its target's), or None where
    it has none, also where a ``__getattr__`` of its own raises something else than
    AttributeError for it (an attribute dict's KeyError)."""
    try:
        return getattr(obj, "__dict__", None)
    except Exception:  # noqa: BLE001 - the user's __getattr__: any error means none
        try:
            return object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return None


def tensors_in(value: Any, depth: int = 0, seen: dict[int, int] | None = None
               ) -> list[torch.Tensor]:
    """Tensors reachable from ``value`` (containers and object attributes, 4 levels), once per
    path (a tensor held twice is there twice). ``seen`` (id -> the shallowest depth it was
    walked at), where given: each object walked again only where met less deep, each tensor
    once (objects that hold each other cost a walk each, not one per path)."""
    if isinstance(value, torch.Tensor):
        if seen is not None:
            if id(value) in seen:
                return []
            seen[id(value)] = -1
        return [value]
    if depth > 4:
        return []
    if seen is not None:
        if seen.get(id(value), 5) <= depth:
            return []
        seen[id(value)] = depth
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        d = object_dict(value)
        items = list(d.values()) if isinstance(d, dict) else []
    return [t for item in items for t in tensors_in(item, depth + 1, seen)]


class SetUp:
    """How a static state was set up by a call (an HF cache's first update allocating its
    layers' tensors), read back from the object afterwards: the arguments of HF's
    ``Cache.early_initialization`` and the layout (:func:`state_layout`) it left.

    :meth:`apply` sets another object (in the state the first one was in before that call) up
    the same way, before its call: that call then finds its tensors allocated, as every later
    call does, and need not run eagerly. It keeps the set-up only when the object's layout is
    then exactly the one the call left (every tensor's shape, stride, dtype, device, storage
    size and offset, every other value), and otherwise puts the object back as it was."""

    __slots__ = ("kwargs", "layout", "pool")

    def __init__(self, kwargs: dict, layout: Hashable):
        self.kwargs = kwargs
        self.layout = layout
        self.pool = None  # (a CUDA memory pool of the objects it sets up: see apply)

    @classmethod
    def read(cls, value: Any) -> "SetUp | None":
        """From an object a call set up; None where it is not a cache whose every layer was
        allocated as ``early_initialization`` allocates (a key and a value tensor each, of one
        head size, one batch size, dtype and device for all)."""
        layers = getattr(value, "layers", None)
        if not callable(getattr(value, "early_initialization", None)) or not layers \
                or type(layers) is not list:
            return None
        heads, dims, common = [], [], set()
        for layer in layers:
            if getattr(layer, "supports_early_init", False) is not True \
                    or getattr(layer, "is_initialized", False) is not True:
                return None
            try:
                k, v = layer.k_head_dim, layer.v_head_dim
                common.add((layer.batch_size, layer.dtype, layer.device))
                heads.append(layer.num_heads)
            except AttributeError:
                return None
            if k != v or len(common) > 1:
                return None
            dims.append(k)
        ((batch, dtype, device),) = common
        try:
            layout = state_layout([value])[0]
        except StateUnkeyable:
            return None
        return cls(dict(batch_size=batch, num_heads=heads, head_dim=dims, dtype=dtype,
                        device=device), layout)

    def apply(self, value: Any) -> bool:
        """Set ``value`` up; True when it then has the layout the first call left (else it is
        put back as it was, and False)."""
        saved = [(obj, dict(obj.__dict__)) for obj in [value] + list(value.layers)]
        try:
            allocating, in_pool = self._allocating()
            with allocating:
                value.early_initialization(**self.kwargs)
            if state_layout([value])[0] == self.layout:
                if in_pool:
                    _pooled.remember(value, True)
                return True
        except Exception:  # noqa: BLE001 - not set up: the call sets it up itself, eagerly
            pass
        for obj, d in saved:
            obj.__dict__.clear()
            obj.__dict__.update(d)
        return False

    def _allocating(self):
        """Where a set-up's tensors are allocated: on CUDA, a memory pool of this set-up's
        own, which only the objects it sets up use. Once the last one is dropped (``generate``
        drops its cache when it returns), the next one is given the same memory, in the same
        order: the same addresses, so the same key, and the graphs of the last one replay
        with no capture and no rebase (:func:`pooled`). Returns (the context to allocate in,
        whether that is the pool)."""
        device = torch.device(self.kwargs["device"])
        if device.type != "cuda" or not hasattr(torch.cuda, "use_mem_pool") \
                or torch.cuda.is_current_stream_capturing():  # (a caller's capture's pool)
            return contextlib.nullcontext(), False
        if self.pool is None:
            with torch.cuda.device(device):
                self.pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self.pool, device), True


# static-state objects set up in a set-up's own pool (see SetUp._allocating)
_pooled = _Remembered()


def pooled(value: Any) -> bool:
    """Whether ``value`` was set up in a :class:`SetUp`'s own memory pool: a graph keyed by
    its addresses is kept when it dies (the next object set up is given the same memory, and
    replays that graph), not dropped as the graphs of other dead states are."""
    return _pooled.payload(value) is True


# static-state objects set up by a call of a signature, with what stands for it (an object
# with a ``demoted`` attribute; see first_of_kind, demote)
_first_of = _Remembered()


def first_of_kind(value: Any, kind: Any) -> None:
    """``value`` was set up by (or before) a call of ``kind``, a signature whose calls each
    set a new object of its kind up (``generate`` makes a cache per call): if ``value`` is
    demoted, ``kind.demoted`` says why, and the next ones can be passed as they are at once
    instead of being probed on two calls each."""
    _first_of.remember(value, kind)


class StateKey:
    """A state's key: the walk's tuple with its hash computed once (it is long: every value of
    the state), so that a signature holding it hashes in constant time on every call."""

    __slots__ = ("items", "hash")

    def __init__(self, items: tuple):
        self.items = items
        self.hash = hash(items)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is StateKey and self.hash == other.hash
                                 and self.items == other.items)

    def __repr__(self) -> str:
        return f"StateKey({self.items!r})"


_MAX_MEMO = 256  # walks kept (an entry goes with its object too)
_memo: dict[int, tuple] = {}  # id(object) -> (weak reference, its walk, its key)
_dict_version = torch._C._dynamo.guards.dict_version
_TensorGuards = torch._C._dynamo.guards.TensorGuards


class _Walk:
    """What one walk of :func:`state_key` read, and a cheap check that it is all unchanged:
    every dict's version (an object's ``__dict__`` included), every list's items (by
    identity), the tensors' layouts and flags in one C call, their addresses in one list, and
    the values of the small CPU tensors."""

    __slots__ = ("dicts", "objects", "root", "lists", "tensors", "small", "guard", "ptrs",
                 "storages", "indices")

    def __init__(self):
        self.dicts: list[tuple[dict, int]] = []
        # objects walked, with their class and __dict__: a new __dict__ or class leaves the
        # old dict's version as it was
        self.objects: list[tuple[Any, type, dict]] = []
        self.root: tuple[type, Any] | None = None  # the walked object's (not held)
        # for state_layout: storage address -> (index, bytes); tensors keyed by where they lie
        # in their storage instead of by address
        self.storages: dict[int, tuple[int, int]] | None = None
        self.lists: list[tuple[list, list]] = []
        self.tensors: list[torch.Tensor] = []
        self.small: list[tuple[torch.Tensor, Any]] = []
        self.guard = None
        self.ptrs: list[int] = []
        self.indices: list[int] = []

    def freeze(self, value: Any) -> None:
        if self.objects and self.objects[0][0] is value:
            self.root = self.objects.pop(0)[1:]
        ts = self.tensors
        if ts:
            self.guard = _TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                       dynamic_dims_strides=[list(t.stride()) for t in ts])
            self.ptrs = [t.data_ptr() for t in ts]
            self.indices = list(range(len(ts)))

    def where(self, t: torch.Tensor) -> tuple:
        """Where ``t`` lies, without its address: its storage's index (in walk order), size
        and alignment, and its offset in it."""
        s = t.untyped_storage()
        ptr = s.data_ptr()
        j, nbytes = self.storages.setdefault(ptr, (len(self.storages), s.nbytes()))
        # (CUDA libraries pick kernels by pointer alignment; 256 bytes covers what they test)
        return (j, nbytes, ptr % 256 if t.is_cuda else 0, t.storage_offset())

    def same(self, value: Any) -> bool:
        if self.root is not None and (type(value) is not self.root[0] or
                                      value.__dict__ is not self.root[1]):
            return False
        for obj, tp, d in self.objects:
            if type(obj) is not tp or obj.__dict__ is not d:
                return False
        for d, version in self.dicts:
            if _dict_version(d) != version:
                return False
        for items, ids in self.lists:
            if len(items) != len(ids) or any(a is not b for a, b in zip(items, ids)):
                return False
        if self.guard is not None and not (self.guard.check(*self.tensors) and (
                ptrs_equal(self.tensors, self.ptrs, self.indices) if ptrs_equal is not None
                else [t.data_ptr() for t in self.tensors] == self.ptrs)):
            return False
        return all(host_bits(t) == v for t, v in self.small)


_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)
_CONSTANTS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
              torch.Size, torch.layout, torch.memory_format)


def _key(v: Any, depth: int, count: list[int], walk: _Walk) -> Hashable:
    count[0] += 1
    if count[0] > _MAX_ITEMS:
        raise StateUnkeyable(f"holds more than {_MAX_ITEMS} values (too many to check on "
                             "every call)")
    tp = type(v)
    if isinstance(v, float):  # (numpy's float64 too) -0.0 and 0.0 differ; nan equals nan
        return (tp, float_bits(v))
    if isinstance(v, complex):
        return (tp, float_bits(v.real), float_bits(v.imag))
    if isinstance(v, _CONSTANTS):
        return (tp, v)
    if tp is _Tensor or tp is _Parameter:
        walk.tensors.append(v)
        if v.device.type == "cpu" and v.numel() <= 64:
            # read on the host, by value; a graph reads host memory in place only if pinned
            value = host_bits(v)  # (floats by their bits: 0.0 and -0.0 differ)
            walk.small.append((v, value))
            pinned = v.is_pinned()
            if pinned and walk.storages is not None:
                raise StateUnkeyable("holds pinned host memory (a graph may read it in place)")
            return ("cpu", v.data_ptr() if pinned else 0, v.dtype, v.shape, v.stride(),
                    v.requires_grad, _hashable(value))
        where = v.data_ptr() if walk.storages is None else walk.where(v)
        return ("t", where, v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
    if isinstance(v, torch.Tensor):
        raise StateUnkeyable(f"holds a {tp.__name__} (a tensor subclass)")
    if isinstance(v, torch.nn.Module):
        raise StateUnkeyable("holds a module")
    if isinstance(v, _IDENTITY):
        return ("id", getattr(v, "__module__", None), getattr(v, "__qualname__", None), id(v))
    if depth >= _MAX_DEPTH:
        raise StateUnkeyable(f"nests objects more than {_MAX_DEPTH} deep")
    if tp is dict:
        walk.dicts.append((v, _dict_version(v)))
        return (dict, tuple((k, _key(x, depth + 1, count, walk)) for k, x in v.items()
                            if _plain_key(k)))
    if tp is list:
        walk.lists.append((v, list(v)))
        return (list, tuple(_key(x, depth + 1, count, walk) for x in v))
    if tp is tuple:
        return (tuple, tuple(_key(x, depth + 1, count, walk) for x in v))
    if isinstance(v, (dict, list, tuple)):
        raise StateUnkeyable(f"holds a {tp.__name__} (a container subclass, whose contents "
                             "the key cannot tell)")
    d = object_dict(v)
    if type(d) is dict and not _slotted(tp):
        walk.objects.append((v, tp, d))
        return ("o", tp.__module__, tp.__qualname__, id(tp), _key(d, depth + 1, count, walk))
    raise StateUnkeyable(f"holds a {tp.__name__}, whose contents cannot be read to check them")


def _hashable(value: Any) -> Any:
    """A nested list of numbers (``tolist``) as nested tuples."""
    return tuple(_hashable(x) for x in value) if isinstance(value, list) else value


_slotted_types: dict[type, bool] = {}


def _slotted(tp: type) -> bool:
    """Whether instances of ``tp`` keep values in slots (beside or instead of a ``__dict__``)."""
    hit = _slotted_types.get(tp)
    if hit is None:
        names = [n for k in tp.__mro__ for n in _slot_names(k.__dict__.get("__slots__", ()))]
        hit = _slotted_types[tp] = any(n not in ("__dict__", "__weakref__") for n in names)
    return hit


def _slot_names(slots: Any) -> tuple:
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _plain_key(k: Any) -> bool:
    if type(k) is not str:
        raise StateUnkeyable(f"holds a dict keyed by {type(k).__name__}")
    return True
