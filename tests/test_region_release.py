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
from cudagraphify import _capture

from test_review_pools import PoolGraph, PoolSim


class KeptPoolGraph(PoolGraph):
    """A pool graph whose memory a replay of a graph captured before it still scribbles over
    after it is released (as long as someone holds it): the allocator's view of a shared pool."""

    def release(self):
        self.kept = list(self.fresh)
        super().release()

    def replay(self):
        b = self._backend
        for ref in b.members.get(self.pool_key, []):
            g = ref()
            if g is not None and g is not self and g.released and g.order > self.order:
                with torch._C._DisableTorchDispatch():
                    for st in getattr(g, "kept", []):
                        if st.nbytes():
                            torch.empty(0, dtype=torch.uint8).set_(st).fill_(0xFF)
        super().replay()


class KeptPoolSim(PoolSim):
    graph_class = KeptPoolGraph


@pytest.fixture
def ksim():
    backend = KeptPoolSim()
    old = _capture.set_backend(backend)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield backend
    finally:
        _capture.set_backend(old)


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
