"""Property tests of signatures: two calls share a key iff every guarded field agrees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphify import CachePolicy
from cudagraphify._signature import Unkeyable, build_signature

NONE = frozenset()
DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    t = torch.zeros(shape, dtype=dtype)
    if len(shape) > 1 and draw(st.booleans()):
        t = t.transpose(0, 1)  # another stride
    if dtype.is_floating_point and draw(st.booleans()):
        t = t.detach().requires_grad_()
    return t


def describe(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


leaves = st.one_of(tensors(), st.integers(-2, 2), st.booleans(), st.sampled_from(["a", "b"]),
                   st.none())
calls = st.lists(leaves, min_size=1, max_size=3)


def key(args, grad):
    with torch.set_grad_enabled(grad):
        sig, _, _ = build_signature(tuple(args), {}, NONE, NONE)
    assert not isinstance(sig, Unkeyable)
    return CachePolicy().full_key(sig)


def model(args, grad):
    """What must match for two calls to share a graph."""
    return (grad, tuple(("T", describe(a)) if isinstance(a, torch.Tensor) else (type(a), a)
                        for a in args))


@settings(max_examples=300, deadline=None)
@given(calls, calls, st.booleans(), st.booleans())
def test_same_key_iff_same_guarded_fields(a, b, grad_a, grad_b):
    assert (key(a, grad_a) == key(b, grad_b)) == (model(a, grad_a) == model(b, grad_b))


@settings(max_examples=100, deadline=None)
@given(calls)
def test_new_values_same_layout_share_a_key(a):
    fresh = [torch.ones_like(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
             and x.is_contiguous() else x for x in a]
    stride_kept = all(not isinstance(x, torch.Tensor) or x.is_contiguous() for x in a)
    if stride_kept:
        assert key(a, False) == key(fresh, False)
