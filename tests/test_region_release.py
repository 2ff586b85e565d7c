"""A region graph released (invalidated, evicted, a piece given back) while the caller still
holds an alias of its output: the memory is the caller's from then on, but graphs captured
before it in the pool may still write there (their freed temporaries may lie under it), so the
alias is moved to a copy at the release, or, where a view of it is held, stays protected."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg

from test_review_pools import psim  # noqa: F401 (a fixture)


@pytest.fixture
def ksim(psim):  # noqa: F811
    # (the pool double: a replay scribbles over the memory of graphs captured after it,
    # released ones too, where someone holds it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield psim


@pytest.mark.parametrize("held", ["alias", "view"])
def test_an_output_held_past_its_graphs_release_is_not_overwritten(ksim, held):
    torch.manual_seed(0)
    a, b = cg.graphify(nn.Linear(4, 4)), cg.graphify(nn.Linear(4, 4))
    with torch.no_grad(), cg.graph_region() as region:
        for _ in range(2):  # a captured first, then b (reading a's output in place)
            x = torch.randn(2, 4)
            out = b(a(x))
        want = out.clone()
        kept = out if held == "alias" else out[1:]
        want = want if held == "alias" else want[1:]
        del out
        b.weight = nn.Parameter(b.weight.detach() * 2)
        b(torch.randn(2, 4))  # b's graph goes (invalidated); b captures anew
        for _ in range(2):
            a(torch.randn(2, 4))  # a replays: it was captured before b's first graph
            assert torch.equal(kept, want)
        if held == "alias":
            assert region.stats().moved_outputs >= 1  # moved to a copy at the release
        del kept
        eager, replays = cg.stats(a).eager, cg.stats(a).replays
        for _ in range(2):  # nothing held: a replays again (the slot's count was refitted)
            x = torch.randn(2, 4)
            assert torch.equal(a(x), a.__dict__["forward"].__wrapped__(x))
        assert cg.stats(a).eager == eager and cg.stats(a).replays == replays + 2


def test_a_held_alias_saved_for_a_backward_is_moved_without_breaking_it(sim):
    # (review helper-20, F2: moving the alias with set_ bumped its version counter, and the
    # backward of a computation that saved it raised "modified by an inplace operation")
    torch.manual_seed(0)
    lin = cg.graphify(nn.Linear(4, 4))
    w = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings(), cg.graph_region() as region:
        warnings.simplefilter("ignore")
        with torch.no_grad():
            for _ in range(2):
                out = lin(torch.randn(2, 4))
        want = out.clone()
        loss = (w * out).sum()  # saves out for the backward
        moved = region.stats().moved_outputs
        with torch.no_grad():
            lin(torch.randn(2, 4))  # a replay: out is moved to a copy first
        assert region.stats().moved_outputs == moved + 1 and torch.equal(out, want)
        loss.backward()
    assert torch.equal(w.grad, want)


def test_closing_the_region_leaves_held_outputs_as_they_are(sim):
    # (nothing replays in its pool again: no copies are made at its end)
    torch.manual_seed(0)
    lin = cg.graphify(nn.Linear(4, 4))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with cg.graph_region() as region:
            for _ in range(2):
                out = lin(torch.randn(2, 4))
            want, moved = out.clone(), region.stats().moved_outputs
    assert region.closed and region.moved_outputs == moved and torch.equal(out, want)


@pytest.mark.parametrize("how", ["closed", "evicted"])
def test_the_fast_path_keeps_no_static_output_of_a_released_region_graph(sim, how):
    # (the region's fast path reads its graph's output slot through the entry: a slot kept on
    # the fast path held the pool's memory past the region, seen on the H200 as graph pool
    # bytes left after the region closed)
    import gc
    import weakref

    torch.manual_seed(0)
    g = cg.graphify(nn.Linear(8, 8))
    with torch.no_grad(), cg.graph_region(max_graphs=1) as region:
        for _ in range(3):
            g(torch.randn(2, 8))
        assert type(g._cudagraphify_state._fast).__name__ == "Fast"
        (slot,) = region._slots.values()
        static = weakref.ref(slot.tensor)
        if how == "evicted":  # another signature's graph takes the one place
            g(torch.randn(3, 8))
        del slot
    if how == "closed":
        assert region.closed
    gc.collect()
    assert static() is None
