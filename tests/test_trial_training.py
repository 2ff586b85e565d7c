"""A piece's training graph is timed against its eager run too (its forward: what the backward
graph saves is not counted), and given back where it does not pay: grad-mode forwards of a
piecewise model were slower than eager (GPT-2 1.17x, Llama 1.22x on the H200), their pieces'
training graphs replayed through the slow path, never timed.

CPU, the simulated backend with a fake clock (tests/test_trial.py's): a piece's eager forward
costs ``_COST["eager"]``, a replay of any graph ``_COST["graph"]``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import cudagraphify as cg
from cudagraphify import _capture, _trial
from conftest import SimBackend, SimGraph

from test_trial import _COST, _HOST, _NOW, _Root


@pytest.fixture
def timed(monkeypatch):
    backend = SimBackend()
    backend.clock = lambda device: lambda: _NOW[0]
    monkeypatch.setattr(_trial, "host_clock", lambda: _HOST[0])
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)  # (each piece's own trial only)
    old = _capture.set_backend(backend)
    replay = SimGraph.replay

    def costly(self):
        _NOW[0] += _COST["graph"]
        _HOST[0] += _COST["graph"]
        return replay(self)

    monkeypatch.setattr(SimGraph, "replay", costly)
    _COST.update(eager=0.0, graph=0.0, eager_host=None, graph_host=None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield backend
    finally:
        _capture.set_backend(old)


def _train(g, ref, steps=10, dims=(4, 8)):
    """Training steps (forward, backward, SGD) on both; every output and gradient equal."""
    opt_g = torch.optim.SGD(g.parameters(), lr=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(*dims)
        out, want = g(x), ref(x)
        assert torch.equal(out, want), step
        out.sum().backward(), want.sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()


def _pair(cls=_Root):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def test_a_training_piece_whose_forward_graph_costs_more_is_given_back(timed):
    _COST.update(graph=30e-6, eager=10e-6)
    ref, g = _pair()
    _train(g, ref)
    for piece in (g.a, g.b):
        state = piece._cudagraphify_state
        assert state.given_back is not None and "costs more" in state.given_back, state
        assert cg.stats(piece).graphs == 0


def test_a_training_piece_whose_forward_graph_pays_keeps_replaying(timed):
    _COST.update(graph=5e-6, eager=50e-6)
    ref, g = _pair()
    _train(g, ref, steps=12)
    state = g.a._cudagraphify_state
    assert state.given_back is None and cg.stats(g.a).graphs == 1
    replays = state.replays
    _train(g, ref, steps=3)
    assert state.replays == replays + 3  # (after its trial: a replay every step)


def test_grad_mode_calls_without_backward_judge_the_training_graph_when_none_is_pending(timed):
    """Forwards under grad mode whose outputs are dropped (an evaluation left without
    ``no_grad``), then one kept until its backward: eager's values and gradients."""
    _COST.update(graph=30e-6, eager=10e-6)
    ref, g = _pair()
    with torch.enable_grad():
        for _ in range(10):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        x = torch.randn(4, 8)
        out, want = g(x), ref(x)
        for _ in range(3):  # (calls while its backward is pending)
            x2 = torch.randn(4, 8)
            assert torch.equal(g(x2), ref(x2))
        out.sum().backward(), want.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(g.parameters(), ref.parameters()))
    assert g.a._cudagraphify_state.given_back is not None


def test_only_the_training_signature_that_does_not_pay_runs_eagerly(timed):
    """A piece whose no_grad graph pays but whose training graph does not (its costs depend
    on grad mode here): the training signature runs eagerly, the no_grad one replays."""
    _COST.update(graph=20e-6, eager=10e-6)
    ref, g = _pair()
    def eager_cost():  # no_grad: eager costs more than the graph; grad mode: less
        return 50e-6 if not torch.is_grad_enabled() else 10e-6

    piece_forward = type(g.a).forward

    def forward(self, x):
        _NOW[0] += eager_cost() - _COST["eager"]
        _HOST[0] += eager_cost() - _COST["eager"]
        return piece_forward(self, x)

    type(g.a).forward = forward  # (before the first call: the pieces wrap it)
    try:
        with torch.no_grad():
            for _ in range(10):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        _train(g, ref)
        state = g.a._cudagraphify_state
        assert state.given_back is None, state.given_back
        assert any(r.startswith("signature run eagerly") for r in state.eager_calls), state
        replays = state.replays
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        assert state.replays == replays + 3
    finally:
        type(g.a).forward = piece_forward


@pytest.mark.parametrize("decision_us", [0.0, 20.0])
def test_a_training_graphs_turns_count_the_slow_path_it_replays_through(timed, monkeypatch,
                                                                         decision_us):
    """A training graph has no fast path: each of its calls pays the slow path's decision
    before its replay. Its timed turns count that too (from ``slow`` on), as an inference
    graph's count its fast path's checks: a graph that saves 5 µs of a 10 µs forward but
    costs 20 µs of deciding is given back (Llama's rotary embedding under grad mode)."""
    from cudagraphify import _engine
    _COST.update(graph=5e-6, eager=10e-6)
    replay = _engine.GraphedState._replay

    def deciding(self, *a, **k):  # (the decision's cost, on the host, before the replay)
        _NOW[0] += decision_us * 1e-6
        _HOST[0] += decision_us * 1e-6
        return replay(self, *a, **k)
    monkeypatch.setattr(_engine.GraphedState, "_replay", deciding)
    ref, g = _pair()
    _train(g, ref, steps=12)
    state = g.a._cudagraphify_state
    if decision_us:
        assert state.given_back is not None and "costs more" in state.given_back, state
    else:
        assert state.given_back is None and cg.stats(g.a).graphs == 1
