"""What a tensor leaf is besides its layout is part of the key (``_signature.leaf_kind``): its
class (an ``nn.Parameter`` passed where plain tensors were) and whether it carries Python
attributes. A graph's static copy is a plain tensor without attributes, so a call whose
argument differs there must not replay a graph captured from one that does not (hunt 8c's S8,
hunt 8d's S2: their reads are tested there); these tests pin the key and the fast path.
CPU, on the simulated backend (``sim``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._signature import build_signature, leaf_kind, tensor_meta

NONE = frozenset()


def _sig(*args, **kwargs):
    return build_signature(args, kwargs, NONE, NONE)[0]


def _attributed(t: torch.Tensor, **attrs) -> torch.Tensor:
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


# ------------------------------------------------------------------ the key ---------------

def test_leaf_kind_values():
    t = torch.randn(2, 3)
    assert leaf_kind(t) is None
    assert leaf_kind(_attributed(torch.randn(2, 3), tag="a")) == (torch.Tensor, True)
    p = nn.Parameter(torch.randn(2, 3))
    assert leaf_kind(p) == (nn.Parameter, False)
    assert leaf_kind(_attributed(nn.Parameter(torch.randn(2, 3)), tag=1)) == (nn.Parameter, True)
    # (an attribute set then deleted leaves an empty __dict__: a plain tensor again)
    u = _attributed(torch.randn(2, 3), tag="a")
    del u.tag
    assert leaf_kind(u) is None


def test_both_paths_of_build_signature_key_a_plain_tensor_alike():
    # the positional-tensors path and the general one (a float argument makes the call take
    # it) give a plain tensor the same part of the key
    x = torch.randn(2, 3)
    fast = _sig(x).tensors[0]
    general = _sig(x, 1.5).tensors[0]
    assert fast == general == tensor_meta(x, False)
    assert len(fast) == 8 and fast[7] is None


@pytest.mark.parametrize("other", ["attributed", "parameter"])
def test_an_attributed_or_parameter_leaf_is_another_key(other):
    x = torch.randn(2, 3)
    y = _attributed(torch.randn(2, 3), scale=2.0) if other == "attributed" \
        else nn.Parameter(torch.randn(2, 3), requires_grad=False)
    assert _sig(x) != _sig(y)
    assert _sig(x, 1.5) != _sig(y, 1.5)
    assert _sig(x=x) != _sig(x=y)  # (by keyword)
    assert _sig([x]) != _sig([y])  # (nested)
    # and two of a kind key alike (attribute names and values are not in the key)
    z = _attributed(torch.randn(2, 3), other=1) if other == "attributed" \
        else nn.Parameter(torch.randn(2, 3), requires_grad=False)
    assert _sig(y) == _sig(z)


def test_a_static_leaf_keeps_its_address_last():
    x = cg.mark_static(torch.randn(2, 3))
    meta = _sig(x).tensors[0]
    assert len(meta) == 9 and meta[7] is None and meta[8] == x.data_ptr()


# ------------------------------------------------------------------ calls -----------------

class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w + 1.0


@pytest.mark.parametrize("other", ["attributed", "parameter"])
def test_the_fast_path_hands_another_kind_to_the_slow_path(sim, other):
    # plain calls make the fast path; a call whose argument is of another kind (same layout)
    # is not replayed from the plain graph: it is a first call of its own key, then replays,
    # and a plain call after it replays the plain graph again
    torch.manual_seed(0)
    ref = Scale()
    g = cg.graphify(Scale())
    g.load_state_dict(ref.state_dict())

    def make(kind):
        t = torch.randn(4, 3)
        if kind == "attributed":
            return _attributed(t, scale=2.0)
        if kind == "parameter":
            return nn.Parameter(t, requires_grad=False)
        return t

    with torch.no_grad():
        for _ in range(3):
            x = make("plain")
            assert torch.equal(g(x), ref(x))
        s = cg.stats(g)
        assert s.captures == 1 and s.replays == 2, s
        assert g._cudagraphify_state._fast is not None  # (the plain calls' fast path)
        for i in range(3):
            x = make(other)
            assert torch.equal(g(x), ref(x))
        s = cg.stats(g)
        assert s.captures == 2 and s.replays == 4, s  # (its own graph: captured, replayed)
        x = make("plain")
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).captures == 2 and cg.stats(g).replays == 5
