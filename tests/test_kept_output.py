"""A piecewise root that returns a piece's output and also keeps it (review 163, finding 2).

Eager's caller and the other holder (``self.last = h; return h``) share one tensor: a write
through either shows in the other, and a view returned is a view of what was kept. The chained
run copies the outputs on a piece's memory (``GraphRegion.owned_outputs``) and then moves the
aliases still held (``release_aliases``); where an alias it copied is held elsewhere too, the
caller gets that alias itself, moved (or a view of it), not a second copy.

CPU, simulated backend (fixture ``sim``); every result compared with an eager twin, bitwise,
also after later calls' replays."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg


class _Keeps(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        h = self.lin(x)
        how = self.how
        if how == "same":
            self.last = h  # (a Python side effect: the root is piecewise, PYTHON_STATE)
            return h
        if how == "tuple":
            self.last = h
            return h, h
        if how == "view":
            self.last = h
            return h[1:]
        if how == "list":
            self.kept = [h]
            return {"h": h, "n": 3}
        if how == "not_kept":  # (control: a copy, as before)
            self.calls = getattr(self, "calls", 0) + 1
            return h
        raise AssertionError(how)


def _kept(m, how):
    return m.kept[0] if how == "list" else m.last if how != "not_kept" else None


def _first(out):
    return out["h"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("how", ["same", "tuple", "view", "list", "not_kept"])
def test_an_output_also_kept_is_the_kept_tensor(sim, how):
    torch.manual_seed(0)
    ref = _Keeps(how)
    g = cg.graphify(copy.deepcopy(ref))
    results = []
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(3, 4)
            og, ow = g(x), ref(x)
            hg, hw = _first(og), _first(ow)
            assert torch.equal(hg, hw)
            kg, kw = _kept(g, how), _kept(ref, how)
            if how == "same" or how == "list":
                assert (kg is hg) == (kw is hw) == True  # noqa: E712
            if how == "tuple":
                assert og[0] is og[1] and og[0] is g.last
            if how == "view":
                assert hg._base is kg and hw._base is kw
            hg.add_(i + 1)  # (eager: the kept tensor sees the write)
            hw.add_(i + 1)
            if kg is not None:
                assert torch.equal(kg, kw)
            results.append((og, ow))
    for og, ow in results:  # (every result kept, compared after the later replays)
        assert torch.equal(_first(og), _first(ow))
    st = cg.stats(g.lin)
    assert st.replays >= 3
    moved = _chain(g).moved_outputs  # (one alias moved by each replay's call where it is kept)
    assert moved == (0 if how == "not_kept" else st.replays), (moved, st.replays)


def _chain(g):
    """The implicit region the root's pieces run in (see _pieces.PieceRuns._chain_run)."""
    from cudagraphify.api import _state_of
    return _state_of(g)._chain


class _KeepsTwo(nn.Module):
    """Two pieces' outputs, each kept and both returned: both come back as the kept tensors."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h, k = self.a(x), self.b(x)
        self.first, self.second = h, k
        return h, k


def test_two_kept_outputs_of_two_pieces_are_both_the_kept_tensors(sim):
    torch.manual_seed(0)
    ref = _KeepsTwo()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(3, 4)
            (hg, kg), (hw, kw) = g(x), ref(x)
            assert torch.equal(hg, hw) and torch.equal(kg, kw)
            assert hg is g.first and kg is g.second
            hg.add_(i)
            kg.add_(i)
            hw.add_(i)
            kw.add_(i)
            assert torch.equal(g.first, ref.first) and torch.equal(g.second, ref.second)
    assert cg.stats(g.a).replays >= 3 and cg.stats(g.b).replays >= 3
