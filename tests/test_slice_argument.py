"""A ``slice`` argument (``x[:, cols]`` with ``cols=slice(0, 2)``) is an immutable value: keyed
by its start, stop and step (each by its type and value), so graphify and bucketed key on it
instead of running eagerly. One holding a tensor or a mutable object is no constant. On the
CPU double, every output compared with an eager twin, bitwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._signature import is_constant, strict_key


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Cols(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.keep = slice(0, 2)  # (an attribute the forward reads)

    def forward(self, x, cols):
        return self.lin(x)[:, cols] * 2 + self.lin(x)[:, self.keep].sum()


def _pair():
    torch.manual_seed(0)
    ref = _Cols()
    return ref, cg.graphify(copy.deepcopy(ref))


def test_a_slice_of_constants_is_a_constant_keyed_by_its_items():
    assert is_constant(slice(0, 2)) and is_constant(slice(None)) and is_constant(slice(1, 9, 2))
    assert not is_constant(slice(torch.tensor(0), 2)) and not is_constant(slice([0], 2))
    assert strict_key(slice(0, 2)) == strict_key(slice(0, 2))
    # (what == mixes up, an op does not: slice(0.0, 2) raises where slice(0, 2) indexes)
    assert slice(0.0, 2) == slice(0, 2) and strict_key(slice(0.0, 2)) != strict_key(slice(0, 2))
    assert strict_key(slice(0, 2)) != strict_key(slice(0, 2, 1))
    hash(strict_key(slice(0, 2)))


def test_slice_arguments_replay_their_own_graphs(sim):
    ref, g = _pair()
    cols = [slice(0, 2), slice(0, 2), slice(1, 4), slice(0, 2), slice(1, 4), slice(None, None, 2)]
    with torch.no_grad():
        for _ in range(2):
            for c in cols:
                x = torch.randn(3, 4)
                assert torch.equal(g(x, c), ref(x, c))
                assert torch.equal(g(x, cols=c), ref(x, cols=c))
    s = cg.stats(g)
    # (positional and keyword calls are keys of their own: 3 slices each)
    assert s.captures == 6 and s.replays == 2 * 2 * len(cols) - 6 and not s.eager_calls, s


def test_a_slice_that_raises_in_eager_raises_here(sim):
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(3, 4), slice(0, 2))
        with pytest.raises(TypeError):
            ref(torch.randn(3, 4), slice(0.0, 2))
        with pytest.raises(TypeError):
            g(torch.randn(3, 4), slice(0.0, 2))  # (another key: no graph of slice(0, 2))


def test_a_slice_holding_a_tensor_runs_eagerly_with_the_reason(sim):
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(3):
            x, c = torch.randn(3, 4), slice(torch.tensor(0), torch.tensor(2))
            assert torch.equal(g(x, c), ref(x, c))
    s = cg.stats(g)
    assert s.captures == 0 and any("slice" in r for r in s.eager_calls), s.eager_calls


def test_a_slice_attribute_changed_after_capture_is_seen(sim):
    ref, g = _pair()
    with torch.no_grad():
        for step in range(8):
            if step == 4:
                for m in (ref, g):
                    m.keep = slice(2, 4)
            x = torch.randn(3, 4)
            assert torch.equal(g(x, slice(0, 2)), ref(x, slice(0, 2))), step
    assert cg.stats(g).captures == 2
