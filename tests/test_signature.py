"""Signatures: every field that changes what a graph computes changes the key, nothing else does."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch

from cudagraphify import CachePolicy, mark_static
from cudagraphify._signature import Unkeyable, build_signature, is_constant, unflatten_call

NONE = frozenset()


def key(*args, static_pos=NONE, static_names=NONE, **kwargs):
    sig, _, _ = build_signature(args, kwargs, static_pos, static_names)
    return sig if isinstance(sig, Unkeyable) else CachePolicy().full_key(sig)


def test_same_metadata_same_key_new_values_irrelevant():
    assert key(torch.zeros(2, 3)) == key(torch.ones(2, 3))


@pytest.mark.parametrize("other", [
    torch.zeros(2, 4),                       # shape
    torch.zeros(2, 3, dtype=torch.float64),  # dtype
    torch.zeros(3, 2).t(),                   # stride
    torch.zeros(2, 3).requires_grad_(),      # requires_grad
    torch.zeros(2, 3, device="meta"),        # device
])
def test_each_tensor_field_changes_the_key(other):
    assert key(torch.zeros(2, 3)) != key(other)


def test_grad_inference_and_autocast_state_change_the_key():
    # (module flags such as ``training`` are guarded per graph, where the forward reads them:
    # see test_guards.py)
    x = torch.zeros(2)
    base = key(x)
    with torch.no_grad():
        assert key(x) != base
    with torch.inference_mode():
        assert key(x) != base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(x) != base


def test_constants_by_type_and_value():
    x = torch.zeros(1)
    assert key(x, 1) == key(x, 1)
    assert key(x, 1) != key(x, 2)
    assert key(x, 1) != key(x, True)
    assert key(x, 1) != key(x, 1.0)
    assert key(x, scale=2.0) != key(x, scale=3.0)
    assert key(x, scale=2.0) != key(x, factor=2.0)


def test_structure_changes_the_key():
    a, b = torch.zeros(1), torch.zeros(1)
    assert key((a, b)) != key([a, b])
    assert key({"p": a}) != key({"q": a})
    assert key(a, b) != key((a, b))


def test_unhashable_or_opaque_arguments_are_unkeyable_with_a_reason():
    class Opaque:
        pass

    r = key(torch.zeros(1), Opaque())
    assert isinstance(r, Unkeyable) and "Opaque" in r.reason and "static_argnames" in r.reason


def test_sparse_tensor_is_unkeyable():
    r = key(torch.zeros(2, 2).to_sparse())
    assert isinstance(r, Unkeyable) and "sparse" in r.reason


def test_value_types_count_as_constants():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        n: int

    class Color(enum.Enum):
        RED = 1

    assert all(is_constant(v) for v in (1, "s", None, torch.float16, Cfg(2), Color.RED, (1, "a")))
    assert not is_constant([1]) and not is_constant(object()) and not is_constant({"a": 1})
    assert key(torch.zeros(1), Cfg(1)) != key(torch.zeros(1), Cfg(2))


def test_marked_static_tensors_are_keyed_by_address():
    a = mark_static(torch.zeros(4))
    b = mark_static(torch.zeros(4))
    assert key(a) == key(a)
    assert key(a) != key(b)
    sig, leaves, flags = build_signature((a, torch.zeros(4)), {}, NONE, NONE)
    assert flags == [True, False]


def test_static_argnames_flag_their_leaves():
    c = torch.zeros(3)
    sig, leaves, flags = build_signature((torch.zeros(1), (c, c)), {"k": c},
                                         frozenset({1}), frozenset({"k"}))
    assert flags == [False, True, True, True]


def test_a_static_object_is_keyed_by_identity():
    class Cache:
        pass

    c1, c2 = Cache(), Cache()
    k1 = key(torch.zeros(1), c1, static_pos=frozenset({1}))
    assert k1 == key(torch.zeros(1), c1, static_pos=frozenset({1}))
    assert k1 != key(torch.zeros(1), c2, static_pos=frozenset({1}))


def test_fast_and_general_paths_key_a_call_alike():
    x = torch.zeros(2)
    fast = key(x, x)
    keep = mark_static(torch.zeros(1))  # any marked tensor alive forces the general path
    assert key(x, x) == fast
    del keep


def test_unflatten_rebuilds_the_call():
    a, b = torch.zeros(1), torch.ones(1)
    args, kwargs = (a, [b, 3]), {"z": {"q": a}}
    sig, leaves, _ = build_signature(args, kwargs, NONE, NONE)
    args2, kwargs2 = unflatten_call(leaves, sig)
    assert args2[0] is a and args2[1][0] is b and args2[1][1] == 3 and kwargs2["z"]["q"] is a
    fast, leaves, _ = build_signature((a, b), {}, NONE, NONE)
    assert unflatten_call(leaves, fast) == ((a, b), {})


def test_policy_can_merge_constants():
    class IgnoreStep(CachePolicy):
        def key(self, signature):
            return signature.spec  # constants ignored

    s1, _, _ = build_signature((torch.zeros(1), 1), {}, NONE, NONE)
    s2, _, _ = build_signature((torch.zeros(1), 2), {}, NONE, NONE)
    s3, _, _ = build_signature((torch.zeros(2), 2), {}, NONE, NONE)
    p = IgnoreStep()
    assert p.full_key(s1) == p.full_key(s2)
    assert p.full_key(s1) != p.full_key(s3)  # tensor layout is always in the key


def test_only_frozen_dataclasses_of_constants_are_user_constants():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        n: object

    @dataclasses.dataclass(unsafe_hash=True)
    class Hashed:  # (compares and hashes by value, yet changes in place)
        n: int

    class ByValue:
        def __init__(self, n):
            self.n = n

        def __eq__(self, other):
            return isinstance(other, ByValue) and other.n == self.n

        def __hash__(self):
            return hash(self.n)

    assert is_constant(Frozen(1)) and is_constant(Frozen((1, "a"))) and is_constant(Frozen(Frozen(2.0)))
    assert not is_constant(Frozen([1])) and not is_constant(Frozen(torch.zeros(1)))
    assert not is_constant(Hashed(1)) and not is_constant(ByValue(1))
    for v in (Hashed(1), ByValue(1), Frozen([1])):
        r = key(torch.zeros(1), v)
        assert isinstance(r, Unkeyable) and type(v).__name__ in r.reason
    assert "frozen dataclass" in key(torch.zeros(1), ByValue(1)).reason


def test_strict_key_tells_apart_what_equality_mixes_up():
    from cudagraphify._signature import strict_key
    from cudagraphify._watch import same

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        v: object

    import numpy as np

    nan = float("nan")
    pairs = [(0.0, -0.0), ((2,), (2.0,)), ((1,), (True,)), (Cfg(2), Cfg(2.0)), (Cfg(0.0), Cfg(-0.0)),
             (frozenset({1}), frozenset({1.0})), (complex(0.0, 1), complex(-0.0, 1)),
             (np.float64(0.0), np.float64(-0.0)), (np.float32(0.0), np.float32(-0.0)),
             (range(0, 1), range(0, 2, 5))]
    assert strict_key(nan) != strict_key(-nan)  # (the sign of a NaN shows: torch.signbit)
    for a, b in pairs:
        assert a == b and strict_key(a) != strict_key(b), (a, b)
        assert not same(a, b)
        assert strict_key(a) == strict_key(type(a)(a) if isinstance(a, (tuple, frozenset)) else a)
    assert same(nan, float("nan")) and same((nan, 1), (float("nan"), 1)) and same(Cfg(2), Cfg(2))
    assert key(torch.zeros(1), Cfg(2)) != key(torch.zeros(1), Cfg(2.0))
    assert key(torch.zeros(1), Cfg(2)) == key(torch.zeros(1), Cfg(2))


def test_immutable_library_values_are_constants_and_tuples_with_attributes_are_not():
    import collections
    import decimal
    import numpy as np

    NT = collections.namedtuple("NT", "a b")

    class Tagged(tuple):  # (its instances take attributes)
        pass

    t = Tagged((1, 2))
    t.note = [0]
    assert all(is_constant(v) for v in (np.int64(3), np.float32(0.5), np.bool_(True),
                                        np.dtype("float32"), NT(1, 2.0), decimal.Decimal(1),
                                        frozenset({1, 2}), range(3)))
    assert not is_constant(t) and not is_constant(np.array([1])) and not is_constant(NT([1], 2))
    for v in (np.int64(3), frozenset({1}), NT(torch.zeros(1), 0.5)):  # (keyed: graphed)
        assert not isinstance(key(torch.zeros(1), v), Unkeyable), v
