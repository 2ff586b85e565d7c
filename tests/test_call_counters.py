"""Outputs of one graph on one memory (``return y, y[0]``), handed out without a copy
(``copy_outputs=False``, a ``graph_region``): each call's share one version counter, as eager's
do, and no other call's (``_replay.of_this_call``): a tensor of its own on that memory (no view
of this call's first output, whose base would keep it alive), a view in eager's dtype only where
it has another dtype or a conj/neg bit.

CPU, simulated backend (fixture ``sim``); each call compared with an eager twin, bitwise, and
with eager's ``_version`` / ``_is_view`` / autograd behaviour."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg


class _Two(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "view":
            return y, y[1]
        if self.how == "view_first":
            return y[1], y
        if self.how == "detached":
            return y, y.detach()
        if self.how == "two_views":
            return y, y[0], y.t()
        raise AssertionError(self.how)


def _modes():
    return {"zero copy": (dict(copy_outputs=False), contextlib.nullcontext),
            "region": ({}, cg.graph_region)}


@pytest.mark.parametrize("mode", ["zero copy", "region"])
@pytest.mark.parametrize("how", ["view", "view_first", "detached", "two_views"])
def test_one_calls_outputs_share_a_counter_and_no_other_calls_do(sim, how, mode):
    """Each call: the values, which outputs are views, and a write to its last output moving
    the versions of that call's outputs as eager's. Without a copy (not in a region, where
    earlier outputs held keep their views from the replay): the earlier calls' outputs held,
    a write to the last call's output moves none of theirs (their values are the later
    replays', as documented for ``copy_outputs=False``: only their counters are compared)."""
    kw, scope = _modes()[mode]
    torch.manual_seed(0)
    ref = _Two(how).eval()
    g = cg.graphify(copy.deepcopy(ref), **kw)
    held = []
    with torch.no_grad(), scope():
        for _ in range(5):
            x = torch.randn(3, 4)
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            # (a tensor of its own where eager's is a view: more permissive, never the reverse)
            assert not any(a._is_view() and not b._is_view() for a, b in zip(og, ow))
            og[-1].add_(1)
            ow[-1].add_(1)
            assert [t._version for t in og] == [t._version for t in ow]
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            if mode == "zero copy":
                held.append((og, ow))
            del og, ow
        for og, ow in held[:-1]:
            assert [t._version for t in og] == [t._version for t in ow]
    assert cg.stats(g).replays >= 3, cg.stats(g)


@pytest.mark.parametrize("mode", ["zero copy", "region"])
def test_a_write_to_the_base_of_a_saved_output_is_caught_by_autograd(sim, mode):
    """Eager: ``a`` saved for backward, then its base ``y`` written: backward refuses. The
    replay's ``a`` must share ``y``'s counter for autograd to see it (a silent wrong gradient
    else); and an earlier call's saved output must not see a later call's write."""
    kw, scope = _modes()[mode]
    torch.manual_seed(0)
    ref = _Two("view").eval()
    g = cg.graphify(copy.deepcopy(ref), **kw)
    w = torch.ones(4, requires_grad=True)
    with scope():
        for m in (g, ref):
            with torch.no_grad():
                for _ in range(3):
                    m(torch.randn(3, 4))
                y0, a0 = m(torch.randn(3, 4))
                y1, a1 = m(torch.randn(3, 4))
            loss0 = (a0 * w).sum()  # (saves a0)
            loss1 = (a1 * w).sum()  # (saves a1)
            with torch.no_grad():
                y1.add_(1)  # the later call's base: a1's memory, not a0's
            loss0.backward()
            assert torch.equal(w.grad, a0)
            w.grad = None
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss1.backward()
    assert cg.stats(g).replays >= 3
