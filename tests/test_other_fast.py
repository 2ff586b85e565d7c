"""The replay path kept aside (``GraphedState._alt``, ``other_fast``): a callable called with two
signatures in turn (a prefill's and a decode step's, as every ``generate()`` does) replays
either without the slow path, and only where that path's own checks pass.

On the CPU double, every output compared with an eager twin, bitwise; the slow path's calls
counted (the control runs with the kept-aside path off)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine
from cudagraphify._fast import MISS

from test_opaque_plan import _Cache, _Model as _OpaqueModel


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def slow_calls(monkeypatch):
    """How many calls the slow path took (every graphified callable's)."""
    seen = [0]
    real = _engine.GraphedState.slow

    def slow(self, fn, args, kwargs):
        seen[0] += 1
        return real(self, fn, args, kwargs)

    monkeypatch.setattr(_engine.GraphedState, "slow", slow)
    return seen


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.zeros(8))
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


def _pair(cls=_Scaled):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


_SHAPES = ((3, 8), (5, 8))  # two signatures, called in turn


def _turns(ref, g, n: int) -> None:
    for i in range(n):
        x = torch.randn(*_SHAPES[i % 2])
        assert torch.equal(g(x), ref(x))


def _off(monkeypatch) -> None:
    monkeypatch.setattr(_engine.GraphedState, "other_fast", lambda self, fn, a, k: MISS)


@pytest.mark.parametrize("kept_aside", [True, False])
def test_two_signatures_in_turn_replay_without_the_slow_path(sim, slow_calls, monkeypatch,
                                                             kept_aside):
    if not kept_aside:
        _off(monkeypatch)
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)  # (each signature: its capture, then a replay through the slow path)
        before, replays = slow_calls[0], cg.stats(g).replays
        _turns(ref, g, 10)
    assert cg.stats(g).captures == 2 and cg.stats(g).replays == replays + 10
    assert slow_calls[0] - before == (0 if kept_aside else 10)


def test_a_moved_parameter_is_seen_by_the_path_kept_aside(sim, slow_calls):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)  # the last call's signature is the second: the first's is aside
        for m in (ref, g):
            m.lin.weight.data = m.lin.weight.data * 3  # (new memory)
        x = torch.randn(*_SHAPES[0])
        before = slow_calls[0]
        assert torch.equal(g(x), ref(x))
        assert slow_calls[0] == before + 1
        _turns(ref, g, 6)


def test_a_buffer_written_in_place_between_turns_is_read_by_the_replay(sim):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)
        for m in (ref, g):
            m.shift.add_(1.5)  # (the same memory: graphs read it as it is)
        _turns(ref, g, 4)
    assert cg.stats(g).captures == 2


def test_an_attribute_read_by_forward_changed_between_turns(sim, slow_calls):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)
        for m in (ref, g):
            m.scale = 3.0
        before = slow_calls[0]
        _turns(ref, g, 2)  # (neither path kept holds the new value: both decided anew)
        assert slow_calls[0] - before == 2
        _turns(ref, g, 6)


def test_not_across_a_rescan_of_the_statics(sim, slow_calls):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)
        state = g._cudagraphify_state
        for m in (ref, g):
            m.shift = m.shift.data  # (another object on the same memory: a rescan)
        x = torch.randn(*_SHAPES[0])
        assert torch.equal(g(x), ref(x))  # the slow path rescans, then replays
        kept = state._alt
        assert kept is not None and kept.scans != state.statics.scans
        before = slow_calls[0]
        x = torch.randn(*_SHAPES[1])
        assert torch.equal(g(x), ref(x))
        assert slow_calls[0] == before + 1 and state._alt is not kept
        _turns(ref, g, 6)


@pytest.mark.parametrize("how", ["release", "ungraphify", "invalidate"])
def test_released_graphs_leave_nothing_aside(sim, how):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)
        state = g._cudagraphify_state
        assert state._alt is not None and state._fast is not None
        if how == "release":
            state.release()
        elif how == "ungraphify":
            cg.ungraphify(g)
        else:
            state.invalidate("a test")
        assert state._alt is None and state._fast is None
        _turns(ref, g, 4)


def test_a_miss_of_both_keeps_the_latest_aside(sim, slow_calls):
    ref, g = _pair()
    with torch.no_grad():
        _turns(ref, g, 4)
        state = g._cudagraphify_state
        last = state._fast
        x = torch.randn(7, 8)  # a third signature: both paths miss
        assert torch.equal(g(x), ref(x))
        assert state._alt is last  # (the one replayed last, not the one before it)


def test_prefill_and_decode_pieces_around_an_opaque_cache(sim, slow_calls, monkeypatch):
    """Every piece of a plan made around an opaque cache has a prefill's signature and a decode
    step's: each sequence's prefill, then its first step, took the slow path in each piece."""
    on = [True]
    real = _engine.GraphedState.other_fast
    monkeypatch.setattr(_engine.GraphedState, "other_fast",
                        lambda self, fn, a, k: real(self, fn, a, k) if on[0] else MISS)

    def sequences(kept_aside: bool) -> int:
        on[0] = kept_aside
        ref, g = _pair(_OpaqueModel)
        with torch.no_grad():
            for n in range(4):
                if n == 3:
                    before = slow_calls[0]
                rc, c = _Cache(), _Cache()
                for step in range(5):
                    x = torch.randn(1, 4 if step == 0 else 1, 8)
                    assert torch.equal(g(x, c), ref(x, rc))
        assert all(cg.stats(p).captures == 2 for p in (g.layers[0].norm, g.layers[1].mlp))
        return slow_calls[0] - before

    assert sequences(True) == 0
    # (control: 2 layers x 4 pieces x prefill and first step)
    assert sequences(False) == 16
