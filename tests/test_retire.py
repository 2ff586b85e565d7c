"""A plan's piece given back for good gets its plain forward back (cudagraphify/_wrap.py,
``_retire_piece``): its calls cost what they cost without cudagraphify, and nothing of it is
lost or left behind (its own forward, its reason, its state until the root goes)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _watch, _wrap
from test_trial import _COST, _Piece, _Root, _run
from test_trial import timed  # noqa: F401 (a fixture)

_GIVE_BACK = dict(graph_cost=30e-6, eager_cost=10e-6)


def _plain(module: nn.Module) -> bool:
    """No wrapper of ours left: its class's forward, and as its call override at most the
    ``PlainCall`` of its ``_call_impl`` (what a module without one runs; see
    ``_wrap._retire_piece``)."""
    d = module.__dict__
    call = d.get("_compiled_call_impl")
    return "forward" not in d and (call is None or _plain_call(call, module))


def _plain_call(call, module: nn.Module) -> bool:
    return type(call) is _watch.PlainCall and call.func is nn.Module._call_impl \
        and call.args == (module,)


def test_a_given_back_piece_runs_without_cudagraphify(timed, monkeypatch):  # noqa: F811
    g = _run(**_GIVE_BACK)
    assert all(_plain(p) for p in (g.a, g.b))
    assert all(p._cudagraphify_state.given_back for p in (g.a, g.b))

    def refused(*args, **kwargs):
        raise AssertionError("a given-back piece's call reached cudagraphify")

    monkeypatch.setattr(_engine.GraphedState, "slow", refused)
    monkeypatch.setattr(_wrap.Dispatch, "__call__", refused)
    ref = _Piece(8, 8)
    ref.load_state_dict(g.a.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(g.a(x), ref(x))


def test_the_reason_stays_in_stats_and_explain(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    why = g.a._cudagraphify_state.given_back
    assert why in cg.stats(g).eager_calls and why in cg.stats(g.a).eager_calls
    assert "given back (eager)" in str(cg.explain(g))


class _OwnForward(_Piece):
    """A piece whose instance has a forward of its own (as accelerate's hooks set one)."""


def _own_forward(module):
    def forward(x):
        return nn.Linear.forward(module, x) * 2

    module.forward = forward
    return forward


def test_a_forward_of_the_instance_own_comes_back(timed):  # noqa: F811
    torch.manual_seed(0)
    ref = _Root()
    g = copy.deepcopy(ref)
    own = _own_forward(g.a)
    _own_forward(ref.a)
    g = cg.graphify(g)
    _COST.update(**{"graph": 30e-6, "eager": 10e-6})
    for _ in range(10):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))
    assert g.a._cudagraphify_state.given_back
    assert g.a.__dict__["forward"] is own
    assert _plain_call(g.a.__dict__["_compiled_call_impl"], g.a)
    x = torch.randn(4, 8)
    assert torch.equal(g(x), ref(x))


def test_ungraphify_of_an_instance_keeps_its_own_forward():
    m = nn.Linear(8, 8)
    own = _own_forward(m)
    cg.graphify(m)
    assert m.__dict__["forward"] is not own
    cg.ungraphify(m)
    assert m.__dict__["forward"] is own


class _TwoShapes(_Root):
    pass


def test_a_new_signature_plans_again_without_the_given_back_piece(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    state = g._cudagraphify_state
    pieces = list(state.pieces)
    _COST.update(graph=1e-6, eager=50e-6)  # a piece would pay now: it is given back for good
    torch.manual_seed(1)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    for _ in range(6):
        x = torch.randn(2, 8)  # another signature: the root plans again
        assert torch.equal(g(x), ref(x))
    assert state.pieces == pieces and all(_plain(p) for p in pieces)
    assert len(state.decisions()) == 2


def test_ungraphify_of_the_root_takes_the_given_back_pieces_states(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    cg.ungraphify(g)
    for p in (g.a, g.b):
        assert _plain(p) and "_cudagraphify_state" not in p.__dict__
    g = cg.graphify(g)  # graphified again: its pieces are planned and timed afresh
    _COST.update(graph=1e-6, eager=50e-6)
    torch.manual_seed(0)
    for _ in range(10):
        g(torch.randn(4, 8))
    assert all(p._cudagraphify_state.given_back is None and cg.stats(p).graphs == 1
               for p in (g.a, g.b))


class _PickledRoot(_Root):
    """Graphified as a class (an instance-graphified module refuses pickling)."""


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_root_with_given_back_pieces_plans_afresh(timed, how):  # noqa: F811
    if how == "deepcopy":
        g = _run(**_GIVE_BACK)
        c = copy.deepcopy(g)
    else:
        cg.graphify(_PickledRoot)
        try:
            _COST.update(graph=30e-6, eager=10e-6)
            torch.manual_seed(0)
            g = _PickledRoot()
            for _ in range(10):
                g(torch.randn(4, 8))
            assert _plain(g.a) and g.a._cudagraphify_state.given_back
            c = pickle.loads(pickle.dumps(g))
        finally:
            cg.ungraphify(_PickledRoot)
        cg.graphify(c)
    _COST.update(graph=1e-6, eager=50e-6)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    for _ in range(10):
        x = torch.randn(4, 8)
        assert torch.equal(c(x), ref(x))
    assert cg.stats(c.a).graphs == 1 and c.a._cudagraphify_state.given_back is None


def test_a_share_graph_layers_piece_keeps_its_proxy(timed):  # noqa: F811
    # (share_graph pieces are not timed today; one given back keeps its proxy: its group's
    # templates serve the other layers' pieces)
    torch.manual_seed(0)
    refs = nn.ModuleList([_Root() for _ in range(2)])
    layers = copy.deepcopy(refs)
    cg.share_graph(layers)
    for _ in range(3):
        x = torch.randn(4, 8)
        for layer, ref in zip(layers, refs):
            assert torch.equal(layer(x), ref(x))
    piece = layers[1].a
    state = piece._cudagraphify_state
    with state.lock:
        state.give_back("given back by the test")
    assert not _plain(piece)
    x = torch.randn(4, 8)
    assert torch.equal(layers[1](x), refs[1](x))
    assert cg.stats(piece).eager_calls["given back by the test"] == 1
