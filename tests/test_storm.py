"""New signatures on every call (CPU, simulated backend): after the last few graphs captured were
never replayed, new signatures run eagerly for a while (``_engine._MAX_FRUITLESS``,
``_STORM_CALLS``), so that a shape or a cache's memory that changes every call (beam search's
``reorder_cache``) does not pay a capture per call; graphs made go on replaying, a graph that
replays again ends it, and ``capture_sizes`` is exempt."""

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


def _pair():
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    return ref, cg.graphify(copy.deepcopy(ref))


def _storm_reason(g) -> str | None:
    return next((r for r in cg.stats(g).eager_calls if r.startswith("a new signature on every")),
                None)


def test_a_new_batch_size_every_call_stops_capturing(sim):
    ref, g = _pair()
    with torch.no_grad():
        for n in range(1, 31):
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures == _engine._MAX_FRUITLESS, s  # (then the storm: no more captures)
    assert cg.stats(g).eager_calls[_storm_reason(g)] == 30 - s.captures
    with torch.no_grad():  # a size with a graph still replays
        x = torch.randn(3, 8)
        replays = cg.stats(g).replays
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).replays == replays + 1


def test_a_graph_that_replays_again_ends_it(sim):
    ref, g = _pair()
    with torch.no_grad():
        for n in range(1, 11):  # 10 new sizes: the storm starts
            g(torch.randn(n, 8))
        assert _storm_reason(g) is not None
        captures = cg.stats(g).captures
        g(torch.randn(40, 8))  # eager (the storm)
        g(torch.randn(2, 8))  # a graph replays again
        x = torch.randn(41, 8)
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
    assert cg.stats(g).captures == 20 and _storm_reason(g) is None


def test_capture_sizes_is_exempt(sim):
    ref, g = _pair()
    done = cg.capture_sizes(g, lambda n: torch.randn(n, 8), range(1, 15), progress=False)
    assert len(done.graphed) == 14 and not done.eager, done
    assert _storm_reason(g) is None


def test_it_is_tried_again_after_as_many_new_signatures(sim, monkeypatch):
    monkeypatch.setattr(_engine, "_STORM_CALLS", 3)
    ref, g = _pair()
    fruitless = _engine._MAX_FRUITLESS
    with torch.no_grad():
        for n in range(1, fruitless + 3 + 2 + 1):  # 8 captured, 3 eager, then 2 captured again
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x))
    assert cg.stats(g).captures == fruitless + 2
