"""Input signatures: what must match for a captured graph to apply to a call.

A signature covers every tensor in the call's arguments (shape, stride, dtype, device,
requires_grad, and the address of inputs that are read in place), every non-tensor argument by
value, the nesting of the arguments, and the grad mode, inference mode and autocast state of the
call. What the forward reads besides its arguments (module attributes such as ``training``,
global flags) is guarded per graph by :mod:`._guards`. Pure: nothing here touches CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import enum
import fractions
import pathlib
import sys
import threading
import types
import uuid
import weakref
from typing import Any, Hashable, NamedTuple

import torch
import torch.utils._pytree as pytree

from ._state import StateUnkeyable, demoted, float_bits, is_static_state, object_dict, \
    state_key

__all__ = [
    "PLAIN_TYPES",
    "repeated",
    "Signature",
    "Unkeyable",
    "CallState",
    "Constant",
    "build_signature",
    "call_state",
    "is_opaque",
    "is_static_state",
    "opaque_argument",
    "storage_of",
    "is_constant",
    "strict_key",
    "mark_static",
    "is_marked_static",
    "leaf_kind",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided

# Types whose instances are immutable values: safe to key on, and safe to return as they are.
_CONSTANT_TYPES = (
    int, float, bool, complex, str, bytes, type(None), type(Ellipsis), type(NotImplemented),
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size, range, enum.Enum,
)

_EXACT_CONSTANT_TYPES = frozenset(_CONSTANT_TYPES) - {enum.Enum}


_MEMBER = types.MemberDescriptorType
# id(type) -> (a weak reference to the type, whether its instances may hold attributes or its
# class data of its own: see _carries_attributes); cached, by identity (a WeakKeyDictionary
# would find a class by its metaclass's ``==``: another class equal to it)
_slotted: dict[int, tuple[weakref.ref, bool]] = {}
_NAMEDTUPLE_DATA = frozenset({"_fields", "_field_defaults"})  # (what a namedtuple's class holds)


def _carries_attributes(value: Any) -> bool:
    """Whether an instance may hold attributes of its own: an instance ``__dict__``, or slots
    its class declares (``class Scale(float): __slots__ = ("center",)``); or its class holds
    data (``center = False``, read through the instance) that no key by value sees change."""
    try:
        object.__getattribute__(value, "__dict__")
        return True
    except AttributeError:
        pass
    tp = type(value)
    hit = _slotted.get(id(tp))
    if hit is not None and hit[0]() is tp:
        return hit[1]
    carries = any(_holds_data(c) for c in tp.__mro__
                  if getattr(c, "__module__", None) != "builtins")
    key = id(tp)
    _slotted[key] = (weakref.ref(tp, lambda _r: _slotted.pop(key, None)), carries)
    return carries


def _holds_data(c: type) -> bool:
    """Whether class ``c`` declares slots (a member descriptor, however ``__slots__`` was
    given: a generator's is used up) or class data of its own: anything but dunders and
    descriptors (methods, properties: code). A structseq's fields (``sys.version_info``) are
    read-only members, its class data its layout; a namedtuple's, its fields'."""
    d = vars(c)
    if "n_sequence_fields" in d:
        return False
    named = "_fields" in d and issubclass(c, tuple)
    for k, v in d.items():
        if type(v) is _MEMBER:
            if k != "__weakref__":
                return True
        elif not (k.startswith("__") and k.endswith("__")) and not hasattr(type(v), "__get__") \
                and not (named and k in _NAMEDTUPLE_DATA) and k != "_abc_impl":
            return True
    return False


# id -> weak reference of each tensor marked static. (A WeakSet would compare tensors with ``==``.)
_static_tensors: dict[int, weakref.ref] = {}

_LEAF = pytree.tree_flatten(torch.empty(0))[1]
_LEAF_SPECS = [(_LEAF,) * n for n in range(9)]


def mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as living at a fixed address: graphs read and write it in place.

    A marked tensor passed to a graphed callable is never copied into a static buffer; the graph
    is captured against its memory, and its address becomes part of the signature (another
    tensor in that position captures another graph). Use it for state that the caller keeps and
    updates between calls, such as a KV cache. Returns ``tensor`` so it can be used inline.
    """
    if not isinstance(tensor, torch.Tensor):
        from ._errors import CudagraphifyUsageError

        raise CudagraphifyUsageError(
            f"mark_static expects a torch.Tensor, got {type(tensor).__name__}"
        )
    key = id(tensor)
    _static_tensors[key] = weakref.ref(tensor, lambda _ref: _static_tensors.pop(key, None))
    return tensor


def is_marked_static(tensor: torch.Tensor) -> bool:
    ref = _static_tensors.get(id(tensor))
    return ref is not None and ref() is tensor


def is_constant(value: Any) -> bool:
    """True for immutable values that may be keyed on by value and returned as they are."""
    if isinstance(value, _CONSTANT_TYPES):
        # (a subclass whose instances carry attributes, ``class Mode(str)`` with
        # ``mode.center``: what a forward reads of it may change in place, behind a key by
        # value; an Enum member is one however its class is made, where its value and its
        # own attributes are: see _constant_member)
        if isinstance(value, enum.Enum):
            return _constant_member(value)
        return type(value) in _EXACT_CONSTANT_TYPES or not _carries_attributes(value)
    if isinstance(value, torch.Tensor):  # hashed by identity but mutable: never a constant
        return False
    if isinstance(value, (tuple, frozenset)):  # (a NamedTuple too; not one with attributes)
        return all(is_constant(v) for v in value) and (
            type(value) in (tuple, frozenset) or not _carries_attributes(value))
    tp = type(value)
    if tp is slice:  # (immutable, and not subclassable: its start, stop and step decide)
        return is_constant(value.start) and is_constant(value.stop) and is_constant(value.step)
    if _immutable_type(tp):
        return True
    # A frozen dataclass whose attributes hold constants. Not a class that only defines
    # __eq__ and __hash__: it may be changed in place (``unsafe_hash=True``; a frozen
    # dataclass holding a list; a plain subclass of one, which takes new attributes), behind
    # the key's back (its attributes are watched; as an argument it is opaque).
    fields = _frozen_fields(value)
    return fields is not None and all(is_constant(v) for v in fields)


MEMBER_ATTRS = frozenset({"_value_", "_name_", "__objclass__", "_sort_order_"})


_visiting = threading.local()  # the enum members whose key or constancy is being found


def _visited(member: enum.Enum) -> bool:
    """Whether ``member`` is on the way already (members naming each other, through their
    attributes or the containers in them): then taken by identity, no further walk."""
    on = getattr(_visiting, "ids", None)
    if on is None:
        on = _visiting.ids = set()
    return id(member) in on


@contextlib.contextmanager
def _visiting_member(member: enum.Enum):
    _visiting.ids.add(id(member))
    try:
        yield
    finally:
        _visiting.ids.discard(id(member))


def _constant_member(member: enum.Enum) -> bool:
    """Whether an enum member is a constant: its value one (not a dict, which may change in
    place), or code (a class, a function) or a bare ``object()`` sentinel, and its own
    attributes beyond the enum's (``HTTPStatus.OK.phrase``) constants, code or members that
    are (keyed with it: see :func:`strict_key`; a member met again on the way, by identity)."""
    d = object_dict(member)
    if d and not d.keys() <= MEMBER_ATTRS and not _flat(d):
        if _visited(member):
            return True  # (decided where the walk met it first)
        with _visiting_member(member):
            if not all(k in MEMBER_ATTRS or _code(v) or is_constant(v) for k, v in d.items()):
                return False
    v = member._value_ if d else member.value
    return v is member or type(v) is object or _code(v) or is_constant(v)


def _flat(d: dict) -> bool:
    """Whether a member's own attributes (its ``__dict__``, ``d``) are all plain values,
    floats or code, each keyed alone: no walk, no member met again."""
    for k, v in d.items():
        if k not in MEMBER_ATTRS and type(v) not in PLAIN_TYPES and type(v) is not float \
                and not _code(v):
            return False
    return True


def _code(v: Any) -> bool:
    """A class or a function: a constant by identity."""
    return isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType))


def _member_key(member: enum.Enum) -> tuple:
    """An enum member's key: the member, with its own attributes beyond the enum's (one may
    be set anew), a member among them by its own key (one met again on the way: by
    identity)."""
    d = object_dict(member)
    if not d or d.keys() <= MEMBER_ATTRS or _visited(member):
        return (type(member), member)
    # (a flat one has nothing to walk and no member to meet again: HTTPStatus.OK.phrase)
    with contextlib.nullcontext() if _flat(d) else _visiting_member(member):
        return (type(member), member, tuple(sorted(
            (k, (type(v), v) if _code(v) else strict_key(v))
            for k, v in d.items() if k not in MEMBER_ATTRS)))


def _frozen_fields(value: Any) -> list | None:
    """The attribute values of a frozen dataclass instance (its class itself a frozen
    dataclass), or None: also where it holds attributes beyond its fields (set in
    ``__post_init__`` through ``object.__setattr__``)."""
    if not _frozen_dataclass(type(value)):
        return None
    names = [f.name for f in dataclasses.fields(value)]
    d = object_dict(value)
    if d and not set(d) <= set(names):
        return None
    try:
        return [getattr(value, n) for n in names]
    except AttributeError:  # (a field never set)
        return None


def _frozen_dataclass(tp: type) -> bool:
    """Whether ``tp`` itself is declared a frozen dataclass comparing by value (``eq=False``
    compares by identity: two equal instances are told apart by ``is``, a dict's key)."""
    params = tp.__dict__.get("__dataclass_params__") if isinstance(tp, type) else None
    return params is not None and getattr(params, "frozen", False) is True \
        and getattr(params, "eq", False) is True


# other types whose instances are immutable values (numpy's scalars and dtypes, below): by
# value, as the constant types are
_IMMUTABLE = (decimal.Decimal, fractions.Fraction, datetime.date, datetime.time,
              datetime.timedelta, datetime.timezone, uuid.UUID, pathlib.PurePath)


def _immutable_type(tp: type) -> bool:
    if issubclass(tp, _IMMUTABLE):
        return True
    np = sys.modules.get("numpy")
    # (its scalars but np.void, which may view an array's row, and the long doubles, whose
    # bytes hold padding that is not the value)
    return np is not None and issubclass(tp, (np.number, np.bool_, np.str_, np.bytes_,
                                              np.datetime64, np.timedelta64, np.dtype)) \
        and not (issubclass(tp, (np.longdouble, np.clongdouble))
                 and tp not in (np.float64, np.complex128))


# the constant types whose ``==`` within one type is what an op sees (not floats: ``0.0 ==
# -0.0``; nor what holds values of several types: ``(2,) == (2.0,)``)
PLAIN_TYPES = frozenset({int, bool, str, bytes, type(None), type(Ellipsis), type(NotImplemented),
                    torch.dtype, torch.device, torch.layout, torch.memory_format})


def strict_key(value: Any) -> Any:
    """A constant as a key that tells apart what ``==`` does not and an op may: ``0.0`` and
    ``-0.0`` (by their bits, a float subclass's and numpy's too; the same NaN equals itself),
    ``2``, ``2.0`` and ``True`` inside a tuple, a frozenset or a frozen dataclass (by their
    types), ranges by their start, stop and step, slices by those items' keys."""
    tp = type(value)
    if tp in PLAIN_TYPES:
        return (tp, value)
    if tp is float:  # (every float argument, every call: before the enum's look)
        return (tp, float_bits(value))
    if isinstance(value, enum.Enum):  # (a float-valued one too: its attributes)
        return _member_key(value)
    if isinstance(value, float):
        return (tp, float_bits(value))
    if isinstance(value, complex):
        return (tp, float_bits(value.real), float_bits(value.imag))
    if isinstance(value, (tuple, frozenset)):
        if tp not in (tuple, frozenset) and object_dict(value):
            return (tp, object())  # (attributes set on it since: no constant, equal to none)
        keys = map(strict_key, value)
        return (tp, frozenset(keys) if isinstance(value, frozenset) else tuple(keys))
    if tp is range:
        return (tp, value.start, value.stop, value.step)
    if tp is slice:  # (``slice(0, 2)`` and ``slice(0.0, 2)`` index alike, or one raises)
        return (tp, strict_key(value.start), strict_key(value.stop), strict_key(value.step))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic) and _immutable_type(tp):
        return (tp, value.dtype.str, value.tobytes())  # (the dtype: a datetime's unit)
    if issubclass(tp, _IMMUTABLE):  # (``Decimal('-0') == Decimal('0')``, an instant in two
        return (tp, repr(value))  # time zones, a time's fold: by what its repr shows)
    if _frozen_dataclass(tp):
        fields = _frozen_fields(value)
        if fields is None:
            return (tp, object())  # (attributes beyond its fields, set since)
        return (tp, tuple(map(strict_key, fields)))
    return (tp, value)


class Unkeyable(NamedTuple):
    """A call that cannot be keyed; ``reason`` says why (the call then runs eagerly)."""

    reason: str


class CallState(NamedTuple):
    """The thread's autograd and autocast state of a call (part of every key)."""

    grad: bool
    inference: bool
    autocast_cuda: Any  # the autocast dtype, or False
    autocast_cpu: Any


class Constant(NamedTuple):
    """A non-tensor leaf of the arguments: its index, its kind (its type, ``STATIC_OBJECT``
    for an object named in ``static_argnames``, ``STATIC_STATE`` for recognised static state)
    and its value (the object's id for a static object, :func:`~._state.state_key` for
    static state)."""

    index: int
    kind: Any
    value: Any


STATIC_OBJECT = "static-object"
STATIC_STATE = "static-state"


class Signature(NamedTuple):
    """The parts of a call's signature, before a cache policy turns it into a key.

    ``tensors`` and ``state`` are always part of the key (a graph must never see memory of another
    layout); a :class:`~cudagraphify.CachePolicy` decides what to make of ``spec`` and
    ``constants``.
    """

    spec: Hashable
    tensors: tuple
    constants: tuple  # of Constant
    state: CallState

    @property
    def static_objects(self) -> list[int]:
        """Leaf indices of the objects named in ``static_argnames`` (passed as they are)."""
        return [c.index for c in self.constants if c.kind == STATIC_OBJECT]

    @property
    def static_states(self) -> list[int]:
        """Leaf indices of recognised static state (an HF StaticCache; passed as it is)."""
        return [c.index for c in self.constants if c.kind == STATIC_STATE]


def storage_of(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for an empty one, or where it has none)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return 0  # (ValueError: a lazy module's uninitialized parameter)


def leaf_kind(t: torch.Tensor) -> tuple | None:
    """What a tensor leaf is besides its layout, part of the key (the item after the neg bit):
    None for a plain ``Tensor`` without Python attributes (nearly every call), else its class
    and whether it carries attributes. A graph's static copy is a plain tensor with none, so a
    forward's ``isinstance(x, nn.Parameter)`` or ``vars(x)`` of a copy would not answer as the
    argument does; a call whose argument differs there is another key, whose first call's
    probe sees those reads (an argument that carries attributes: :mod:`._probe`'s
    ``attributed``; a class the copy does not have: the capture takes the other path)."""
    if type(t) is _Tensor and not t.__dict__:
        return None
    return (type(t), bool(t.__dict__))


def tensor_meta(t: torch.Tensor, static: bool) -> tuple:
    """A tensor leaf's part of the key; the conj and neg bits too (a parameter passed as an
    argument is read in place: a conj or neg view of its memory reads it otherwise), its
    :func:`leaf_kind`; one read in place by request (``static``) by its address as well (the
    last item)."""
    if static:
        return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_conj(),
                t.is_neg(), leaf_kind(t), t.data_ptr())
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_conj(), t.is_neg(),
            leaf_kind(t))


def call_state() -> CallState:
    """Grad mode, inference mode and autocast of the calling thread."""
    return CallState(
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
    )


_opaque_types: dict[type, bool] = {}


def is_opaque(tp: type) -> bool:
    hit = _opaque_types.get(tp)
    if hit is None:
        hit = not (issubclass(tp, torch.Tensor) or tp in pytree.SUPPORTED_NODES
                   or issubclass(tp, _CONSTANT_TYPES) or tp in (list, dict, slice)
                   or issubclass(tp, (tuple, frozenset)))  # (a NamedTuple: pytree's)
        if hit:  # a frozen dataclass or a numpy scalar may be a constant (see is_constant)
            hit = not (_frozen_dataclass(tp) or _immutable_type(tp))
        _opaque_types[tp] = hit
    return hit


def opaque_argument(args: tuple, kwargs: dict, static_positions: frozenset[int],
                    static_names: frozenset[str]) -> str | None:
    """Why the call cannot be keyed, judged from its top-level arguments alone (no flattening):
    an argument of a type that is neither a tensor, an immutable value nor a container pytree
    knows, not named in ``static_argnames`` and not recognised static state
    (:func:`is_static_state`). None when the top level looks keyable."""
    for i, a in enumerate(args):
        if is_opaque(type(a)) and i not in static_positions and not is_static_state(a):
            return _opaque_reason(f"argument {i}", a)
    for name, a in kwargs.items():
        if is_opaque(type(a)) and name not in static_names and not is_static_state(a):
            return _opaque_reason(f"argument {name!r}", a)
    return None


def opaque_objects(args: tuple, kwargs: dict, static_positions: frozenset[int],
                   static_names: frozenset[str]) -> list:
    """The top-level arguments :func:`opaque_argument` judges opaque (the objects)."""
    return [a for i, a in enumerate(args) if is_opaque(type(a)) and i not in static_positions
            and not is_static_state(a)] + \
        [a for name, a in kwargs.items() if is_opaque(type(a)) and name not in static_names
         and not is_static_state(a)]


def _opaque_reason(where: str, value: Any) -> str:
    why = demoted(value)
    if why is not None:
        return (f"{where} ({type(value).__name__}) {why}: passed as it is, like a DynamicCache; "
                "what runs around it can still be graphed")
    return not_keyable(where, value)


def not_keyable(where: str, value: Any) -> str:
    """Why an argument ``value`` (neither a tensor, a constant nor a container) is not keyed."""
    tp = type(value)
    hashed = "" if getattr(tp, "__hash__", None) in (None, object.__hash__) \
        or tp.__eq__ is object.__eq__ else (
            " (its class compares and hashes by value, but an instance can change in place: "
            "a frozen dataclass of immutable values is keyed by its value)")
    return (f"{where} of type {tp.__name__} is not a tensor or an immutable value{hashed}; "
            "name its argument in static_argnames=... if its tensors stay in place, or "
            "register its type with torch.utils._pytree")


_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                             lambda t: False)


def _unsupported_tensor(t: torch.Tensor) -> str | None:
    if type(t) is not _Tensor and type(t) is not _Parameter:
        return f"tensor subclass {type(t).__name__} is not supported"
    if _functorch_wrapped(t):
        return "a tensor of a torch.func transform (vmap, grad, jvp) is not supported"
    if t.layout is not torch.strided:
        return f"{t.layout} tensors are not supported (only strided)"
    if t.is_nested:
        return "nested tensors are not supported"
    return None


def build_signature(
    args: tuple,
    kwargs: dict,
    static_positions: frozenset[int],
    static_names: frozenset[str],
) -> tuple[Signature | Unkeyable, list, list[bool]]:
    """Flatten a call and describe it.

    Returns ``(signature, leaves, static_flags)``: the flat leaves of ``(args, kwargs)`` in the
    order the capture layer uses them, and per leaf whether it is read in place (marked static
    or named in ``static_argnames``) rather than copied.
    """
    state = call_state()
    # Fast path: positional tensors only, no statics: no pytree work at all.
    if not kwargs and not static_positions and not _static_tensors:
        if all(type(a) is _Tensor and a.layout is _strided and not a.is_nested
               and not _functorch_wrapped(a) and not a.__dict__ for a in args):
            metas = tuple([(a.shape, a.stride(), a.dtype, a.device, a.requires_grad,
                            a.is_conj(), a.is_neg(), None) for a in args])
            # the same spec the general path builds, so a call keys alike on either path
            spec = (_LEAF_SPECS[len(args)] if len(args) < len(_LEAF_SPECS)
                    else (_LEAF,) * len(args), ())
            return Signature(_with_repeats(spec, args), metas, (), state), list(args), \
                [False] * len(args)

    leaves: list = []
    static_flags: list[bool] = []
    specs: list = []
    for i, arg in enumerate(args):
        flat, spec = pytree.tree_flatten(arg)
        leaves.extend(flat)
        static_flags.extend([i in static_positions] * len(flat))
        specs.append(spec)
    names = tuple(kwargs)
    for name in names:
        flat, spec = pytree.tree_flatten(kwargs[name])
        leaves.extend(flat)
        static_flags.extend([name in static_names] * len(flat))
        specs.append(spec)

    metas = []
    constants = []
    for idx, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            bad = _unsupported_tensor(leaf)
            if bad:
                return Unkeyable(f"argument leaf {idx}: {bad}"), leaves, static_flags
            static = static_flags[idx] or is_marked_static(leaf)
            static_flags[idx] = static
            metas.append(tensor_meta(leaf, static))
        elif static_flags[idx]:
            # Declared static by name: the caller promises the object keeps its tensors in
            # place (what it holds is guarded per graph), so it is keyed by identity.
            constants.append(Constant(idx, STATIC_OBJECT, id(leaf)))
        elif is_static_state(leaf):
            # Recognised static state (an HF StaticCache): keyed by what it holds, the
            # addresses of its tensors included (see _state); read and written in place.
            try:
                key = state_key(leaf)
            except StateUnkeyable as e:
                return (Unkeyable(f"argument leaf {idx} ({type(leaf).__name__}) {e}"), leaves,
                        static_flags)
            static_flags[idx] = True
            constants.append(Constant(idx, STATIC_STATE, key))
        elif type(leaf) is float:
            constants.append(Constant(idx, float, float_bits(leaf)))  # -0.0 and 0.0 differ
        elif is_constant(leaf):
            # (by value; what ``==`` mixes up, ``Cfg(2)`` and ``Cfg(2.0)``, by strict_key)
            constants.append(Constant(idx, type(leaf),
                                      leaf if type(leaf) in PLAIN_TYPES else strict_key(leaf)))
        else:
            return (
                Unkeyable(not_keyable(f"argument leaf {idx}", leaf)),
                leaves,
                static_flags,
            )
    spec = _with_repeats((tuple(specs), names), leaves) if len(metas) > 1 \
        else (tuple(specs), names)
    try:
        sig = Signature(spec, tuple(metas), tuple(constants), state)
        hash(sig)
    except TypeError as e:
        return Unkeyable(f"an argument is not hashable: {e}"), leaves, static_flags
    return sig, leaves, static_flags


def repeated(leaves) -> tuple:
    """Which tensor leaves are the same object as an earlier one: ``(index, the earlier
    one's)`` pairs, () where none is. Part of the key (a third item of ``Signature.spec``):
    each leaf has a static copy of its own, so a forward's ``x is y`` (or a torch function's:
    ``nn.MultiheadAttention``'s self-attention path) sees copies that are not, and a graph
    captured from distinct arguments must not replay a call that passes one twice."""
    first: dict[int, int] = {}
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            j = first.setdefault(id(leaf), i)
            if j != i:
                out.append((i, j))
    return tuple(out)


def _with_repeats(spec: tuple, leaves) -> tuple:
    """``spec`` with :func:`repeated` as a third item where a tensor leaf repeats."""
    repeats = repeated(leaves) if len(leaves) > 1 else ()
    return (*spec, repeats) if repeats else spec


def unflatten_call(leaves: list, sig: Signature) -> tuple[tuple, dict]:
    """Rebuild ``(args, kwargs)`` from leaves, with the structure recorded in ``sig``."""
    specs, names = sig.spec[:2]
    out = []
    start = 0
    for spec in specs:
        n = spec.num_leaves
        out.append(pytree.tree_unflatten(leaves[start:start + n], spec))
        start += n
    nargs = len(specs) - len(names)
    return tuple(out[:nargs]), dict(zip(names, out[nargs:]))
