"""A piecewise root's grad-mode calls while its pieces' training graphs wait for a backward
(``_fast.Bypass``): the pending pieces run their plain forward straight from their
``DirectCall``, past their own checks, for as long as nothing those checks look at changed.
CPU, through the simulated backend (``sim``), which replays what it recorded: every output is
compared with eager's bitwise, and the counters say which path each call took."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _fast
from cudagraphify._engine import PENDING
from cudagraphify._nested import bypassing

STATE = "_cudagraphify_state"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        t = torch.tensor([2.0])  # CROSS_DEVICE: the block runs eagerly, its children are pieces
        return x + self.fc2(self.fc(self.ln(x))) * t


class Model(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = Model()
    return ref, cg.graphify(copy.deepcopy(ref))


def _pieces(g) -> list:
    return [m.__dict__[STATE] for m in g.__dict__[STATE].pieces]


def _pending(g) -> int:
    return cg.stats(g).eager_calls.get(PENDING, 0)


@pytest.fixture
def spy(monkeypatch):
    """The states whose EagerFast.call ran, and those that reached the slow path, per call."""
    seen = {"fast": [], "slow": []}
    call, slow = _fast.EagerFast.call, _engine.GraphedState.slow

    def fast_call(self, fn, args, kwargs):
        seen["fast"].append(self.state)
        return call(self, fn, args, kwargs)

    def slow_call(self, fn, args, kwargs):
        seen["slow"].append(self)
        return slow(self, fn, args, kwargs)
    monkeypatch.setattr(_fast.EagerFast, "call", fast_call)
    monkeypatch.setattr(_engine.GraphedState, "slow", slow_call)
    return seen


def _settle(g, ref, x, kept: list, calls: int = 8):
    """Grad-mode calls whose outputs are all kept (no backward): the pieces' graphs wait."""
    for _ in range(calls):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o)
    root = g.__dict__[STATE]
    assert root._fast is not None and root._fast.bypass is not None, "no bypass armed"
    assert all(st._bypass[0] is root._fast.bypass for st in _pieces(g))


def test_kept_outputs_let_the_pieces_run_plain_past_their_checks(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    pieces = _pieces(g)
    assert len(pieces) == 6
    before, replays = _pending(g), cg.stats(g).replays
    spy["fast"].clear(), spy["slow"].clear()
    for _ in range(5):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o)
    root = g.__dict__[STATE]
    # the root's eager fast path only: no piece's EagerFast.call, no slow path
    assert spy["fast"] == [root] * 5 and spy["slow"] == []
    assert _pending(g) - before == 5 * len(pieces)  # each piece's call counted, as before
    assert cg.stats(g).replays == replays
    assert bypassing.token is None  # (disarmed after each call)


def test_no_bypass_without_pending_pieces_under_no_grad(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(6):
            assert torch.equal(g(x), ref(x))
        replays = cg.stats(g).replays
        for _ in range(3):
            assert torch.equal(g(x), ref(x))
    assert cg.stats(g).replays - replays == 3 * 6  # every piece replays its graph
    assert g.__dict__[STATE]._fast.bypass is None


def test_backward_of_the_kept_outputs_ends_it_and_the_pieces_replay(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    sum(o.sum() for o in kept).backward()
    kept.clear()
    bypass = g.__dict__[STATE]._fast.bypass
    assert not bypass.valid()
    replays = cg.stats(g).replays
    out = g(x)
    assert torch.equal(out, ref(x))
    assert cg.stats(g).replays - replays == 6, "the pieces' graphs are free again: replayed"
    assert g.__dict__[STATE]._fast.bypass is None


def test_backward_ends_it_while_the_outputs_stay_kept(sim):
    # (the autograd graph lives on with its outputs: only the backward's end says it settled)
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    sum(o.sum() for o in kept).backward()
    bypass = g.__dict__[STATE]._fast.bypass
    assert not bypass.valid()
    replays = cg.stats(g).replays
    assert torch.equal(g(x), ref(x))
    assert cg.stats(g).replays - replays == 6, "the pieces' graphs are free again: replayed"


def test_dropping_the_kept_outputs_ends_it(sim):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    kept.clear()
    replays, pending = cg.stats(g).replays, _pending(g)
    o = g(x)
    assert torch.equal(o, ref(x))
    assert cg.stats(g).replays - replays == 6 and _pending(g) == pending


def test_a_flag_change_ends_it(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not was)
        spy["fast"].clear()
        o = g(x)
        assert torch.equal(o, ref(x))
    finally:
        torch.use_deterministic_algorithms(was)
    # every piece decided by its own path again (its pending fast path, or the slow path)
    assert set(pieces := _pieces(g)) <= set(spy["fast"]) | set(spy["slow"]), pieces


def test_requires_grad_off_ends_it_and_the_pieces_get_inference_graphs(sim):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    g.requires_grad_(False), ref.requires_grad_(False)
    replays = cg.stats(g).replays
    for _ in range(4):
        o, w = g(x), ref(x)
        assert torch.equal(o, w) and not o.requires_grad
        kept.append(o)
    assert cg.stats(g).replays > replays, "no piece replayed once no parameter needs grad"


def test_a_hook_added_to_a_piece_runs(sim):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    double = lambda m, a, out: out * 2  # noqa: E731
    g.blocks[1].fc.register_forward_hook(double)
    ref.blocks[1].fc.register_forward_hook(double)
    for _ in range(3):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o)


def test_an_attribute_change_ends_it(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    g.blocks[0].ln.eps = ref.blocks[0].ln.eps = 0.5
    spy["fast"].clear(), spy["slow"].clear()
    o = g(x)
    assert torch.equal(o, ref(x))
    ln = g.blocks[0].ln.__dict__[STATE]
    assert ln in spy["fast"] or ln in spy["slow"]


def test_an_error_in_forward_disarms(sim):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)

    def boom(m, a, out):
        raise ValueError("boom")
    handle = g.blocks[1].register_forward_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        g(x)
    handle.remove()
    assert bypassing.token is None
    o = g(x)
    assert torch.equal(o, ref(x))


def test_another_thread_calling_a_piece_meanwhile_takes_its_own_path(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    ln = g.blocks[0].ln
    got = {}

    def other():
        got["token"] = bypassing.token
        got["out"] = ln(x)

    def from_inside(m, a):  # while the root's call is armed on this thread
        got["armed"] = bypassing.token is not None
        t = threading.Thread(target=other)
        t.start(), t.join()
    g.blocks[1].register_forward_pre_hook(from_inside)
    for _ in range(3):  # (a hook registered: the next call decides afresh, then it is armed)
        spy["fast"].clear(), spy["slow"].clear()
        o = g(x)
        assert torch.equal(o, ref(x))
        kept.append(o)
    assert got["armed"] and got["token"] is None
    assert torch.equal(got["out"], ref.blocks[0].ln(x))
    st = ln.__dict__[STATE]
    assert st in spy["fast"] or st in spy["slow"]


def test_ungraphify_runs_plain(sim):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    cg.ungraphify(g)
    pending = _pending(g) if g.__dict__.get(STATE) is not None else 0
    assert torch.equal(g(x), ref(x))
    assert (_pending(g) if g.__dict__.get(STATE) is not None else 0) == pending


def test_autocast_ends_it_for_its_calls(sim, spy):
    ref, g = _pair()
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    spy["fast"].clear(), spy["slow"].clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, w = g(x), ref(x)
    assert torch.equal(o, w) and o.dtype == w.dtype
    assert set(_pieces(g)) <= set(spy["fast"]) | set(spy["slow"])
    kept.append(o)
    for _ in range(3):  # autocast over: the pieces decide again, then it is armed again
        spy["fast"].clear()
        o = g(x)
        assert torch.equal(o, ref(x))
        kept.append(o)
    assert spy["fast"] == [g.__dict__[STATE]]


class DropBlock(Block):
    """A block with a dropout child: in eval mode it returns its input, a signature decided
    eager ("forward returns ... an input")."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(super().forward(x))


class DropModel(Model):
    def __init__(self):
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList(DropBlock() for _ in range(2))


def test_a_piece_decided_eager_is_bypassed_too_and_counted_under_its_reason(sim, spy):
    torch.manual_seed(0)
    ref = DropModel().eval()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    drop = g.blocks[0].drop.__dict__[STATE]
    why = drop._fast.reason
    assert drop._fast.still is None and drop._bypass[0] is g.__dict__[STATE]._fast.bypass
    n = drop.eager_calls[why]
    spy["fast"].clear()
    for _ in range(3):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o)
    assert spy["fast"] == [g.__dict__[STATE]] * 3
    assert drop.eager_calls[why] == n + 3


def test_training_steps_keep_replaying_beside_a_piece_decided_eager(sim):
    """Forward and backward each step (nothing pending): the dropout piece is bypassed, the
    other pieces replay their training graphs; outputs and gradients eager's."""
    torch.manual_seed(0)
    ref = DropModel().eval()
    g = cg.graphify(copy.deepcopy(ref))
    opt_g = torch.optim.SGD(g.parameters(), lr=1e-3)
    opt_r = torch.optim.SGD(ref.parameters(), lr=1e-3)
    replays = []
    for step in range(8):
        x = torch.randn(3, 8)
        o, w = g(x), ref(x)
        assert torch.equal(o, w) and o.isfinite().all(), step
        o.sum().backward(), w.sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()
        replays.append(cg.stats(g).replays)
    bypass = g.__dict__[STATE]._fast.bypass
    assert bypass is not None and g.blocks[0].drop.__dict__[STATE]._bypass[0] is bypass
    assert replays[-1] - replays[-2] == 6, replays  # every other piece replays each step


class Twice(nn.Module):
    """A root that calls one piece twice, on two shapes: its first call of a forward may make
    it decide afresh, and its second must not be run under the decision that was marked."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        t = torch.tensor([2.0])  # CROSS_DEVICE: the root runs eagerly, fc is a piece
        return self.fc(x).sum(0) * t + self.fc(x[:2]).sum(0)


def test_a_piece_called_twice_on_two_signatures_takes_each_call_by_its_own_decision(sim):
    torch.manual_seed(0)
    ref = Twice()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept, wanted = [], []
    for _ in range(10):  # (outputs kept: the piece's signatures wait for their backward)
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o), wanted.append(w)
    sum(o.sum() for o in kept).backward()
    sum(w.sum() for w in wanted).backward()
    kept.clear(), wanted.clear()
    for _ in range(4):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        o.sum().backward(), w.sum().backward()
    for p, q in zip(g.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
