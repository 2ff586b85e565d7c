"""New signatures on every call (CPU, simulated backend): after as many graphs captured in a row,
none replayed, as the cache holds (``max_graphs``, at least ``_engine._MAX_FRUITLESS``), new
signatures run eagerly for a while (``_STORM_CALLS`` distinct ones), so that a shape or a
cache's memory that changes every call (beam search's ``reorder_cache``) does not pay a capture
per call; graphs made go on replaying, a graph that replays again or a signature that comes
back ends it, and ``capture_sizes`` is exempt."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


_MAX_GRAPHS = 12


def _pair():
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    return ref, cg.graphify(copy.deepcopy(ref), max_graphs=_MAX_GRAPHS)


def _threshold(g) -> int:
    return max(_engine._MAX_FRUITLESS, _MAX_GRAPHS)


def _storm_reason(g) -> str | None:
    return next((r for r in cg.stats(g).eager_calls if r.startswith("a new signature on every")),
                None)


def test_a_new_batch_size_every_call_stops_capturing(sim):
    ref, g = _pair()
    with torch.no_grad():
        for n in range(1, 41):
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures == _threshold(g), s  # (then the storm: no more captures)
    assert cg.stats(g).eager_calls[_storm_reason(g)] == 40 - s.captures
    with torch.no_grad():  # a size with a graph still replays
        x = torch.randn(3, 8)
        replays = cg.stats(g).replays
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).replays == replays + 1


def test_a_graph_that_replays_again_ends_it(sim):
    ref, g = _pair()
    with torch.no_grad():
        for n in range(1, _threshold(g) + 3):  # new sizes: the storm starts
            g(torch.randn(n, 8))
        assert _storm_reason(g) is not None
        captures = cg.stats(g).captures
        g(torch.randn(60, 8))  # eager (the storm)
        g(torch.randn(2, 8))  # a graph replays again
        x = torch.randn(61, 8)
        assert torch.equal(g(x), ref(x))  # captured: the storm is over
        assert cg.stats(g).captures == captures + 1


def test_sizes_that_repeat_keep_capturing(sim):
    """A server's sizes: each new one captured while the earlier ones replay between."""
    ref, g = _pair()
    with torch.no_grad():
        for n in range(1, 21):
            for m in (n, 1):  # a new size, then one seen before
                x = torch.randn(m, 8)
                assert torch.equal(g(x), ref(x))
    assert cg.stats(g).captures >= 20 and _storm_reason(g) is None  # (evictions: again)


def test_capture_sizes_is_exempt(sim):
    ref, g = _pair()
    sizes = range(1, _MAX_GRAPHS + 1)
    done = cg.capture_sizes(g, lambda n: torch.randn(n, 8), sizes, progress=False)
    assert len(done.graphed) == len(sizes) and not done.eager, done
    assert _storm_reason(g) is None


def test_it_is_tried_again_after_as_many_new_signatures(sim, monkeypatch):
    monkeypatch.setattr(_engine, "_STORM_CALLS", 3)
    ref, g = _pair()
    fruitless = _threshold(g)
    with torch.no_grad():
        for n in range(1, fruitless + 3 + 2 + 1):  # captured, 3 eager, then 2 captured again
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x))
    assert cg.stats(g).captures == fruitless + 2
