"""Review of pieces timed against their eager run and given back when slower (cudagraphify/
_trial.py): the findings of a fresh-context reviewer (F1-F5, fixed) and its controls.

CPU cases on the simulated backend of tests/conftest.py, with a fake clock: a piece's eager
forward advances it by ``_COST["eager"]``, a replay of any graph by ``_COST["graph"]``.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _trial
from conftest import SimBackend, SimGraph

from test_trial import _COST, _NOW, _Piece, _Root  # (the same clock and model)


@pytest.fixture
def timed(monkeypatch):
    """The simulated backend with a clock; a graph costs 30 µs a call, eager 10 µs: every
    piece is given back after its trial (unless a test sets other costs)."""
    backend = SimBackend()
    backend.clock = lambda device: lambda: _NOW[0]
    monkeypatch.setattr(_trial, "host_clock", lambda: _NOW[0])
    old = _capture.set_backend(backend)
    replay = SimGraph.replay

    def costly(self):
        _NOW[0] += _COST["graph"]
        return replay(self)

    monkeypatch.setattr(SimGraph, "replay", costly)
    _COST.update(graph=30e-6, eager=10e-6)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield backend
    finally:
        _capture.set_backend(old)


def _pair(cls=_Root):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def _run_no_grad(g, ref, calls=10):
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))


# -- F1: a give-back releases a piece's TrainingGraph whose backward is still pending ----------

def test_F1_give_back_keeps_a_pending_backward_working(timed):
    """A training step that calls the model under no_grad between its forward and backward
    (Double-DQN's action choice, a detached target, a consistency target)."""
    ref, g = _pair()
    opt_g = torch.optim.SGD(g.parameters(), lr=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(12):
        x, x2 = torch.randn(4, 8), torch.randn(4, 8)
        out, want = g(x), ref(x)
        with torch.no_grad():
            assert torch.equal(g(x2), ref(x2))
        assert torch.equal(out, want)
        out.sum().backward()  # raises at the step whose no_grad call gave the pieces back
        want.sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()
    # the training graph is timed too (its forward) and costs more: judged when no backward
    # of it is pending, the piece ends given back whole
    state = g.a._cudagraphify_state
    assert state.given_back is not None and cg.stats(g.a).graphs == 0, state


def test_F1_control_no_backward_pending_is_fine(timed):
    """The same steps with the no_grad call before the forward: no backward is pending when
    the pieces are given back, and every output and gradient equals eager's."""
    ref, g = _pair()
    for step in range(12):
        x, x2 = torch.randn(4, 8), torch.randn(4, 8)
        with torch.no_grad():
            assert torch.equal(g(x2), ref(x2))
        out, want = g(x), ref(x)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        g.zero_grad(), ref.zero_grad()
    state = g.a._cudagraphify_state
    assert state.given_back is not None and cg.stats(g.a).graphs == 0, state
    assert any(r.startswith("signature run eagerly") for r in state.eager_calls), state


# -- F2: a given-back piece's guard keeps its old parameter storages alive forever ------------

def test_F2_given_back_piece_lets_moved_parameters_go(timed):
    ref, g = _pair()
    _run_no_grad(g, ref)
    assert g.a._cudagraphify_state.given_back is not None
    old = g.a.weight.untyped_storage()  # (held here: its memory cannot be reused meanwhile)
    g.double(), ref.double()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8, dtype=torch.double)
            assert torch.equal(g(x), ref(x))
    held = g.a._cudagraphify_state.statics._held
    assert all(s._cdata != old._cdata for s in held), "old float32 weight storage still held"


def test_F2_control_a_kept_piece_lets_them_go(timed):
    _COST.update(graph=1e-6, eager=10e-6)  # the graph pays: kept
    ref, g = _pair()
    _run_no_grad(g, ref)
    assert g.a._cudagraphify_state.given_back is None
    old = g.a.weight.untyped_storage()
    g.double(), ref.double()
    with torch.no_grad():
        for _ in range(3):  # (the root's first call re-plans: the pieces run in its warm-up)
            x = torch.randn(4, 8, dtype=torch.double)
            assert torch.equal(g(x), ref(x))
    assert all(s._cdata != old._cdata for s in g.a._cudagraphify_state.statics._held)


# -- F3: a call that passed the given_back check before the give-back captures a new graph ----

class _LockSpy:
    """Stands in for a state's RLock: says when a thread starts waiting for it."""

    def __init__(self, lock, waiting: threading.Event):
        self._lock, self._waiting = lock, waiting

    def __enter__(self):
        if threading.current_thread().name == "t2":
            self._waiting.set()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def test_F3_a_call_racing_the_give_back_captures_nothing(timed):
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(2):  # the root's plan; the pieces' captures
            g(torch.randn(4, 8))
        a = g.a
        state = a._cudagraphify_state
        # piece a directly (outside its root's implicit region: a graph of its own cache):
        # its first sight there (eager: no keyed root's first call saw it first, see
        # _engine._SEEN_ONCE), its capture, then graph, eager, graph, eager, graph (its trial
        # then needs one eager)
        for _ in range(7):
            x = torch.randn(4, 8)
            assert torch.equal(a(x), ref.a(x))
    entry = next(e for e in state.cache.graphs(state))
    assert entry.trial is not None and len(entry.trial.graph) == 3
    t2_waiting, t1_in_clock = threading.Event(), threading.Event()
    clock = entry.trial.clock
    reads = [0]

    def slow_clock():  # the last eager sample's closing read waits for the racing call
        reads[0] += 1
        if reads[0] == 2:
            t1_in_clock.set()
            assert t2_waiting.wait(10)
        return clock()

    entry.trial.clock = slow_clock
    state.lock = _LockSpy(state.lock, t2_waiting)
    results = {}

    def call(name, x):
        with torch.no_grad():
            results[name] = (a(x), ref.a(x))

    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    t1 = threading.Thread(target=call, args=("t1", x1))
    t1.start()
    assert t1_in_clock.wait(10)
    t2 = threading.Thread(target=call, args=("t2", x2), name="t2")
    t2.start()
    t1.join(10), t2.join(10)
    for got, want in results.values():  # (the results themselves are right)
        assert torch.equal(got, want)
    assert state.given_back is not None
    s = cg.stats(a)
    # (two captures: the root's second call's, in its implicit region, and the first direct
    # call's; none by the racing call)
    assert (s.graphs, s.captures) == (0, 2), s


# -- F4: explain of a given-back piece itself says "graphed" ----------------------------------

def test_F4_explain_of_the_given_back_piece_itself(timed):
    ref, g = _pair()
    _run_no_grad(g, ref)
    assert g.a._cudagraphify_state.given_back is not None
    assert "given back (eager)" in str(cg.explain(g)).split("\n", 3)[2]  # (from the root: ok)
    text = str(cg.explain(g.a))
    assert ": graphed" not in text.splitlines()[0], text


# -- checked and found right (no xfail) ----------------------------------------------------------

class _InPlace(nn.Module):
    """A piece that writes its input in place and returns it (copy-back, an output that is
    the caller's tensor)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        _NOW[0] += _COST["eager"]
        x.mul_(2)
        return x, self.lin(x)


class _TwiceRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.a = _InPlace(), _Piece(8, 8)

    def forward(self, x):
        x = x.clone()
        x2, y = self.p(x)
        assert x2 is x
        z = self.a(y)
        if bool((z > -1e9).all()):
            z = z + 1
        return x, self.a(z) + z  # a twice in one forward


@pytest.mark.parametrize("graph_cost", [30e-6, 1e-6], ids=["given_back", "kept"])
def test_inplace_piece_and_a_piece_called_twice_equal_eager(timed, graph_cost):
    _COST.update(graph=graph_cost)
    ref, g = _pair(_TwiceRoot)
    with torch.no_grad():
        for _ in range(14):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert all(torch.equal(u, v) for u, v in zip(got, want))
    s = cg.stats(g.a)
    assert s.timed_calls == 3, s
    assert (g.a._cudagraphify_state.given_back is not None) == (graph_cost > 10e-6)


class _Outer(nn.Module):
    """Graphed whole; calls a piece of another root inside its own warm-up and capture."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return self.shared(x) * 3


def test_given_back_piece_inside_another_graphs_capture(timed):
    ref, g = _pair()
    _run_no_grad(g, ref)
    assert g.a._cudagraphify_state.given_back is not None
    outer, outer_ref = cg.graphify(_Outer(g.a)), _Outer(ref.a)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(outer(x), outer_ref(x))
            assert torch.equal(g(x), ref(x))
    assert cg.stats(outer).captures == 1 and cg.stats(outer).replays >= 2


# -- F5 (stats): calls of a given-back piece inside another graph's warm-up/capture count ------

def test_F5_calls_inside_another_graphs_capture_are_not_eager_calls(timed):
    ref, g = _pair()
    _run_no_grad(g, ref)
    before = cg.stats(g.a).eager
    outer = cg.graphify(_Outer(g.a))
    with torch.no_grad():
        outer(torch.randn(4, 8))  # warm-up and capture: a runs inside them only
    assert cg.stats(outer).captures == 1
    assert cg.stats(g.a).eager == before, (before, cg.stats(g.a).eager)


def test_regraphify_after_give_back_starts_a_new_trial(timed):
    ref, g = _pair()
    _run_no_grad(g, ref)
    assert g.a._cudagraphify_state.given_back is not None
    cg.ungraphify(g)
    _run_no_grad(g, ref, calls=2)
    _COST.update(graph=1e-6)
    cg.graphify(g)
    _run_no_grad(g, ref)
    state = g.a._cudagraphify_state
    assert state.given_back is None and cg.stats(g.a).timed_calls == 3
    assert cg.stats(g.a).graphs == 1
