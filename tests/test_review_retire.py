"""Review of 9b19651: a piece given back gets its plain forward back (``_wrap._retire_piece``).

CPU cases on the simulated backend (tests/conftest.py) with test_trial's fake clocks: a graph
costs 30 µs a call and its eager run 10 µs, so every piece is given back (retired) after its
trial. A ``retire=False`` case (``_wrap.RETIRE_PIECES`` off: the behaviour before the change)
or a test named ``control`` is a check found right.

Findings R1-R6 (helper-39), each failing on 9b19651, fixed in the commit after it:
R1 the guard of an outer graph that ran the piece counts a plan's wrapper as what it wraps
(``_guards._forward_of``); R2 retirement puts the bound ``_call_impl`` in place of DirectCall
instead of deleting it; R3 an instance's own forward comes back in one store; R4
``ungraphify`` of the root leaves a graphify of the user's own alone; R5 ``explain`` and
``ungraphify`` know a retired piece; R6 a bound method of the class's forward (unpickling)
is not an instance's own forward (``_wrap.has_own_forward``).
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _region, _watch, _wrap
from test_trial import _COST, _NOW, _Piece, _Root, _run
from test_trial import plan_timed, timed  # noqa: F401 (fixtures)
from test_review_trial import _Outer  # (graphed whole; runs another root's piece)

_GIVE_BACK = dict(graph_cost=30e-6, eager_cost=10e-6)


def _pair(cls=_Root):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def _same(g, ref, calls=1, rows=4):
    for _ in range(calls):
        x = torch.randn(rows, 8)
        assert torch.equal(g(x), ref(x))


# -- R1: an outer graph captured while the piece was live is captured again after retirement ----

@pytest.mark.parametrize("retire", [True, False])
def test_R1_retirement_does_not_invalidate_an_outer_graph(timed, monkeypatch, retire):  # noqa: F811
    """The outer graph's StateGuard recorded the piece's ``forward`` (the proxy) among the
    modules it ran; retirement pops it without an epoch bump, so the first later bump (any
    ``model.eval()``) finds "forward replaced": the outer graph is captured again and the
    stale one stays in its cache (graph memory held until evicted)."""
    monkeypatch.setattr(_wrap, "RETIRE_PIECES", retire)
    _COST.update(graph=30e-6, eager=10e-6)
    ref, g = _pair()
    _same(g, ref, calls=2)  # the plan: a and b graphed, their trials under way
    assert isinstance(g.a.__dict__.get("forward"), _wrap.GraphedForward)
    outer, outer_ref = cg.graphify(_Outer(g.a)), _Outer(ref.a)
    _same(outer, outer_ref, calls=3)  # captured while a is live
    _same(g, ref, calls=10)  # a's trial ends: given back
    assert g.a._cudagraphify_state.given_back is not None
    for _ in range(3):
        outer.eval()  # (bumps the module-state epoch)
        _same(outer, outer_ref)
    s = cg.stats(outer)
    assert (s.captures, s.graphs) == (1, 1), s


# -- R2: a call racing the retirement (another thread) -----------------------------------------

_PAUSE: list = []  # at most one callable: run (on another thread) at the pause point


def _pause_here():
    if _PAUSE:
        t = threading.Thread(target=_PAUSE.pop())
        t.start()
        t.join(10)


class _PausedLinear(nn.Linear):
    """Lets another thread run between ``Module._wrapped_call_impl``'s two reads of
    ``_compiled_call_impl`` (``is not None``, then the call): a GIL switch can land there."""

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if name == "_compiled_call_impl" and value is not None:
            _pause_here()
        return value


class _PausedRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _PausedLinear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y)


@pytest.mark.parametrize("retire", [True, False])
def test_R2_a_call_racing_the_retirement_does_not_crash(sim, monkeypatch, retire):
    """Thread 1 calls the piece and has just seen its DirectCall; thread 2 gives the piece
    back (as a plan trial's verdict does for every piece, on the thread that ended the
    trial). Retirement deleted ``_compiled_call_impl``; thread 1's second read got the class's
    None: ``TypeError: 'NoneType' object is not callable``."""
    monkeypatch.setattr(_wrap, "RETIRE_PIECES", retire)
    ref, g = _pair(_PausedRoot)
    with torch.no_grad():
        _same(g, ref, calls=3)
        assert "_compiled_call_impl" in g.a.__dict__
        state = g.a._cudagraphify_state

        def give_back():
            with state.lock:
                state.give_back("given back by another thread")

        _PAUSE.append(give_back)
        try:
            x = torch.randn(4, 8)
            assert torch.equal(g.a(x), ref.a(x))
        finally:
            _PAUSE.clear()
    assert state.given_back is not None


# -- R3: a forward of the instance's own is put back in two steps --------------------------------

def _own_forward(module):
    def forward(x):
        return nn.Linear.forward(module, x) * 2

    module.forward = forward
    return forward


class _PausingDispatch(_wrap.Dispatch):
    """``had_own`` is read by ``_restore_forward`` between its pop of ``forward`` and its store
    of the instance's own: another thread runs there (a GIL switch can land there)."""

    @property
    def had_own(self):
        _pause_here()
        return self.__dict__["had_own"]

    @had_own.setter
    def had_own(self, value):
        self.__dict__["had_own"] = value


def test_R3_a_call_during_retirement_runs_the_instance_own_forward(timed):  # noqa: F811
    torch.manual_seed(0)
    ref = _Root()
    g = copy.deepcopy(ref)
    _own_forward(g.a), _own_forward(ref.a)  # (as accelerate's hooks set one)
    g = cg.graphify(g)
    _COST.update(graph=30e-6, eager=10e-6)
    _same(g, ref, calls=2)  # a is planned with its own forward under the proxy
    g.a.__dict__["forward"]._self_dispatch.__class__ = _PausingDispatch
    seen = {}
    x2 = torch.randn(4, 8)

    def other_call():
        with torch.no_grad():
            seen["got"] = g.a(x2)

    _PAUSE.append(other_call)
    try:
        _same(g, ref, calls=10)  # a's trial ends: retired (its own forward put back)
    finally:
        _PAUSE.clear()
    assert "got" in seen and g.a._cudagraphify_state.given_back is not None
    # the call in between ran the class's forward (no "* 2" of the instance's own)
    assert torch.equal(seen["got"], ref.a(x2))


# -- R4: a user's graphify of a retired piece, then ungraphify of the root ------------------------

@pytest.mark.parametrize("how", ["graphify", "share_graph"])
def test_R4_ungraphify_of_the_root_leaves_the_users_graphify_of_a_retired_piece(
        timed, how):  # noqa: F811
    """A retired piece is no longer graphified (graphify and share_graph accept it; before the
    change they refused it), but it stays in its root's ``pieces``: ungraphify(root) then
    uninstalls what the user put on it (and stats(root) counts its graphs as the root's)."""
    g = _run(**_GIVE_BACK)
    assert g.a._cudagraphify_state.given_back is not None
    if how == "graphify":
        cg.graphify(g.a)
    else:
        cg.share_graph([g.a, g.b])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            g.a(x)
    cg.ungraphify(g)
    assert isinstance(g.a.__dict__.get("forward"), _wrap.GraphedForward), \
        "the user's graphify was removed by ungraphify(root)"
    assert (how != "share_graph") or "_cudagraphify_share" in g.a.__dict__


# -- R5: explain of a retired piece ---------------------------------------------------------------

def test_R5_explain_of_a_retired_piece_says_given_back(timed):  # noqa: F811
    """stats(piece) still has its state (the reason, the captures); explain(piece) looks only
    for a proxy, finds none and says "no plan yet" (before the change: "given back (eager)"
    with the reason). ungraphify(piece) now raises "not graphified" as well."""
    g = _run(**_GIVE_BACK)
    assert cg.stats(g.a).captures == 1  # (its state is there)
    first = str(cg.explain(g.a)).splitlines()[0]
    assert "given back" in first, first


# -- R6: a pickled piece's bound forward is now kept as "its own" ---------------------------------

class _PickledRoot(_Root):
    """Graphified as a class (an instance-graphified module refuses pickling)."""


def test_R6_an_unpickled_piece_loses_its_bound_forward_on_ungraphify(timed):  # noqa: F811
    """A class-graphified model pickled with live pieces unpickles each piece with its
    (plain, bound) forward in its ``__dict__`` (GraphedForward.__reduce_ex__). Planned again,
    the piece is now installed with had_own=True, so retirement and ungraphify(root) put
    that bound method back for good (a self-reference cycle in the module; before the change
    ungraphify removed it)."""
    cg.graphify(_PickledRoot)
    try:
        _COST.update(graph=1e-6, eager=50e-6)  # the pieces pay: live when pickled
        torch.manual_seed(0)
        g = _PickledRoot()
        for _ in range(10):
            g(torch.randn(4, 8))
        c = pickle.loads(pickle.dumps(g))
    finally:
        cg.ungraphify(_PickledRoot)
    cg.graphify(c)
    _COST.update(graph=30e-6, eager=10e-6)
    for _ in range(10):
        c(torch.randn(4, 8))
    assert c.a._cudagraphify_state.given_back is not None
    cg.ungraphify(c)
    assert "forward" not in c.a.__dict__, c.a.__dict__.get("forward")


# -- controls -----------------------------------------------------------------------------------

def test_control_retirement_waits_for_a_pending_backward(plan_timed, monkeypatch):  # noqa: F811
    """A plan trial gives every piece back while a training graph's backward is pending: the
    proxy stays until a call after the backward; outputs and gradients equal eager's."""
    owned = _region.GraphRegion.owned_outputs

    def costly(self, out):  # the chain's way out costs more: the plan is given back
        _NOW[0] += 1e-3
        return owned(self, out)

    monkeypatch.setattr(_region.GraphRegion, "owned_outputs", costly)
    _COST.update(graph=5e-6, eager=50e-6)
    ref, g = _pair()
    with torch.enable_grad():
        for _ in range(8):  # (past the training graph's own trial, which keeps it)
            x = torch.randn(4, 8)
            g(x).sum().backward(), ref(x).sum().backward()
        g.zero_grad(), ref.zero_grad()
        x = torch.randn(4, 8)
        out, want = g(x), ref(x)  # its backward pending
    _same(g, ref, calls=30)
    state = g.a._cudagraphify_state
    assert state.given_back is not None and state._backward_pending
    assert isinstance(g.a.__dict__.get("forward"), _wrap.GraphedForward)
    with torch.enable_grad():
        out.sum().backward(), want.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(g.parameters(), ref.parameters()))
    with torch.enable_grad():
        for _ in range(2):
            g.zero_grad(), ref.zero_grad()
            x = torch.randn(4, 8)
            out, want = g(x), ref(x)
            assert torch.equal(out, want)
            out.sum().backward(), want.sum().backward()
            assert all(torch.equal(p.grad, q.grad)
                       for p, q in zip(g.parameters(), ref.parameters()))
    assert not state._backward_pending and "forward" not in g.a.__dict__
    assert type(g.a.__dict__["_compiled_call_impl"]) is _watch.PlainCall  # (no DirectCall)


def test_control_hooks_torch_compile_and_replicas_of_retired_pieces(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    torch.manual_seed(0)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    seen = []
    g.a.register_forward_hook(lambda m, i, o: seen.append(1))
    _same(g, ref, calls=3)
    assert len(seen) == 3
    compiled = torch.compile(g, backend="eager")
    _same(compiled, ref, calls=3)
    replica = g.a._replicate_for_data_parallel()  # (DataParallel sets its parameters next)
    assert not any(k in replica.__dict__ for k in ("forward", "_compiled_call_impl",
                                                    "_cudagraphify_state"))


def test_control_torch_compile_over_the_trial(timed):  # noqa: F811
    """torch.compile traced the piece's proxy (a graph break to the graphs) before it was
    retired: its later calls are right, through the proxy's given-back path or a retrace.
    (Dynamo's caches reset first: frames compiled by earlier tests in this process, of
    ``Module._call_impl`` among them, are not this test's.)"""
    torch._dynamo.reset()
    _COST.update(graph=30e-6, eager=10e-6)
    ref, g = _pair()
    compiled = torch.compile(g, backend="eager")
    _same(compiled, ref, calls=14)
    assert g.a._cudagraphify_state.given_back is not None


class _Nested(nn.Module):
    """A root whose forward runs another graphified root (its own host sync besides)."""

    def __init__(self):
        super().__init__()
        self.inner = _Root()
        self.c = _Piece(8, 8)

    def forward(self, x):
        y = self.inner(x)
        if bool((y < 1e9).all()):
            y = y - 1
        return self.c(y)


def test_control_retirement_inside_an_outer_roots_chain(timed):  # noqa: F811
    _COST.update(graph=30e-6, eager=10e-6)
    torch.manual_seed(0)
    ref = _Nested()
    g = copy.deepcopy(ref)
    cg.graphify(g.inner)
    cg.graphify(g)
    _same(g, ref, calls=14)
    _same(g.inner, ref.inner, calls=3)
    pieces = [m for m in g.modules() if "_cudagraphify_state" in m.__dict__
              and m._cudagraphify_state.options.piece]
    assert pieces and all(m._cudagraphify_state.given_back for m in pieces)
    assert all("forward" not in m.__dict__ for m in pieces)
    cg.ungraphify(g.inner), cg.ungraphify(g)
    assert not any("_cudagraphify_state" in m.__dict__ for m in g.modules())


def test_control_threads_calling_the_root_through_its_trial(timed):  # noqa: F811
    _COST.update(graph=30e-6, eager=10e-6)
    ref, g = _pair()
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(15):
                    x = torch.randn(4, 8, generator=gen)
                    if not torch.equal(g(x), ref(x)):
                        errors.append("mismatch")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert all(p._cudagraphify_state.given_back and "forward" not in p.__dict__
               for p in (g.a, g.b))


def test_control_chain_needed_and_replan_after_retirement(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    state = g._cudagraphify_state
    assert state._chain_needed() is False
    torch.manual_seed(0)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    _same(g, ref, calls=4, rows=2)  # another signature: planned again, pieces left as they are
    assert state._chain_needed() is False and "forward" not in g.a.__dict__


# -- found by the same review, older than the change (fixed with it) ---------------------------

def test_P1_a_deep_copy_of_a_planned_root_knows_its_pieces(timed):  # noqa: F811
    """A deep copy of a root whose pieces are live brings their wrappers along; its own plan
    left them out of its ``pieces`` (not chained, not timed as a plan, never uninstalled)."""
    _COST.update(graph=1e-6, eager=50e-6)  # pieces pay: they stay live
    ref, g = _pair()
    with torch.no_grad():
        _same(g, ref, calls=10)
        c = copy.deepcopy(g)
        _same(c, ref, calls=10)
    assert {id(p) for p in c._cudagraphify_state.pieces} == {id(c.a), id(c.b)}
    assert all(cg.stats(p).graphs == 1 for p in (c.a, c.b))
    cg.ungraphify(c)
    assert all("forward" not in p.__dict__ and "_cudagraphify_state" not in p.__dict__
               for p in (c.a, c.b))


def test_P2_a_data_parallel_replica_keeps_an_instance_own_forward(timed):  # noqa: F811
    """``_replicate_for_data_parallel`` bound an instance's own (closure) forward to the
    replica as a method: calling the replica raised ``TypeError``."""
    m = nn.Linear(8, 8)
    calls = []

    def forward(x):
        calls.append(1)
        return nn.Linear.forward(m, x)

    m.forward = forward
    cg.graphify(m)
    replica = m._replicate_for_data_parallel()
    x = torch.randn(2, 8)
    assert torch.equal(replica(x), nn.Linear.forward(m, x)) and calls
